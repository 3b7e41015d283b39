"""What the benchmark machine can do: its CPU, its GEMM rates for the model's weight shapes, and the
workload's ceiling (its matrix-multiply FLOPs over the best of those rates).

The ceiling counts only the linear layers (2 FLOPs per weight per row): every prompt token (a prefix
all prompts share once) through every layer but the LM head, one row per prompt through the head,
and every generated token through all of them; prompt rows at the M = 1024 rate, generated rows at
the M = 32 rate. The rates come from the job's own probe (modelzoo/gemm.py). Attention,
norms and sampling are left out, so no engine can reach it; the fraction of it an engine reaches
says how much of the machine it uses.
"""
from __future__ import annotations

import platform
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from modelzoo.cpu import cpu_flags, cpu_model
from modelzoo.gemm import ShapeChoice, available_backends, measure_shape

RATE_ROWS = (32, 1024)  # decode-sized and prefill-sized M
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
    from modelzoo.checkpoint import load_hf_config
    from modelzoo.models import model_class

    hf_config = load_hf_config(checkpoint)
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(cls.config_from_hf(hf_config))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = max(linears, key=lambda m: m.out_features)  # the vocabulary projection
    body = Counter((m.in_features, m.out_features) for m in linears if m is not head)
    return LinearShapes(body, (head.in_features, head.out_features))


def gemm_rates(shapes: LinearShapes, dtype: torch.dtype) -> dict[tuple[int, int], ShapeChoice]:
    """Each weight shape's measurement by the job's own probe (modelzoo/gemm.py), at RATE_ROWS:
    every backend's GFLOP/s (gflops[backend]["M=32"], ...) and whether it is batch-invariant."""
    backends = available_backends(torch.device("cpu"), dtype)
    return {shape: measure_shape(*shape, dtype, backends, timed_rows=RATE_ROWS) for shape in [*shapes.body, shapes.head]}


def ceiling_tokens_per_s(shapes: LinearShapes, rates: dict, prompt_tokens: int, prompts: int,
                         generated_tokens: int) -> float:
    """Generated tokens per second if the linear layers ran at the best measured rate and nothing else took time."""
    def seconds(shape: tuple[int, int], rows: int, rate_rows: int) -> float:
        best = max(by_rows[f"M={rate_rows}"] for by_rows in rates[shape].gflops.values())
        return 2 * shape[0] * shape[1] * rows / (best * 1e9)

    total = sum(count * (seconds(shape, prompt_tokens, RATE_ROWS[1]) + seconds(shape, generated_tokens, RATE_ROWS[0]))
                for shape, count in shapes.body.items())
    total += seconds(shapes.head, prompts, RATE_ROWS[0]) + seconds(shapes.head, generated_tokens, RATE_ROWS[0])
    return generated_tokens / total


def format_rates(rates: dict[tuple[int, int], ShapeChoice], dtype: str) -> str:
    """One line per shape: each backend's GFLOP/s at each M ('*': not batch-invariant, never chosen)."""
    lines = []
    for (in_features, out_features), choice in rates.items():
        cells = ", ".join(f"{backend}{'' if choice.invariant.get(backend) else '*'} "
                          + "/".join(f"{rate:.0f}" for rate in by_rows.values())
                          for backend, by_rows in choice.gflops.items())
        lines.append(f"  {dtype:<8} {in_features}x{out_features:<6} {cells}")
    return "\n".join(lines)
