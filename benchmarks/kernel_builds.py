#!/usr/bin/env python
"""C++ kernel builds side by side, on data laid out as in a job: the bfloat16-weight GEMMs over every layer's own
weights (packed side by side on huge pages, as a job gathers them) and the attention over every layer's own KV
cache (SmolLM2-135M's shapes by default), so weights and cache come from memory, as in a job, and not from a CPU
cache a loop over one tensor keeps warm.

    python -m modelzoo.cpu.kernels        # prints this checkout's build folder; edit a kernel, run it again
    python benchmarks/kernel_builds.py before=<build folder> after=<build folder>
    python benchmarks/kernel_builds.py                   # this checkout's build alone

Each round runs every build in turn, in this one process, on the same inputs (the first round is a warm-up);
printed per build: the median over the rounds of each GEMM's GFLOP/s (a decode step's rows, then a prefill
chunk's tokens) and of the attention's milliseconds per layer (a decode step; a packed prefill chunk), and whether
every output equals the first build's bit for bit. The GEMMs are ones a bfloat16 job runs on this CPU:
amx_bf16_linear where every build has it (AMX-BF16), else bf16_linear (AVX512-BF16; the SwiGLU gate | up with its
SiLU gate applied, as amx_bf16_silu_gate or bf16_silu_gate runs it), else half_linear (bfloat16 weights widened to float32 as they are read: every AVX2 CPU, and
AVX-512 ones without AVX512-BF16). The attention runs on any CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from modelzoo.models.kv_cache import zeroed_cache_tensor  # noqa: E402
from modelzoo.cpu.memory import PackedWeightArena  # noqa: E402
from modelzoo.cpu.kernels import _built_library, _load_library, kernel_build_dir  # noqa: E402
from modelzoo.cpu.precision import SILU_GATE_TILE, pack_bf16_weight, pack_half_weight, packed_bytes_bound  # noqa: E402

BF16_GATES = {"bf16_linear": "bf16_silu_gate", "amx_bf16_linear": "amx_bf16_silu_gate"}  # each GEMM's SiLU-gated one


def load_builds(specs: list[str]) -> dict[str, ModuleType]:
    """label=folder -> the kernel module built there; none given: this checkout's build as 'current'."""
    if not specs:
        specs = [f"current={kernel_build_dir()}"]
    builds = {}
    for spec in specs:
        label, separator, folder = spec.partition("=")
        if not separator or not label or not folder:
            sys.exit(f"error: a build is label=folder, not {spec!r}")
        library = _built_library(Path(folder))
        if library is None:
            sys.exit(f"error: no built kernel library in {folder} (python -m modelzoo.cpu.kernels builds one)")
        builds[label] = _load_library(library)
    return builds


