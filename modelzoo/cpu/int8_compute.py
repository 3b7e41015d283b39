"""How int8 linear layers multiply on this CPU, chosen by measuring: int8 weights times activations
quantized to 16 or 8 bits, or the weight in floats.

- `vnni16`: the weight repacked once for the C++ kernel (modelzoo/cpu/kernels/int8_gemm.cpp), the model's packed
            weights side by side on huge pages (PackedWeightArena, modelzoo/cpu/memory.py); activations
            quantized per row and chunk of the weight's group to 16 bits on the fly (error about 2^-16 of
            the chunk's absmax), integer dot products, both scales applied after: the weight-only int8
            answers. The packed weight replaces the plain one. On AMX-INT8 the dot products are tile
            products, on AVX512-VNNI vpdpwssd, on any other AVX2 CPU vpmaddwd + vpaddd: the same integer
            sums (the kernel times every path it has on the model's group size once and keeps the fastest;
            `int8_gemm_path`, logged).
- `vnni8`:  the same packed weight, activations quantized to 8 bits (absmax / 127), AVX512-VNNI only (on its
            VNNI path, or AMX-INT8 where that path is the one chosen): faster than `vnni16`, but 8-bit
            activations change noticeably more answers (README "int8 weights"), so `auto` never picks it: it
            must be asked for.
- `float`:  Int8Linear as loaded (modelzoo/cpu/quantization.py): the weight cast (per-channel) or dequantized
            (group-wise) to `model.dtype` at each call; activations stay exact. Works on every device.

As for the float GEMMs (modelzoo/cpu/gemm.py), each int8 shape is timed with each backend at M = 256 and
M = 32 on random weights and checked batch-invariant; `auto` keeps the faster of `vnni16` and `float`,
the choice cached beside the kernels, logged and recorded in summary.json; `runconfig.int8_backend`
forces one.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.cpu.memory import Memory, PackedWeightArena, new_memory, release_freed_memory
from modelzoo.cpu.precision import GEMM_BLOCK
from modelzoo.errors import UserError
from modelzoo.cpu.gemm import GemmPlan, measured_shapes, rates_text
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.cpu.quantization import Int8Embedding, Int8Linear, dequantize_rows, group_count, quantize_rows

log = logging.getLogger("zoo-infer")

ACTIVATION_BITS = {"vnni16": 16, "vnni8": 8}  # the kernel backends' activation widths
INT8_BACKENDS = (*ACTIVATION_BITS, "float")
OPT_IN = ("vnni8",)  # never chosen by auto: it changes answers for speed
BLOCK = 16  # output rows per packed block, and the kernel's unit of group size


def kernel_group_size(in_features: int, group_size: int) -> int:
    """The group the kernel runs: group_size, or per-channel the whole row rounded up to a multiple of 16."""
    return group_size or -(-in_features // BLOCK) * BLOCK


def packed_shapes(rows: int, columns: int, group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of pack_weight's (packed, scales) for q (rows, columns)."""
    group = kernel_group_size(columns, group_size)
    groups = group_count(columns, group)
    blocks = -(-rows // BLOCK)
    return (blocks, groups * group // 4, BLOCK, 4), (blocks, groups, BLOCK)


def packed_bytes(layer: Int8Linear) -> tuple[int, int]:
    """The bytes of pack_weight's packed weight and of its scales for `layer`, each with its alignment in a
    PackedWeightArena."""
    packed, scales = packed_shapes(layer.out_features, layer.in_features, layer.group_size)
    return math.prod(packed) + 64, 4 * math.prod(scales) + 64


def pack_word_blocks(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows (N, B) of any dtype, N whole blocks of 16 and B bytes whole 4-byte words, into packed (N/16, B/4 words,
    16, ...): for each word, the 16 rows' words side by side (vnni16's runs of 4 int8 inputs). Moved as int32: a
    transpose of 4-byte elements (a byte-wise one runs about 6x slower)."""
    if not rows.is_contiguous() or rows.data_ptr() % 4:  # a view as int32 needs both
        rows = rows.clone(memory_format=torch.contiguous_format)
    words = rows.view(torch.int32).view(rows.shape[0] // GEMM_BLOCK, GEMM_BLOCK, -1)  # (blocks, 16, words)
    packed.view(torch.int32).view(words.shape[0], -1, GEMM_BLOCK).copy_(words.transpose(1, 2))
    return packed


def pack_weight(q: torch.Tensor, scale: torch.Tensor, group_size: int, memory: Memory = new_memory,
                scale_memory: Memory = new_memory) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, K) int8 and its scales (N,) or (N, G) -> the kernel's (packed, scales), written into memory(shape,
    dtype) and scale_memory(shape, dtype): packed (N/16, K/4, 16, 4) uint8 = q + 128, scales (N/16, G, 16) float32
    (N and K zero-padded to multiples of 16 and of the group; see int8_gemm.cpp)."""
    rows, columns = q.shape
    packed_shape, scales_shape = packed_shapes(rows, columns, group_size)
    blocks, groups = scales_shape[0], scales_shape[1]
    padded_rows, padded_columns = blocks * BLOCK, packed_shape[1] * 4
    if (padded_rows, padded_columns) != (rows, columns):  # else read as it is
        q = F.pad(q, (0, padded_columns - columns, 0, padded_rows - rows))  # (Np, Kp)
    packed = pack_word_blocks(q, memory(packed_shape, torch.uint8))
    packed ^= 0x80  # int8 + 128, in its own place
    scale = F.pad(scale.reshape(rows, groups), (0, 0, 0, padded_rows - rows))  # (Np, G)
    scales = scale_memory(scales_shape, torch.float32).copy_(scale.view(blocks, BLOCK, groups).transpose(1, 2))
    return packed, scales


class VnniInt8Linear(nn.Module):
    """An Int8Linear multiplied by the VNNI kernel, activations quantized to `activation_bits` (16 or 8);
    holds only the packed weight and its scales, written into `arenas` (weights, scales) where given (beside the
    model's other packed weights and scales, on huge pages), else into new memory."""

    def __init__(self, layer: Int8Linear, activation_bits: int,
                 arenas: tuple[PackedWeightArena, PackedWeightArena] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = layer.in_features, layer.out_features, layer.group_size
        self.activation_bits = activation_bits
        memory = (arenas[0].take, arenas[1].take) if arenas is not None else (new_memory, new_memory)
        packed, scales = pack_weight(layer.weight, layer.weight_scale, layer.group_size, *memory)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype."""
        return cpu_kernels().int8_linear(x, self.packed, self.scales, self.bias, self.out_features,
                                         self.activation_bits)

    def rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight rows `indices` (...) and their scales, read back from the packed layout: q (..., in)
        int8, scales (..., groups), or (...,) per channel, float32 (what Int8Linear held)."""
        block, lane = indices // BLOCK, indices % BLOCK
        shifted = self.packed[block, :, lane, :].flatten(-2)[..., :self.in_features]  # (..., in) uint8
        scales = self.scales[block, :, lane]  # (..., G)
        return (shifted ^ 0x80).view(torch.int8), scales if self.group_size else scales[..., 0]

    def extra_repr(self) -> str:
        grouping = f"groups of {self.group_size}" if self.group_size else "per channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 x int{self.activation_bits}, {grouping}")


class TiedInt8Embedding(nn.Module):
    """An Int8Embedding whose table is its tied head's packed weight (one copy for both)."""

    def __init__(self, embedding: Int8Embedding, head: VnniInt8Linear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.dtype, self.group_size = embedding.dtype, embedding.group_size
        self.head = [head]  # a plain list: the head stays registered where it lives, not twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) -> (..., dim) in the compute dtype, as Int8Embedding computes it."""
        return dequantize_rows(*self.head[0].rows(tokens), self.dtype, self.group_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, the tied head's packed table"


def available_int8_backends(device: torch.device) -> list[str]:
    """On a CPU with the C++ kernels built, `vnni16`, and `vnni8` where they have AVX512-VNNI; `float` always."""
    kernels = cpu_kernels() if device.type == "cpu" else None
    if kernels is None:
        return ["float"]
    return list(INT8_BACKENDS) if kernels.int8_vnni_available() else ["vnni16", "float"]


def _candidate(linear: nn.Linear, backend: str, group_size: int) -> nn.Module:
    """A random float layer quantized as a job's would be, multiplied by `backend`."""
    layer = Int8Linear(linear.in_features, linear.out_features, False, linear.weight.dtype, group_size=group_size)
    layer.weight, layer.weight_scale = quantize_rows(linear.weight.detach(), group_size)
    return VnniInt8Linear(layer, ACTIVATION_BITS[backend]) if backend in ACTIVATION_BITS else layer


def int8_layers(model: nn.Module) -> list[tuple[nn.Module, str, Int8Linear]]:
    """(parent, attribute name, layer) of every Int8Linear of `model`."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, Int8Linear)]


def _shape_key(layer: Int8Linear, dtype: torch.dtype) -> str:
    grouping = f"g{layer.group_size}" if layer.group_size else "per-channel"
    return f"int8 {grouping} {str(dtype).replace('torch.', '')} {layer.in_features}x{layer.out_features}"


def kernel_path_text(group: int) -> str:
    """'; kernel path amx (vnni at 4 rows or fewer; fastest of avx2, vnni, amx)': the C++ kernel's code paths, timed
    here on weights in groups of `group` inputs (before the shapes are measured, which then run on them)."""
    kernels = cpu_kernels()
    many, few = kernels.int8_gemm_path("", group, 64), kernels.int8_gemm_path("", group, 1)
    return (f"; kernel path {many} ({'' if few == many else f'{few} at 4 rows or fewer; '}"
            f"fastest of {', '.join(kernels.int8_gemm_paths())})")


def apply_int8_backend(model: nn.Module, dtype: torch.dtype, device: torch.device, requested: str = "auto") -> GemmPlan:
    """Replaces every Int8Linear of `model` by the chosen backend's layer (`requested`: auto or an INT8_BACKENDS)."""
    if requested not in ("auto", *INT8_BACKENDS):
        raise ValueError(f"unknown int8 backend {requested!r}; one of auto, {', '.join(INT8_BACKENDS)}")
    plan = GemmPlan(requested)
    layers = int8_layers(model)
    backends = available_int8_backends(device)
    if requested != "auto" and requested not in backends:
        needs = "built with AVX512-VNNI on a CPU that has it" if requested == "vnni8" else "built (a C++ compiler)"
        raise UserError(f"runconfig.int8_backend {requested} needs the C++ kernels {needs}; available here: "
                        f"{', '.join(backends)}")
    if not layers:
        return plan
    group_size = layers[0][2].group_size  # one model.int8_group_size for the whole model
    uses_kernel = "vnni16" in backends and requested != "float"
    path = kernel_path_text(kernel_group_size(layers[0][2].in_features, group_size)) if uses_kernel else ""
    plan.measured = measured_shapes({_shape_key(layer, dtype): (layer.in_features, layer.out_features)
                                     for _, _, layer in layers}, dtype, backends,
                                    build=lambda linear, backend: _candidate(linear, backend, group_size),
                                    opt_in=OPT_IN)
    plan.layers = {key: measured["backend"] if requested == "auto" else requested
                   for key, measured in plan.measured.items()}
    plan.check_invariance()
    embeddings = {module.weight.data_ptr(): (parent, name, module) for parent in model.modules()
                  for name, module in parent.named_children() if isinstance(module, Int8Embedding)}
    sizes = [packed_bytes(layer) for _, _, layer in layers if plan.layers[_shape_key(layer, dtype)] in ACTIVATION_BITS]
    arenas = tuple(PackedWeightArena(sum(part)) for part in zip(*sizes)) if sizes else None  # (weights, scales)
    layers.reverse()  # popped first to last: laid out in the order a forward pass reads them
    while layers:  # one layer at a time: at most one weight is held twice
        parent, name, layer = layers.pop()
        backend = plan.layers[_shape_key(layer, dtype)]
        if backend in ACTIVATION_BITS:
            packed = VnniInt8Linear(layer, ACTIVATION_BITS[backend], arenas)
            setattr(parent, name, packed)
            if layer.weight.data_ptr() in embeddings:  # a tied embedding reads the packed copy instead of its own
                owner, attribute, embedding = embeddings.pop(layer.weight.data_ptr())
                setattr(owner, attribute, TiedInt8Embedding(embedding, packed))
                del embedding
        del layer
    release_freed_memory()  # the plain int8 weights just repacked
    log.info("int8 backends (%s): %s%s", requested, "; ".join(
        f"{key} {backend} ({rates_text(plan.measured[key], backend)})" for key, backend in plan.layers.items()), path)
    return plan
