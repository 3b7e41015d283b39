"""What the benchmark machine can do: its CPU, its GEMM rates for the model's weight shapes, its
arithmetic peak, and two limits on the workload's speed derived from them.

Both limits count only the linear layers (2 FLOPs per weight per row): every prompt token (a prefix
all prompts share once) through every layer but the LM head, one row per prompt through the head,
and every generated token through all of them. Attention, norms and sampling are left out, so no
engine reaches either:
  - the GEMM ceiling: those FLOPs at the best rate the job's own probe (modelzoo/cpu/gemm.py) measured
    for each weight shape, prompt rows at M = 1024 and generated rows at M = the rows decoded
    together. The fraction of it an engine reaches says how much of the machine it uses.
  - the peak bound: those FLOPs at the CPU's arithmetic peak for the dtype (benchmarks/peak_rate.py:
    its multiply-add instruction on registers only). No engine that computes them can pass it,
    however good its GEMM.
A shared virtual CPU's speed can dip by half for seconds at a time (seen on a 2-vCPU AMD EPYC
Zen 4), so MachineProbe measures as often as asked (the benchmark: before and after the engines)
and keeps the best rate seen for each.
"""
from __future__ import annotations

import platform
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks import peak_rate
from modelzoo.cpu.facts import cpu_flags, cpu_model
from modelzoo.cpu.gemm import ShapeChoice, available_backends, measure_shape, wrap
from modelzoo.cpu.precision import BF16Linear, HalfLinear, precision_policy

RATE_ROWS = (32, 1024)  # decode-sized and prefill-sized M, always timed
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16", "amx_int8")


def cpu_description() -> str:
    """'AMD EPYC (x86_64; avx2 avx512f avx512_bf16 avx512_vnni)'."""
    flags = " ".join(flag for flag in SHOWN_FLAGS if flag in cpu_flags()) or "no AVX2 / AVX-512 flags"
    return f"{cpu_model() or platform.processor() or 'unknown CPU'} ({platform.machine()}; {flags})"


@dataclass
class LinearShapes:
    """The model's linear layers: {(in, out): count} for the decoder layers and for the LM head."""

    body: Counter
    head: tuple[int, int]


def model_shapes(checkpoint: str) -> LinearShapes:
    """The linear shapes of the checkpoint's model, built on the meta device (no weights read)."""
    from modelzoo.models.checkpoint import load_hf_config
    from modelzoo.models import model_class

    hf_config = load_hf_config(checkpoint)
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(cls.config_from_hf(hf_config))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = max(linears, key=lambda m: m.out_features)  # the vocabulary projection
    body = Counter((m.in_features, m.out_features) for m in linears if m is not head)
    return LinearShapes(body, (head.in_features, head.out_features))


def timed_rows(decode_rows: int) -> tuple[int, ...]:
    """The M timed: RATE_ROWS and the rows decoded together."""
    return tuple(sorted({*RATE_ROWS, decode_rows}))


def gemm_rates(shapes: LinearShapes, dtype: torch.dtype, decode_rows: int) -> dict[tuple[int, int], ShapeChoice]:
    """Each weight shape's measurement by the job's own probe (modelzoo/cpu/gemm.py), at timed_rows():
    every backend's GFLOP/s (gflops[backend]["M=32"], ...) and whether it is batch-invariant. Where this CPU's
    precision policy multiplies the dtype with a C++ kernel of its own (bf16_linear, half_linear), that kernel."""
    policy = precision_policy(dtype, torch.device("cpu"))
    if policy.packed_gemm:
        kernel, layer = ("bf16_linear", BF16Linear) if policy.bf16_gemm else ("half_linear", HalfLinear)
        backends, build = [kernel], lambda linear, backend: layer(linear)
    else:
        backends, build = available_backends(torch.device("cpu"), dtype), wrap
    return {shape: measure_shape(*shape, dtype, backends, timed_rows=timed_rows(decode_rows), build=build)
            for shape in [*shapes.body, shapes.head]}


@dataclass
class Workload:
    """The rows each linear layer multiplies: prompt tokens (a shared prefix once) through the body,
    one row per prompt through the head, generated tokens through both, decoded `decode_rows` at a time."""

    prompt_tokens: int  # the shared prefix counted once
    prompts: int
    generated_tokens: int
    decode_rows: int
    shared_prefix: int = 0  # tokens every prompt starts with

    def flops(self, shapes: LinearShapes) -> float:
        """The linear layers' FLOPs."""
        body = sum(count * in_features * out_features for (in_features, out_features), count in shapes.body.items())
        head = shapes.head[0] * shapes.head[1]
        return 2 * (body * (self.prompt_tokens + self.generated_tokens) + head * (self.prompts + self.generated_tokens))