class Workload:
    """Every layer's weights and KV cache, and one decode step's and one prefill chunk's inputs, seeded."""

    def __init__(self, args: argparse.Namespace, gemm: str | None) -> None:
        """gemm: the GEMM kernel the weights are packed for (bf16_linear, half_linear), or None for no GEMMs."""
        g = torch.Generator().manual_seed(0)
        hidden, inter, heads, kv, dim = args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim
        bf16 = lambda *shape: torch.randn(*shape, generator=g).bfloat16()
        pack = pack_bf16_weight if gemm in BF16_GATES else pack_half_weight
        self.shapes = {"qkv": (hidden, (heads + 2 * kv) * dim), "o": (heads * dim, hidden),
                       "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
        # Packed side by side on huge pages, in the order a forward pass reads them, as a job lays its weights out.
        shaped = lambda n, k: torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="meta")  # no memory
        arena = PackedWeightArena(args.layers * sum(packed_bytes_bound(shaped(n, k)) for k, n in self.shapes.values())
                                  + packed_bytes_bound(shaped(args.vocab, hidden)) if gemm else 0)
        self.weights = [{name: pack(bf16(n, k), arena.take) for name, (k, n) in self.shapes.items()}
                        for _ in range(args.layers)] if gemm else []
        self.vocab = args.vocab
        self.lm_head = pack(bf16(args.vocab, hidden), arena.take) if gemm else None
        lengths = torch.randint(args.min_context, args.max_context + 1, (args.rows,), generator=g)
        max_len = args.max_context + 1
        def cache() -> torch.Tensor:  # allocated as a job's KV cache is (huge pages where Linux gives them)
            storage = getattr(torch, args.cache)
            return zeroed_cache_tensor((args.rows, kv, max_len, dim), storage, torch.device("cpu")).copy_(
                torch.randn(args.rows, kv, max_len, dim, generator=g).to(storage))

        self.caches = [(cache(), cache()) for _ in range(args.layers)]
        rand = lambda *shape: torch.randn(*shape, generator=g)
        # Decode: one query per row after its context; prefill: prompts of the contexts' lengths packed in one row.
        self.decode = (rand(args.rows, 1, heads, dim), rand(args.rows, 1, kv, dim), rand(args.rows, 1, kv, dim),
                       torch.arange(args.rows), lengths[:, None], rand(args.rows, 1, dim), rand(args.rows, 1, dim))
        prompts, total = [], 0
        for row, length in enumerate(lengths.tolist()):
            if prompts and total + length > args.prefill_tokens:
                break
            prompts.append((row, length))
            total += length
        ends = torch.cat([torch.arange(1, length + 1) for _, length in prompts])[None]  # (1, N)
        slots = torch.cat([torch.full((length,), row) for row, length in prompts])[None]
        self.prefill = (rand(1, total, heads, dim), rand(1, total, kv, dim), rand(1, total, kv, dim), slots, ends,
                        rand(1, total, dim), rand(1, total, dim))
        self.prefill_tokens = total
        self.inputs = {rows: {name: rand(rows, k) for name, (k, _) in self.shapes.items()}
                       for rows in (args.rows, total)}


