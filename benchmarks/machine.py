"""What the benchmark machine can do: its CPU, its GEMM rates for the model's weight shapes, and the
workload's ceiling (its matrix-multiply FLOPs over the best of those rates).

The ceiling counts only the linear layers (2 FLOPs per weight per row): every prompt token through
every layer but the LM head (a prefix all prompts share once), one row per prompt through the head, and every generated token through
all of them, prompt rows at the M = 1024 rate and generated rows at the M = 32 rate. Attention,
norms and sampling are left out, so no engine can reach it; the fraction of it an engine reaches
says how much of the machine it uses.
"""
from __future__ import annotations

import platform
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modelzoo.gemm import available_backends, seconds_per_call, wrap
from modelzoo.precision import cpu_flags

RATE_ROWS = (32, 1024)  # decode-sized and prefill-sized M
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16", "amx_int8")


def cpu_description() -> str:
    """'AMD EPYC 9R14 (x86_64; avx2 avx512f avx512_bf16 avx512_vnni)'."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = " ".join(flag for flag in SHOWN_FLAGS if flag in cpu_flags()) or "no AVX2 / AVX-512 flags"
    return f"{name} ({platform.machine()}; {flags})"


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


def gemm_rates(shapes: LinearShapes, dtype: torch.dtype) -> dict[tuple[int, int], dict[str, dict[int, float]]]:
    """{shape: {backend: {M: GFLOP/s}}} for every backend this build offers in `dtype`, on this machine."""
    rates: dict[tuple[int, int], dict[str, dict[int, float]]] = {}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for in_features, out_features in [*shapes.body, shapes.head]:
            linear = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            linear.weight.copy_(torch.randn(out_features, in_features, generator=generator).to(dtype))
            per_backend = rates.setdefault((in_features, out_features), {})
            for backend in available_backends(torch.device("cpu"), dtype):
                try:
                    layer = wrap(linear, backend, decode_rows=RATE_ROWS[0])
                    per_backend[backend] = {}
                    for rows in RATE_ROWS:
                        x = torch.randn(rows, in_features, generator=generator).to(dtype)
                        seconds = seconds_per_call(lambda: layer(x))
                        per_backend[backend][rows] = 2 * rows * in_features * out_features / seconds / 1e9
                except (RuntimeError, NotImplementedError):
                    per_backend.pop(backend, None)
    return rates


def ceiling_tokens_per_s(shapes: LinearShapes, rates: dict, prompt_tokens: int, prompts: int,
                         generated_tokens: int) -> float:
    """Generated tokens per second if the linear layers ran at the best measured rate and nothing else took time."""
    def seconds(shape: tuple[int, int], rows: int, rate_rows: int) -> float:
        best = max(backend_rates[rate_rows] for backend_rates in rates[shape].values())
        return 2 * shape[0] * shape[1] * rows / (best * 1e9)

    total = sum(count * (seconds(shape, prompt_tokens, RATE_ROWS[1]) + seconds(shape, generated_tokens, RATE_ROWS[0]))
                for shape, count in shapes.body.items())
    total += seconds(shapes.head, prompts, RATE_ROWS[0]) + seconds(shapes.head, generated_tokens, RATE_ROWS[0])
    return generated_tokens / total


def format_rates(rates: dict, dtype: str) -> str:
    """One line per shape: each backend's GFLOP/s at each M."""
    lines = []
    for (in_features, out_features), per_backend in rates.items():
        cells = ", ".join(f"{backend} " + "/".join(f"{rate:.0f}" for rate in by_rows.values())
                          for backend, by_rows in per_backend.items())
        lines.append(f"  {dtype:<8} {in_features}x{out_features:<6} {cells}")
    return "\n".join(lines)
