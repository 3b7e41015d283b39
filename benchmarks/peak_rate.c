/* The arithmetic peak of this CPU's vector units, measured: every thread runs independent chains of
 * one multiply-add instruction on registers only (no loads, no stores), so nothing else limits it.
 * No matrix multiply in that dtype can run faster on these threads, whatever library computes it.
 * Also the rate at which these threads read memory (read_gbps): the bound on a step that must stream its weights
 * and KV cache from DRAM, as a decode step of a large model does.
 * Built and called by benchmarks/peak_rate.py (cc -O2 -shared -pthread); x86-64 only.
 *
 * kind 0: vfmadd231ps on zmm  (float32, AVX-512F):      16 lanes x 2 FLOPs = 32 per instruction
 * kind 1: vfmadd231ps on ymm  (float32, AVX2 + FMA):     8 lanes x 2 FLOPs = 16 per instruction
 * kind 2: vdpbf16ps on zmm    (bfloat16, AVX512-BF16):  16 lanes x 2 pairs x 2 FLOPs = 64 per instruction
 * kind 3: tdpbf16ps on tiles  (bfloat16, AMX-BF16):     16 x 16 outputs x 32 products x 2 FLOPs = 16384
 * kind 4: tdpbssd on tiles    (int8, AMX-INT8):         16 x 16 outputs x 64 products x 2 ops = 32768
 *
 * Twelve chains for the vector instructions: more than latency (4 cycles) x FMA ports (2) on current
 * x86-64 cores, so every port issues every cycle. Four accumulator tiles for AMX, each fed by two of
 * four source tiles, as its GEMM kernels do. AMX needs the kernel's permission for its tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+), asked once per process.
 */
#include <emmintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TWELVE(op, reg, src)                                                                        \
    op " %%" reg "12, %%" src "13, %%" reg "0\n\t" op " %%" reg "12, %%" src "13, %%" reg "1\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "2\n\t" op " %%" reg "12, %%" src "13, %%" reg "3\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "4\n\t" op " %%" reg "12, %%" src "13, %%" reg "5\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "6\n\t" op " %%" reg "12, %%" src "13, %%" reg "7\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "8\n\t" op " %%" reg "12, %%" src "13, %%" reg "9\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "10\n\t" op " %%" reg "12, %%" src "13, %%" reg "11\n\t"

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13"

static const double FLOPS_PER_ITERATION[] = {32.0 * 12, 16.0 * 12, 64.0 * 12, 16384.0 * 4, 32768.0 * 4};
enum { KINDS = 5, FIRST_AMX_KIND = 3 };

/* The AMX tile configuration (palette 1): eight tiles of 16 rows x 64 bytes. */
struct tile_config {
    unsigned char palette_id, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
};

#define AMX_FOUR(op) op " %%tmm6, %%tmm4, %%tmm0\n\t" op " %%tmm7, %%tmm4, %%tmm1\n\t" \
                     op " %%tmm6, %%tmm5, %%tmm2\n\t" op " %%tmm7, %%tmm5, %%tmm3\n\t"

static void run_tiles(int kind, long n) {
    struct tile_config config = {0};
    config.palette_id = 1;
    for (int tile = 0; tile < 8; ++tile) {
        config.colsb[tile] = 64;
        config.rows[tile] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
    /* Zeroed sources and accumulators: nothing ever overflows or turns denormal. */
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
                     "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7" ::);
    if (kind == 3)
        for (long i = 0; i < n; ++i) __asm__ volatile(AMX_FOUR("tdpbf16ps") ::);
    else
        for (long i = 0; i < n; ++i) __asm__ volatile(AMX_FOUR("tdpbssd") ::);
    __asm__ volatile("tilerelease" ::);
}