def run_gemms(kernels: ModuleType, gemm: str, work: Workload, rows: int, lm_head: bool
              ) -> tuple[dict[str, float], list]:
    """Every layer's GEMMs on `rows` rows with kernel `gemm`: GFLOP/s per GEMM, and the outputs of the last layer."""
    seconds: dict[str, float] = dict.fromkeys(work.shapes, 0.0)
    linear = getattr(kernels, gemm)
    outputs = []
    for weights in work.weights:
        outputs = []
        for name, (k, n) in work.shapes.items():
            x = work.inputs[rows][name]
            start = time.perf_counter()
            if name == "gate_up" and gemm in BF16_GATES:
                outputs.append(getattr(kernels, BF16_GATES[gemm])(x, weights[name], n // 2))
            else:
                outputs.append(linear(x, weights[name], None, n))
            seconds[name] += time.perf_counter() - start
    rates = {name: 2 * rows * k * n * len(work.weights) / seconds[name] / 1e9
             for name, (k, n) in work.shapes.items()}
    if lm_head:
        x = work.inputs[rows]["qkv"]
        start = time.perf_counter()
        outputs.append(linear(x, work.lm_head, None, work.vocab))
        rates["lm_head"] = 2 * rows * x.shape[1] * work.vocab / (time.perf_counter() - start) / 1e9
    return rates, outputs


def run_attention(kernels: ModuleType, work: Workload, inputs: tuple, scale: float) -> tuple[float, torch.Tensor]:
    """Every layer's attention over its own cache: milliseconds per layer, and the last layer's output."""
    q, new_k, new_v, slots, ends, cos, sin = inputs
    start = time.perf_counter()
    for keys, values in work.caches:
        out = kernels.cached_attention(q, new_k, new_v, keys, values, slots, torch.zeros_like(ends), ends, scale,
                                       cos, sin)
    return (time.perf_counter() - start) / len(work.caches) * 1e3, out


def gemm_kernel(builds: dict[str, ModuleType]) -> str | None:
    """A GEMM a bfloat16 job runs here that every build has: amx_bf16_linear (AMX-BF16), else bf16_linear
    (AVX512-BF16), else half_linear; None."""
    if all(hasattr(kernels, "amx_bf16_available") and kernels.amx_bf16_available() for kernels in builds.values()):
        return "amx_bf16_linear"
    if all(kernels.bf16_dot_available() for kernels in builds.values()):
        return "bf16_linear"
    if all(hasattr(kernels, "half_linear") for kernels in builds.values()):
        return "half_linear"
    return None


def measure(builds: dict[str, ModuleType], args: argparse.Namespace) -> dict[str, dict]:
    """{label: {"figures": {name: median}, "identical": bool}} over args.rounds rounds (the warm-up one dropped)."""
    gemm = gemm_kernel(builds)
    print(f"GEMMs: {gemm}" if gemm else "the GEMMs are skipped: a build has neither bf16_linear nor half_linear")
    work = Workload(args, gemm)
    scale = args.head_dim ** -0.5
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in builds}
    outputs: dict[str, list] = {}
    for round_index in range(args.rounds + 1):
        for label, kernels in builds.items():
            figures, outs = {}, []
            if gemm:
                for rows, phase in ((args.rows, "decode"), (work.prefill_tokens, "prefill")):
                    rates, last = run_gemms(kernels, gemm, work, rows, lm_head=phase == "decode")
                    figures.update({f"{phase} {name} GFLOP/s": rate for name, rate in rates.items()})
                    outs += last
            for phase, inputs in (("decode", work.decode), ("prefill", work.prefill)):
                milliseconds, out = run_attention(kernels, work, inputs, scale)
                figures[f"{phase} attention ms/layer"] = milliseconds
                outs.append(out)
            outputs[label] = outs
            if round_index:
                for name, value in figures.items():
                    samples[label].setdefault(name, []).append(value)
    first = outputs[next(iter(builds))]
    return {label: {"figures": {name: statistics.median(values) for name, values in samples[label].items()},
                    "identical": all(torch.equal(a, b) for a, b in zip(outputs[label], first))}
            for label in builds}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="*", help="label=build folder (default: this checkout's build)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up one (default: 5)")
    parser.add_argument("--threads", type=int, default=0, help="threads (default: every core available)")
    parser.add_argument("--layers", type=int, default=30, help="layers, each with its own weights and cache")
    parser.add_argument("--rows", type=int, default=164, help="rows of a decode step (default: 164)")
    parser.add_argument("--prefill_tokens", type=int, default=1024, help="most tokens of a prefill chunk")
    parser.add_argument("--min_context", type=int, default=60, help="shortest context a row attends over")
    parser.add_argument("--max_context", type=int, default=400, help="longest context a row attends over")
    parser.add_argument("--cache", choices=("float16", "bfloat16", "float32"), default="float16",
                        help="the KV cache's storage (default: float16, the bfloat16 policy's)")
    for name, default in (("hidden", 576), ("intermediate", 1536), ("heads", 9), ("kv_heads", 3), ("head_dim", 64),
                          ("vocab", 49152)):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"(default: {default}, SmolLM2-135M's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.rounds, args.layers, args.rows, args.prefill_tokens, args.min_context) < 1:
        sys.exit("error: --rounds, --layers, --rows, --prefill_tokens and --min_context must be >= 1")
    if args.max_context < args.min_context or args.prefill_tokens < args.max_context:
        sys.exit("error: need --min_context <= --max_context <= --prefill_tokens")
    if args.heads % args.kv_heads or args.intermediate % SILU_GATE_TILE or args.vocab % 16:
        sys.exit(f"error: --heads must be a multiple of --kv_heads, --intermediate of {SILU_GATE_TILE}, "
                 f"--vocab of 16")
    if args.threads:
        torch.set_num_threads(args.threads)
    builds = load_builds(args.builds)
    print(f"{torch.get_num_threads()} threads, {args.layers} layers, {args.rows} decode rows over contexts of "
          f"{args.min_context}-{args.max_context}, {args.cache} KV cache, median of {args.rounds} rounds")
    results = measure(builds, args)
    first = next(iter(builds))
    for label, result in results.items():
        figures = "  ".join(f"{name} {value:.{3 if 'ms' in name else 0}f}" for name, value in result["figures"].items())
        print(f"{label}: {figures}  identical to {first}: {result['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
