"""What the benchmark machine can do: its CPU, its GEMM rates for the model's weight shapes, its
arithmetic peak and memory read bandwidth, and two limits on the workload's speed derived from them.

Both limits count only the linear layers (2 FLOPs per weight per row): every prompt token (a prefix
all prompts share once) through every layer but the LM head, save the last layer's linears after its
attention, one row per prompt through those and the head (its first generated token), and every other
generated token's input through all of them (a decode step feeds a row's last token to choose the next).
Attention, norms and sampling are left out, so no engine reaches either:
  - the GEMM ceiling: those FLOPs at the best rate the job's own probe (modelzoo/cpu/gemm.py) measured
    for each weight shape, prompt rows at M = 1024 and generated rows at M = the rows decoded
    together. The fraction of it an engine reaches says how much of the machine it uses.
  - the roofline: the prefill's FLOPs at the CPU's arithmetic peak for the dtype (benchmarks/peak_rate.py:
    its multiply-add instruction on registers only), then the decode at the slower of its FLOPs at that
    peak and its reads at the measured read bandwidth: each decode step reads every weight once (in the
    dtype's bytes under zoo-infer's precision policy; int8: a byte and a float32 scale per 32) and each
    row's KV cache up to its length. No engine that computes them and holds the weights in those bytes can
    pass it, however good its GEMM. Decoding a large model with few rows is bound by the reads, a small
    one with many rows by the FLOPs; the decode's own bound (`DecodeBound`) says which.
A shared virtual CPU's speed can dip by half for seconds at a time (seen on a 2-vCPU AMD EPYC
Zen 4), so MachineProbe measures as often as asked (the benchmark: before and after the engines)
and keeps the best rate seen for each.
"""
from __future__ import annotations

import math
import platform
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks import peak_rate
from modelzoo.cpu.facts import cpu_flags, cpu_model, held_to_avx2
from modelzoo.cpu.gemm import ShapeChoice, available_backends, available_bf16_kernels, measure_shape, wrap
from modelzoo.cpu.precision import BF16Linear, HalfLinear, linear_like, linear_shape, precision_policy

INT8_GROUP = 32  # model.int8_group_size's default: a float32 scale per 32 int8 weights
RATE_ROWS = (32, 1024)  # decode-sized and prefill-sized M, always timed
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16", "amx_int8")


def cpu_description() -> str:
    """'AMD EPYC (x86_64; avx2 avx512f avx512_bf16 avx512_vnni)'; '..., run at AVX2 (ATEN_CPU_CAPABILITY)' on an
    AVX-512 CPU held to AVX2 (the flags past it hidden: modelzoo/cpu/facts.py)."""
    flags = " ".join(flag for flag in SHOWN_FLAGS if flag in cpu_flags()) or "no AVX2 / AVX-512 flags"
    capped = ", run at AVX2 (ATEN_CPU_CAPABILITY)" if held_to_avx2() else ""
    return f"{cpu_model() or platform.processor() or 'unknown CPU'} ({platform.machine()}; {flags}{capped})"


@dataclass
class LinearShapes:
    """The model's linear layers: {(in, out): count} for the decoder layers and for the LM head; kv_features: the
    values a token's keys (or its values) take in the KV cache over every layer (layers x kv heads x head dim);
    read_alone: those of `body` that a prompt runs on one row, not on every token (the last layer's after its
    attention)."""

    body: Counter
    head: tuple[int, int]
    kv_features: int = 0
    read_alone: Counter = field(default_factory=Counter)

    def weights(self) -> int:
        """The weights of every linear layer, the head's included."""
        return sum(count * i * o for (i, o), count in self.body.items()) + self.head[0] * self.head[1]


def storage_bytes(dtype: str) -> tuple[float, int]:
    """(bytes a weight takes, bytes a KV cache value takes) in a zoo-infer job of `dtype` on this CPU, under its
    precision policy; int8: int8 weights with a float32 scale per INT8_GROUP, float32 activations."""
    int8 = dtype == "int8"
    torch_dtype = torch.float32 if int8 else getattr(torch, dtype)
    policy = precision_policy(torch_dtype, torch.device("cpu"), int8_weights=int8)
    return (1 + 4 / INT8_GROUP if int8 else torch_dtype.itemsize), policy.kv_cache.itemsize


