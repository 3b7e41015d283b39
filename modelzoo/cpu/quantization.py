"""int8 weights (`model.weight_dtype: int8`): symmetric group-wise quantization, the modules that hold
it, and the swap the loader applies to a model before filling it.

Scheme: w ~= q * scale, q int8 in [-127, 127], one float32 scale per output channel (row of the
(out, in) weight) and group of `group_size` consecutive inputs (`model.int8_group_size`, default 32,
as llama.cpp's Q8_0) = absmax(group) / 127; the last group of a row may be shorter. group_size 0
gives one scale per whole row (per-channel). An all-zero group gets scale 1 (its q is all 0), never a
division by zero. Round to nearest: each weight is off by at most scale / 2.

What is quantized (`quantize_modules`): every linear layer (nn.Linear and its subclasses, and GPT-2's
Conv1D, whose (in, out) weight is transposed to (out, in) while quantizing) and the token embedding
(the first nn.Embedding with `vocab_size` rows; every family registers it before any position
table). Together they are all but a few percent of every supported model's bytes. Position
embeddings, norms, biases and ALiBi slopes stay in the compute dtype: they are small, and they enter
every hidden state directly. The embedding's rows are the same axis as a tied lm_head's output
channels (and its columns the head's inputs), so a tied pair shares one int8 tensor and its scales.

Int8Linear computes in the compute dtype: per-channel, (x @ q^T) * scale (+ bias), the int8 weight
cast to the compute dtype (exact: every int8 fits in bfloat16 and float16) at each call; group-wise,
x @ (q * scale)^T with the weight dequantized at each call. Where the CPU multiplies int8 natively,
modelzoo/cpu/int8_compute.py replaces it by the int8 x int8 kernel when that measures faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable
# Weights quantized at a time: each float32 temporary of a block (1 MiB) stays in the cache between the passes
# over it (every x86-64 CPU's L2 or L3 holds a few), where blocks of whole MB went to memory and back at each pass.
BLOCK_ELEMENTS = 2**18


def scale_name(weight_name: str) -> str:
    """The state-dict name of a quantized weight's scales: `...weight` -> `...weight_scale`."""
    return weight_name + "_scale"