def ceiling_tokens_per_s(shapes: LinearShapes, rates: dict, work: Workload) -> float:
    """Generated tokens per second if the linear layers ran at the best measured rate and nothing else took time."""
    def seconds(shape: tuple[int, int], rows: int, rate_rows: int) -> float:
        best = max(by_rows[f"M={rate_rows}"] for by_rows in rates[shape].gflops.values())
        return 2 * shape[0] * shape[1] * rows / (best * 1e9)

    decode, prefill = work.decode_rows, RATE_ROWS[1]  # the head's one row a prompt: at the decode rate too
    total = sum(count * (seconds(shape, work.prompt_tokens, prefill) + seconds(shape, work.generated_tokens, decode))
                for shape, count in shapes.body.items())
    total += seconds(shapes.head, work.prompts, decode) + seconds(shapes.head, work.generated_tokens, decode)
    return work.generated_tokens / total


def peak_bound_tokens_per_s(shapes: LinearShapes, peak_gflops: float, work: Workload) -> float:
    """Generated tokens per second if the linear layers ran at the CPU's arithmetic peak."""
    return work.generated_tokens / (work.flops(shapes) / (peak_gflops * 1e9))


def format_rates(rates: dict[tuple[int, int], ShapeChoice], dtype: str) -> str:
    """One line per shape: each backend's GFLOP/s at each M ('*': not batch-invariant, never chosen)."""
    lines = []
    for (in_features, out_features), choice in rates.items():
        cells = ", ".join(f"{backend}{'' if choice.invariant.get(backend) else '*'} "
                          + "/".join(f"{rate:.0f}" for rate in by_rows.values())
                          for backend, by_rows in choice.gflops.items())
        lines.append(f"  {dtype:<8} {in_features}x{out_features:<6} {cells}")
    return "\n".join(lines)


class MachineProbe:
    """The CPU's peaks and the model's GEMM rates in each dtype, each the best of every measure() call."""

    def __init__(self, model: str, dtypes: list[str], threads: int, decode_rows: int) -> None:
        self.shapes = model_shapes(model)
        self.dtypes, self.threads, self.decode_rows = dtypes, threads, decode_rows
        self.peaks: dict[str, float | None] = {dtype: None for dtype in dtypes}
        self.rates: dict[str, dict[tuple[int, int], ShapeChoice]] = {}
        self.why_no_peak = ""

    def measure(self) -> None:
        """Measures the peaks and the rates once more, keeping the best of each."""
        torch.set_num_threads(self.threads)
        peaks, self.why_no_peak = peak_rate.measure_peaks(self.threads, self.dtypes)
        for dtype, peak in peaks.items():
            if peak:
                self.peaks[dtype] = max(peak, self.peaks[dtype] or 0.0)
        for dtype in self.dtypes:
            fresh = gemm_rates(self.shapes, getattr(torch, dtype), self.decode_rows)
            for shape, choice in fresh.items():
                kept = self.rates.setdefault(dtype, {}).setdefault(shape, choice)
                for backend, by_rows in choice.gflops.items():
                    best = kept.gflops.setdefault(backend, by_rows)
                    kept.gflops[backend] = {m: max(rate, best.get(m, 0.0)) for m, rate in by_rows.items()}

    def describe(self) -> str:
        """The peak line, then a GEMM rate line per dtype and weight shape."""
        lines = [f"arithmetic peak, GFLOP/s: {peak_rate.describe(self.peaks, self.threads, self.why_no_peak)}",
                 f"GEMM rates, GFLOP/s at M = {' / '.join(map(str, timed_rows(self.decode_rows)))} (weights in x "
                 "out; *: not batch-invariant here, never chosen):"]
        lines += [format_rates(self.rates[dtype], dtype) for dtype in self.dtypes]
        return "\n".join(lines)

    def limits(self, dtype: str, work: Workload) -> tuple[float | None, float | None]:
        """(GEMM ceiling, peak bound) in generated tokens per second; None where not measured."""
        if dtype not in self.rates or not work.generated_tokens:
            return None, None
        peak = self.peaks.get(dtype)
        bound = peak_bound_tokens_per_s(self.shapes, peak, work) if peak else None
        return ceiling_tokens_per_s(self.shapes, self.rates[dtype], work), bound