def model_shapes(checkpoint: str) -> LinearShapes:
    """The linear shapes of the checkpoint's model, built on the meta device (no weights read); which of the last
    layer's linears a prompt runs on one row, seen in a two-token forward there."""
    from modelzoo.models.checkpoint import load_hf_config
    from modelzoo.models import model_class
    from modelzoo.models.kv_cache import KVCache

    hf_config = load_hf_config(checkpoint)
    cls = model_class(hf_config)
    config = cls.config_from_hf(hf_config)
    meta = torch.device("meta")
    with meta:
        model = cls(config)
    model.build_buffers(meta)
    head = model.get_submodule(model.head_name)  # the vocabulary projection
    body = Counter(linear_shape(m) for m in model.modules() if linear_like(m) and m is not head)
    rows: dict[nn.Module, int] = {}  # each last-layer linear -> the rows it multiplied

    def record(linear: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        rows[linear] = args[0].shape[:-1].numel()

    for module in model.get_submodule(model.layers_name)[-1].modules():
        if linear_like(module):
            module.register_forward_hook(record)
    cache = KVCache(config.num_layers, 1, config.num_kv_heads, 2, config.head_dim, torch.float32, meta)
    tokens = torch.zeros((1, 2), dtype=torch.long, device=meta)  # one prompt of two tokens
    with torch.inference_mode():
        model(tokens, torch.arange(2, device=meta)[None], cache, None, length=2)
    read_alone = Counter(linear_shape(m) for m, count in rows.items() if count == 1)
    return LinearShapes(body, linear_shape(head), config.num_layers * config.num_kv_heads * config.head_dim,
                        read_alone)


def timed_rows(decode_rows: int) -> tuple[int, ...]:
    """The M timed: RATE_ROWS and the rows decoded together."""
    return tuple(sorted({*RATE_ROWS, decode_rows}))


def gemm_rates(shapes: LinearShapes, dtype: torch.dtype, decode_rows: int) -> dict[tuple[int, int], ShapeChoice]:
    """Each weight shape's measurement by the job's own probe (modelzoo/cpu/gemm.py), at timed_rows():
    every backend's GFLOP/s (gflops[backend]["M=32"], ...) and whether it is batch-invariant. Where this CPU's
    precision policy multiplies the dtype with C++ kernels of its own (bf16_linear and, with AMX, amx_bf16_linear;
    half_linear), those kernels."""
    policy = precision_policy(dtype, torch.device("cpu"))
    if policy.bf16_gemm:
        backends = available_bf16_kernels()
        build = lambda linear, backend: BF16Linear(linear, backend == "amx_bf16_linear")
    elif policy.half_gemm:
        backends, build = ["half_linear"], lambda linear, backend: HalfLinear(linear)
    else:
        backends, build = available_backends(torch.device("cpu"), dtype), wrap
    return {shape: measure_shape(*shape, dtype, backends, timed_rows=timed_rows(decode_rows), build=build)
            for shape in [*shapes.body, shapes.head]}


@dataclass
class Workload:
    """The rows each linear layer multiplies: prompt tokens (a shared prefix once) through the body, one row per
    prompt through the head (its first generated token) and the last layer's linears after its attention, every
    other generated token's input through all of them, decoded `decode_rows` at a time."""

    prompt_tokens: int  # the shared prefix counted once
    prompts: int
    generated_tokens: int
    decode_rows: int
    shared_prefix: int = 0  # tokens every prompt starts with

    def flops(self, shapes: LinearShapes) -> float:
        """The linear layers' FLOPs."""
        return self.prefill_flops(shapes) + self.decode_flops(shapes)

    def prefill_flops(self, shapes: LinearShapes) -> float:
        """The linear layers' FLOPs over the prompts: every prompt token through the body, a row a prompt through the
        head (its first generated token) and the linears read alone."""
        head = shapes.head[0] * shapes.head[1]
        alone = sum(count * i * o for (i, o), count in shapes.read_alone.items())
        return 2 * ((shapes.weights() - head - alone) * self.prompt_tokens + (head + alone) * self.prompts)

    def decode_flops(self, shapes: LinearShapes) -> float:
        """The linear layers' FLOPs of the decode steps: a row through every layer for each token they choose."""
        return 2 * shapes.weights() * self.decode_tokens

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode steps choose: every generated token but each prompt's first."""
        return max(0, self.generated_tokens - self.prompts)

    def kv_reads(self) -> float:
        """Cache positions the decode steps read, over every row and step, each prompt generating its share of the
        tokens: its prompt (a shared prefix included: each row holds its own copy) and the tokens before."""
        per_prompt = self.generated_tokens / max(1, self.prompts)  # tokens each prompt generates, on average
        whole_prompts = self.prompt_tokens + self.shared_prefix * max(0, self.prompts - 1)
        return max(0.0, per_prompt - 1) * (whole_prompts + self.prompts * per_prompt / 2)


@dataclass
class DecodeBound:
    """The least time the workload's decode steps can take: each step reads every weight once and each row's KV
    cache (the bytes at the read bandwidth), and does its FLOPs (at the arithmetic peak); the slower binds."""

    steps: int
    weight_bytes: float  # a step's
    kv_bytes: float  # every step's together
    flops: float
    memory_seconds: float | None  # None: the bandwidth was not measured, or a step's reads fit in the cache
    compute_seconds: float | None  # None: no peak for the dtype
    cache_bytes: int = 0  # the last-level cache a step's reads fit in (0: they do not, or its size is unknown)

    @property
    def seconds(self) -> float | None:
        """The bound: the slower of what is known; None where neither is."""
        known = [s for s in (self.memory_seconds, self.compute_seconds) if s is not None]
        return max(known) if known else None

    def describe(self) -> str:
        """'63 steps reading 0.54 GB of weights each and 1.52 GB of KV cache on average: 3.5 s at the read
        bandwidth; their FLOPs 7.8 s at the peak: the FLOPs bind'."""
        reads = (f"{self.steps} steps reading {self.weight_bytes / 1e9:.2f} GB of weights each and "
                 f"{self.kv_bytes / max(1, self.steps) / 1e9:.2f} GB of KV cache on average")
        memory = f"{self.memory_seconds:.1f} s at the read bandwidth" if self.memory_seconds is not None else \
            f"each step's reads fit in the {self.cache_bytes >> 20} MiB last-level cache: no memory bound" \
            if self.cache_bytes else "bandwidth not measured"
        compute = "no peak for this dtype" if self.compute_seconds is None else \
            f"their FLOPs {self.compute_seconds:.1f} s at the peak"
        binds = ""
        if self.memory_seconds is not None and self.compute_seconds is not None:
            binds = ": the reads bind" if self.memory_seconds >= self.compute_seconds else ": the FLOPs bind"
        return f"{reads}: {memory}; {compute}{binds}"


def decode_bound(shapes: LinearShapes, dtype: str, work: Workload, peak_gflops: float | None,
                 bandwidth_gbps: float | None, cache_bytes: int = 0) -> DecodeBound:
    """The workload's decode bound in `dtype` (storage_bytes) at this peak and read bandwidth (None: unknown). Where
    a step's reads fit in the last-level cache (`cache_bytes`; 0: unknown), they need not come from memory, and the
    read bandwidth bounds nothing."""
    per_weight, per_value = storage_bytes(dtype)
    steps = math.ceil(work.decode_tokens / max(1, work.decode_rows))
    weight_bytes = per_weight * shapes.weights()
    kv_bytes = work.kv_reads() * 2 * shapes.kv_features * per_value  # keys and values
    flops = work.decode_flops(shapes)
    cached = weight_bytes + kv_bytes / max(1, steps) <= cache_bytes
    memory = (steps * weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9) if bandwidth_gbps and not cached else None
    compute = flops / (peak_gflops * 1e9) if peak_gflops else None
    return DecodeBound(steps, weight_bytes, kv_bytes, flops, memory, compute, cache_bytes if cached else 0)


def ceiling_tokens_per_s(shapes: LinearShapes, rates: dict, work: Workload) -> float:
    """Generated tokens per second if the linear layers ran at the best measured rate and nothing else took time."""
    def seconds(shape: tuple[int, int], rows: int, rate_rows: int) -> float:
        best = max(by_rows[f"M={rate_rows}"] for by_rows in rates[shape].gflops.values())
        return 2 * shape[0] * shape[1] * rows / (best * 1e9)

    decode, prefill = work.decode_rows, RATE_ROWS[1]  # one row a prompt (the head, read alone): the decode rate
    total = sum((count - shapes.read_alone[shape]) * seconds(shape, work.prompt_tokens, prefill)
                + shapes.read_alone[shape] * seconds(shape, work.prompts, decode)
                + count * seconds(shape, work.decode_tokens, decode)
                for shape, count in shapes.body.items())
    total += seconds(shapes.head, work.prompts, decode) + seconds(shapes.head, work.decode_tokens, decode)
    return work.generated_tokens / total


def roofline_tokens_per_s(shapes: LinearShapes, dtype: str, peak_gflops: float, bandwidth_gbps: float | None,
                          work: Workload, cache_bytes: int = 0) -> float:
    """Generated tokens per second if the prefill ran at the CPU's arithmetic peak and the decode at its bound (the
    peak, or the read bandwidth where the reads take longer and do not fit in the last-level cache)."""
    decode = decode_bound(shapes, dtype, work, peak_gflops, bandwidth_gbps, cache_bytes)
    return work.generated_tokens / (work.prefill_flops(shapes) / (peak_gflops * 1e9) + decode.seconds)


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
    """The CPU's peaks, its read bandwidth and the model's GEMM rates in each dtype, each the best of every
    measure() call."""

    def __init__(self, model: str, dtypes: list[str], threads: int, decode_rows: int) -> None:
        self.shapes = model_shapes(model)
        self.dtypes, self.threads, self.decode_rows = dtypes, threads, decode_rows
        self.peaks: dict[str, float | None] = {dtype: None for dtype in dtypes}
        self.rates: dict[str, dict[tuple[int, int], ShapeChoice]] = {}
        self.why_no_peak = ""
        self.bandwidth: float | None = None
        self.why_no_bandwidth = ""

    def measure(self) -> None:
        """Measures the peaks, the read bandwidth and the rates once more, keeping the best of each."""
        torch.set_num_threads(self.threads)
        peaks, self.why_no_peak = peak_rate.measure_peaks(self.threads, self.dtypes)
        for dtype, peak in peaks.items():
            if peak:
                self.peaks[dtype] = max(peak, self.peaks[dtype] or 0.0)
        bandwidth, self.why_no_bandwidth = peak_rate.measure_bandwidth(self.threads)
        if bandwidth:
            self.bandwidth = max(bandwidth, self.bandwidth or 0.0)
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
                 "memory read bandwidth: "
                 + peak_rate.describe_bandwidth(self.bandwidth, self.threads, self.why_no_bandwidth),
                 f"GEMM rates, GFLOP/s at M = {' / '.join(map(str, timed_rows(self.decode_rows)))} (weights in x "
                 "out; *: not batch-invariant here, never chosen):"]
        lines += [format_rates(self.rates[dtype], dtype) for dtype in self.dtypes]
        return "\n".join(lines)

    def limits(self, dtype: str, work: Workload) -> tuple[float | None, float | None]:
        """(GEMM ceiling, roofline) in generated tokens per second; None where not measured."""
        if dtype not in self.rates or not work.generated_tokens:
            return None, None
        peak = self.peaks.get(dtype)
        bound = roofline_tokens_per_s(self.shapes, dtype, peak, self.bandwidth, work,
                                      peak_rate.largest_cache_bytes()) if peak else None
        return ceiling_tokens_per_s(self.shapes, self.rates[dtype], work), bound

    def decode_bound(self, dtype: str, work: Workload) -> DecodeBound:
        """The decode's bound in `dtype` (int8 too: its reads, with no peak for its arithmetic)."""
        return decode_bound(self.shapes, dtype, work, self.peaks.get(dtype), self.bandwidth,
                            peak_rate.largest_cache_bytes())