def group_count(columns: int, group_size: int) -> int:
    """Scales per row: ceil(columns / group_size), or 1 per-channel (group_size 0)."""
    return -(-columns // group_size) if group_size else 1


def _grouped(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r, cols) -> (r, groups, group_size) float32, the last group zero-padded (zeros change no absmax)."""
    size = group_size or rows.shape[1]
    padded = F.pad(rows.to(torch.float32), (0, group_count(rows.shape[1], group_size) * size - rows.shape[1]))
    return padded.view(rows.shape[0], -1, size)


def quantize_rows(weight: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float tensor of any float dtype -> (q int8 (rows, cols), scale float32): (rows,) per-channel
    (group_size 0), else (rows, groups) for groups of group_size columns.

    Computed in float32 whatever the input dtype, a block of rows at a time (BLOCK_ELEMENTS), so the only full-size
    allocation is the int8 result.
    """
    rows, cols = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, group_count(cols, group_size), dtype=torch.float32, device=weight.device)
    block_rows = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, block_rows):
        block = slice(start, start + block_rows)
        groups = _grouped(weight[block], group_size)  # (r, G, size)
        absmax = groups.abs().amax(dim=2)  # (r, G)
        scale[block] = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
        q[block] = torch.round(groups / scale[block, :, None]).clamp_(-QMAX, QMAX).flatten(1)[:, :cols]
    return q, (scale[:, 0] if not group_size else scale)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                    group_size: int = 0) -> torch.Tensor:
    """q (..., cols) int8 with scale (...,) (group_size 0) or (..., groups) -> q * scale in `dtype`
    (computed in float32)."""
    if not group_size:
        return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
    groups = _grouped(q.reshape(-1, q.shape[-1]), group_size)  # (rows, G, group_size)
    scaled = groups * scale.reshape(-1, scale.shape[-1]).to(torch.float32)[:, :, None]
    return scaled.flatten(1)[:, :q.shape[-1]].reshape(q.shape).to(dtype)


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight (out, in), float32 scales (out,) per channel or (out, groups)
    per group of `group_size` inputs, and an optional bias in the compute dtype. Buffers, not
    parameters: nothing here is trained.

    Per-channel, forward casts the int8 weight to the input's dtype, multiplies, then scales the
    (..., out) output: y = (x @ q^T) * scale + bias. Measured on the 2-core AVX-512 machine of this
    project, float32, min of interleaved repeats: casting then scaling the output beats dequantizing the
    whole weight (q * scale[:, None], one more full-size pass) in every SmolLM2-135M layer at 32 rows
    (lm_head 49152x576: 62 against 92 ms; gate_up 3072x576: 2.4 against 3.2 ms) and in the whole model: a
    32-row decode step 346 against 435 ms, a 4 x 128-token prefill 924 against 982 ms. Group-wise scales
    vary along the inputs, so the weight is dequantized at each call. torch._weight_int8pack_mm (a fused
    CPU kernel) was 30x slower in float32 and crashed in bfloat16 when `in` is not a multiple of 8.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, group_size: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        scale_shape = (out_features, group_count(in_features, group_size)) if group_size else (out_features,)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype."""
        if self.group_size:
            return F.linear(x, dequantize_rows(self.weight, self.weight_scale, x.dtype, self.group_size), self.bias)
        y = F.linear(x, self.weight.to(x.dtype))  # (..., out), before the per-channel scale
        y = (y * self.weight_scale).to(x.dtype)  # the scale multiply in float32, one rounding back
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8, {f'groups of {self.group_size}' if self.group_size else 'per channel'}")


class Int8Embedding(nn.Module):
    """A token embedding table of int8 rows (num, dim) with float32 scales per row (and group of
    `group_size` columns); a lookup dequantizes only the gathered rows, into the compute dtype `dtype`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, group_size: int = 0) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.group_size = group_size
        scale_shape = (num_embeddings, group_count(embedding_dim, group_size)) if group_size else (num_embeddings,)
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) -> (..., dim) in the compute dtype."""
        rows = F.embedding(tokens, self.weight)  # (..., dim) int8
        return dequantize_rows(rows, self.weight_scale[tokens], self.dtype, self.group_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def quantize_modules(model: nn.Module, dtype: torch.dtype, group_size: int = 0) -> dict[str, bool]:
    """Swaps, in place, every linear layer and the token embedding of `model` (built on the meta
    device) for empty Int8Linear / Int8Embedding modules on the same device.

    Returns {state-dict name of each int8 weight: whether the checkpoint stores it transposed, (in, out)}.
    """
    vocab_size = model.config.vocab_size
    quantized: dict[str, bool] = {}
    embedding_done = False
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                swapped, transposed = Int8Linear(child.in_features, child.out_features, child.bias is not None,
                                                 dtype, child.weight.device, group_size), False
            elif getattr(child, "weight_is_in_out", False):  # models.gpt2.Conv1D (GPT-2, BTLM): (in, out)
                swapped = Int8Linear(*child.weight.shape, True, dtype, child.weight.device, group_size)
                transposed = True
            elif isinstance(child, nn.Embedding) and child.num_embeddings == vocab_size and not embedding_done:
                swapped = Int8Embedding(child.num_embeddings, child.embedding_dim, dtype, child.weight.device,
                                        group_size)
                transposed, embedding_done = False, True
            else:
                continue
            setattr(parent, name, swapped)
            quantized[f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight"] = transposed
    return quantized


@dataclass(frozen=True)
class Int8Summary:
    """What quantize_modules swapped in a loaded model, and the bytes it takes."""

    linear_layers: int
    embeddings: int
    int8_bytes: int  # int8 weights + float32 scales, a tied pair counted once
    full_bytes: int  # the same weights in the compute dtype

    @property
    def saved_bytes(self) -> int:
        return self.full_bytes - self.int8_bytes


def int8_summary(model: nn.Module, dtype: torch.dtype) -> Int8Summary:
    """Counts the Int8Linear / Int8Embedding modules of a loaded model and their bytes."""
    modules = [m for m in model.modules() if isinstance(m, (Int8Linear, Int8Embedding))]
    unique = {m.weight.data_ptr(): m for m in modules}.values()  # a tied lm_head shares its embedding's tensor
    element = torch.empty(0, dtype=dtype).element_size()
    return Int8Summary(
        linear_layers=sum(isinstance(m, Int8Linear) for m in modules),
        embeddings=sum(isinstance(m, Int8Embedding) for m in modules),
        int8_bytes=sum(m.weight.nbytes + m.weight_scale.nbytes for m in unique),
        full_bytes=sum(m.weight.numel() * element for m in unique))
