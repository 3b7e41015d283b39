#!/usr/bin/env python
"""A SwiGLU MLP's gate | up projection with its SiLU gate applied in the GEMM (`half_silu_gate`) against the GEMM then
the gate (`half_linear`, then `silu_mul`: what the MLP ran before), side by side on this CPU.

    .venv/bin/python benchmarks/gated_mlp.py                           # SmolLM2-135M and Llama-3.2-3B shapes
    .venv/bin/python benchmarks/gated_mlp.py --shapes 576x1536 --rows 164,1024 --dtypes float32 --threads 2

For each weight dtype (bfloat16 and float16: the 16-bit weights of a CPU without native 16-bit multiplies; float32:
the float32 GEMM candidate `packed`), MLP shape (hidden x intermediate) and row count M: GFLOP/s of the gate | up
projection both ways, and their ratio. Every one of --layers layers has weights of its own, packed side by side on
huge pages as a job gathers them, so they come from memory as in a job and not from a cache one weight keeps warm.
Each figure is the median of --rounds rounds over every layer, the two ways alternating layer by layer; their
outputs are checked bit for bit (the fused one must give silu_mul's bits).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.cpu_gemm_paths import parse_shapes  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from modelzoo.cpu.kernels import cpu_kernels  # noqa: E402
from modelzoo.cpu.memory import copy_into, huge_page_slices  # noqa: E402
from modelzoo.cpu.precision import HalfLinear, SiluGatedHalfLinear  # noqa: E402

DEFAULT_SHAPES = "576x1536,3072x8192"  # SmolLM2-135M's MLP, Llama-3.2-3B's


def gathered(layers: list[HalfLinear]) -> None:
    """Every layer's packed weight moved side by side into one huge-page mapping (as gather_packed_weights does)."""
    places = huge_page_slices([layer.packed_bytes() for layer in layers])
    for layer, place in zip(layers, places):
        layer.packed = copy_into(place, layer.packed)


def measure(hidden: int, intermediate: int, dtype: torch.dtype, rows: int, layers: int, rounds: int
            ) -> tuple[float, float]:
    """GFLOP/s of (half_linear then silu_mul, half_silu_gate) over `layers` layers of their own weights."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    plain, fused = [], []
    for _ in range(layers):
        linear = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype).requires_grad_(False)
        linear.weight.copy_(torch.randn(2 * intermediate, hidden, generator=generator))
        plain.append(HalfLinear(linear))
        fused.append(SiluGatedHalfLinear(linear))
    gathered(plain + fused)
    x = torch.randn(rows, hidden, generator=generator)
    if not torch.equal(kernels.silu_mul(plain[0](x)), fused[0](x)):
        raise SystemExit("error: half_silu_gate does not give silu_mul's bits over half_linear's sums")
    samples: tuple[list[float], list[float]] = ([], [])
    for round_index in range(rounds + 1):  # the first round warms up
        seconds = [0.0, 0.0]
        for separate, together in zip(plain, fused):
            for way, call in enumerate((lambda: kernels.silu_mul(separate(x)), lambda: together(x))):
                start = time.perf_counter()
                call()
                seconds[way] += time.perf_counter() - start
        if round_index:
            for way in (0, 1):
                samples[way].append(2 * rows * hidden * 2 * intermediate * layers / seconds[way] / 1e9)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"hidden x intermediate,... (default: {DEFAULT_SHAPES})")
    parser.add_argument("--rows", default="16,164,1024", help="row counts M (default: 16,164,1024)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32", help="weight dtypes (default: all three)")
    parser.add_argument("--layers", type=int, default=8, help="layers, each with weights of its own (default: 8)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up one (default: 5)")
    parser.add_argument("--threads", type=int, default=0, help="threads (default 0: every core available)")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    dtypes = [getattr(torch, name, None) for name in args.dtypes.split(",")]
    if any(dtype not in (torch.bfloat16, torch.float16, torch.float32) for dtype in dtypes):
        raise SystemExit(f"error: --dtypes takes bfloat16, float16 and float32, got {args.dtypes!r}")
    if any(intermediate % 32 for _, intermediate in shapes) or min(args.layers, args.rounds) < 1:
        raise SystemExit("error: each intermediate size must be a multiple of 32, --layers and --rounds at least 1")
    if cpu_kernels() is None:
        raise SystemExit("error: the C++ kernels are not built here (make setup)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_description()}; {torch.get_num_threads()} threads; half_linear path {cpu_kernels().half_gemm_path()}")
    for dtype in dtypes:
        for hidden, intermediate in shapes:
            for rows in (int(m) for m in args.rows.split(",")):
                separate, fused = measure(hidden, intermediate, dtype, rows, args.layers, args.rounds)
                print(f"{str(dtype).removeprefix('torch.'):8s} {hidden}x{2 * intermediate} M={rows:<5d} GFLOP/s: "
                      f"half_linear + silu_mul {separate:6.1f}  half_silu_gate {fused:6.1f}  ({fused / separate:.2f}x)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