/* Asks Linux for the AMX tile data state; 0 when granted. */
static int request_amx(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

struct job {
    int kind;
    long iterations;
};

static void *run_chains(void *arg) {
    const struct job *job = (const struct job *)arg;
    long n = job->iterations;
    if (job->kind >= FIRST_AMX_KIND) {
        run_tiles(job->kind, n);
        return 0;
    }
    /* Zeroed sources: the values never become denormal or infinite, whatever the count. */
    if (job->kind == 0) {
        __asm__ volatile("vpxord %%zmm12, %%zmm12, %%zmm12\n\tvpxord %%zmm13, %%zmm13, %%zmm13" ::: CLOBBERS);
        for (long i = 0; i < n; ++i) __asm__ volatile(TWELVE("vfmadd231ps", "zmm", "zmm") ::: CLOBBERS);
    } else if (job->kind == 1) {
        __asm__ volatile("vpxor %%ymm12, %%ymm12, %%ymm12\n\tvpxor %%ymm13, %%ymm13, %%ymm13" ::: CLOBBERS);
        for (long i = 0; i < n; ++i) __asm__ volatile(TWELVE("vfmadd231ps", "ymm", "ymm") ::: CLOBBERS);
    } else {
        __asm__ volatile("vpxord %%zmm12, %%zmm12, %%zmm12\n\tvpxord %%zmm13, %%zmm13, %%zmm13" ::: CLOBBERS);
        for (long i = 0; i < n; ++i) __asm__ volatile(TWELVE("vdpbf16ps", "zmm", "zmm") ::: CLOBBERS);
    }
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* GFLOP/s of `threads` threads each running `iterations` iterations of instruction `kind`;
 * a negative value when a thread could not start, `kind` is unknown or AMX was refused. */
double peak_gflops(int kind, int threads, long iterations) {
    enum { MAX_THREADS = 1024 };
    pthread_t ids[MAX_THREADS];
    struct job job = {kind, iterations};
    if (kind < 0 || kind >= KINDS || threads < 1 || threads > MAX_THREADS) return -1.0;
    if (kind >= FIRST_AMX_KIND && request_amx() != 0) return -1.0;
    double start = now();
    int started = 0;
    for (; started < threads; ++started)
        if (pthread_create(&ids[started], 0, run_chains, &job) != 0) break;
    for (int i = 0; i < started; ++i) pthread_join(ids[i], 0);
    double seconds = now() - start;
    if (started != threads) return -1.0;
    return FLOPS_PER_ITERATION[kind] * (double)iterations * threads / seconds / 1e9;
}

struct reader {
    long bytes;              /* of its own buffer, a multiple of 64 */
    int passes;              /* reads of the whole buffer, timed together */
    int *ready, *go;         /* threads with their buffers touched; 1: start reading, -1: give up */
    double start, end;       /* its timed reads */
    long long sum;           /* what it read, kept so that the reads are not optimised away */
    int failed;
};

static void *run_reader(void *arg) {
    struct reader *reader = (struct reader *)arg;
    char *buffer = NULL;
    /* Its own buffer, first touched by this thread: its pages lie where it runs. */
    reader->failed = posix_memalign((void **)&buffer, 4096, (size_t)reader->bytes) != 0;
    if (!reader->failed) memset(buffer, 1, (size_t)reader->bytes);
    __atomic_add_fetch(reader->ready, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(reader->go, __ATOMIC_SEQ_CST) == 0) {
    }
    reader->start = now();
    __m128i sums[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    for (int pass = 0; !reader->failed && *reader->go > 0 && pass < reader->passes; ++pass) {
        for (long offset = 0; offset < reader->bytes; offset += 64) {  /* a cache line: four 16-byte loads */
            const __m128i *line = (const __m128i *)(buffer + offset);
            sums[0] = _mm_add_epi64(sums[0], _mm_load_si128(line));
            sums[1] = _mm_add_epi64(sums[1], _mm_load_si128(line + 1));
            sums[2] = _mm_add_epi64(sums[2], _mm_load_si128(line + 2));
            sums[3] = _mm_add_epi64(sums[3], _mm_load_si128(line + 3));
        }
    }
    reader->end = now();
    const __m128i total = _mm_add_epi64(_mm_add_epi64(sums[0], sums[1]), _mm_add_epi64(sums[2], sums[3]));
    reader->sum = _mm_cvtsi128_si64(total) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(total, total));
    free(buffer);
    return 0;
}

/* GB/s at which `threads` threads together read memory: each reads its own buffer of `bytes_per_thread` bytes
 * (first touched by itself, before any thread starts) `passes` times, from the first thread's start to the last
 * one's end; a negative value when a buffer or a thread could not be had. Buffers far larger than the last-level
 * cache measure DRAM's rate. */
double read_gbps(int threads, long bytes_per_thread, int passes) {
    enum { MAX_THREADS = 1024 };
    pthread_t ids[MAX_THREADS];
    struct reader readers[MAX_THREADS];
    int ready = 0, go = 0;
    bytes_per_thread = bytes_per_thread / 64 * 64;
    if (threads < 1 || threads > MAX_THREADS || bytes_per_thread < 64 || passes < 1) return -1.0;
    int started = 0;
    for (; started < threads; ++started) {
        readers[started] = (struct reader){bytes_per_thread, passes, &ready, &go, 0.0, 0.0, 0, 0};
        if (pthread_create(&ids[started], 0, run_reader, &readers[started]) != 0) break;
    }
    while (__atomic_load_n(&ready, __ATOMIC_SEQ_CST) < started) {
    }
    __atomic_store_n(&go, started == threads ? 1 : -1, __ATOMIC_SEQ_CST);
    double first = 0.0, last = 0.0;
    int failed = started != threads;
    for (int i = 0; i < started; ++i) {
        pthread_join(ids[i], 0);
        failed |= readers[i].failed;
        if (i == 0 || readers[i].start < first) first = readers[i].start;
        if (i == 0 || readers[i].end > last) last = readers[i].end;
    }
    if (failed || last <= first) return -1.0;
    return (double)bytes_per_thread * passes * threads / (last - first) / 1e9;
}
