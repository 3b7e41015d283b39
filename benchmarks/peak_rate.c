/* The arithmetic peak of this CPU's vector units, measured: every thread runs independent chains of
 * one multiply-add instruction on registers only (no loads, no stores), so nothing else limits it.
 * No matrix multiply in that dtype can run faster on these threads, whatever library computes it.
 * Built and called by benchmarks/peak_rate.py (cc -O2 -shared -pthread); x86-64 only.
 *
 * kind 0: vfmadd231ps on zmm  (float32, AVX-512F):      16 lanes x 2 FLOPs = 32 per instruction
 * kind 1: vfmadd231ps on ymm  (float32, AVX2 + FMA):     8 lanes x 2 FLOPs = 16 per instruction
 * kind 2: vdpbf16ps on zmm    (bfloat16, AVX512-BF16):  16 lanes x 2 pairs x 2 FLOPs = 64 per instruction
 *
 * Twelve chains: more than latency (4 cycles) x FMA ports (2) on current x86-64 cores, so every
 * port issues every cycle.
 */
#include <pthread.h>
#include <time.h>

#define TWELVE(op, reg, src)                                                                        \
    op " %%" reg "12, %%" src "13, %%" reg "0\n\t" op " %%" reg "12, %%" src "13, %%" reg "1\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "2\n\t" op " %%" reg "12, %%" src "13, %%" reg "3\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "4\n\t" op " %%" reg "12, %%" src "13, %%" reg "5\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "6\n\t" op " %%" reg "12, %%" src "13, %%" reg "7\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "8\n\t" op " %%" reg "12, %%" src "13, %%" reg "9\n\t"    \
    op " %%" reg "12, %%" src "13, %%" reg "10\n\t" op " %%" reg "12, %%" src "13, %%" reg "11\n\t"

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13"

static const double FLOPS_PER_INSTRUCTION[] = {32.0, 16.0, 64.0};
enum { INSTRUCTIONS_PER_ITERATION = 12 };

struct job {
    int kind;
    long iterations;
};

static void *run_chains(void *arg) {
    const struct job *job = (const struct job *)arg;
    long n = job->iterations;
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
 * a negative value when a thread could not start or `kind` is unknown. */
double peak_gflops(int kind, int threads, long iterations) {
    enum { MAX_THREADS = 1024 };
    pthread_t ids[MAX_THREADS];
    struct job job = {kind, iterations};
    if (kind < 0 || kind > 2 || threads < 1 || threads > MAX_THREADS) return -1.0;
    double start = now();
    int started = 0;
    for (; started < threads; ++started)
        if (pthread_create(&ids[started], 0, run_chains, &job) != 0) break;
    for (int i = 0; i < started; ++i) pthread_join(ids[i], 0);
    double seconds = now() - start;
    if (started != threads) return -1.0;
    return FLOPS_PER_INSTRUCTION[kind] * INSTRUCTIONS_PER_ITERATION * (double)iterations * threads / seconds / 1e9;
}
