"""Blocks shared by every decoder family: norms, rotary embeddings, attention over the KV cache, MLPs.

Each block reproduces the arithmetic of its `transformers` counterpart (same op order, same
float32 upcasts) so that greedy decoding matches the Hugging Face reference token for token.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.models.kv_cache import KVCache, to_cache_storage
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models.positions import apply_rotary


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the weights; built once, read by every layer.

    positions: (B, T) absolute position of each input token. slots: (B,) cache rows, or None for
    "every slot, in order" (the fast path: cache reads are views), or (1, T) for packed prompts: one
    row holding several sequences side by side, each token naming its cache row. length: number of
    cache positions attended over (max position + 1). mask: (B, 1, T, length) bool, True where a key
    is visible, or, after add_position_bias (ALiBi), an additive float bias (B, heads, T, length) with
    -inf where a key is hidden; None when packed. key_ranges: each query's visible cache positions [start, end), two
    (B, T) tensors, for the C++ attention kernel (end = position + 1; start > 0 only under a sliding
    window). fresh: every row's positions are 0 .. T-1 (new prompts), so attention needs only this
    forward's own keys and values, not the cache. windowed: the sliding window hides some key.
    segments: packed prompts only: (begin, end, context) of each sequence's tokens, for the PyTorch
    attention path, which runs them one by one (the C++ kernel takes the packed row as it is).
    rows: the cache rows for the C++ kernel: slots, or 0 .. B-1 when slots is None. read: (B, N) indices into T,
    or None: the positions whose outputs this layer hands on (the last layer's, where only the head reads them);
    attention stores every position's keys and values, and returns its outputs, and the layer its states, at
    these alone (`kept`).
    """

    cache: KVCache
    slots: torch.Tensor | None
    positions: torch.Tensor
    length: int
    mask: torch.Tensor | None
    key_ranges: tuple[torch.Tensor, torch.Tensor]
    fresh: bool = False
    windowed: bool = False
    segments: tuple[tuple[int, int, "ForwardContext"], ...] = ()
    rows: torch.Tensor | None = None
    additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # sdpa_mask's, shared by copies
    read: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = torch.arange(self.positions.shape[0], device=self.positions.device) if self.slots is None else self.slots

    def reading(self, read: torch.Tensor) -> "ForwardContext":
        """This context for a layer whose outputs are read at positions `read` (B, N) alone; it shares this one's
        additive masks (sdpa_mask), built once for both."""
        return dataclasses.replace(self, read=read)

    def kept(self, states: torch.Tensor) -> torch.Tensor:
        """states (B, T, ...) at the positions read: (B, N, ...), or all of them when every position is read."""
        if self.read is None:
            return states
        rows = torch.arange(states.shape[0], device=states.device)[:, None]
        return states[rows, self.read]

    def sdpa_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask for PyTorch's attention in queries of `dtype`: on a GPU a boolean mask becomes additive (0 where a
        key is visible, -inf where hidden), built once for every layer sharing this context or a copy of it (SDPA
        would convert it in each call); elsewhere the mask as it is."""
        if self.mask is None or self.mask.dtype != torch.bool or self.mask.device.type != "cuda":
            return self.mask
        if dtype not in self.additive_masks:
            additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.additive_masks[dtype] = additive.masked_fill_(~self.mask, float("-inf"))
        return self.additive_masks[dtype]

    @classmethod
    def build(cls, cache: KVCache, slots: torch.Tensor | None, positions: torch.Tensor,
              sliding_window: int | None = None, length: int | None = None) -> "ForwardContext":
        """Causal mask over cache positions: key j is visible to a query at position p iff j <= p
        (and j > p - sliding_window).

        length: the cache positions attended over, fixed by the caller (the decode step's length bucket,
        more than every position): then nothing here reads a tensor's value on the host, so the context's
        shapes depend on `length` alone. None: the positions' maximum + 1 (one host sync).
        """
        if slots is not None and slots.dim() == 2:
            return cls.packed(cache, slots, positions, sliding_window)
        fixed = length is not None
        length = length if fixed else int(positions.max()) + 1
        keys = torch.arange(length, device=positions.device)
        visible = keys[None, None, :] <= positions[:, :, None]  # (B, T, length)
        if sliding_window is not None:
            visible &= keys[None, None, :] > positions[:, :, None] - sliding_window
        mask = visible[:, None]
        width = positions.shape[1]
        fresh = not fixed and width > 1 and bool((positions == keys[:width]).all())  # one sync, prefill only
        windowed = sliding_window is not None and length > sliding_window
        end = positions + 1
        start = (end - sliding_window).clamp(min=0) if windowed else torch.zeros_like(end)
        return cls(cache, slots, positions, length, mask, (start, end), fresh, windowed)

    def add_position_bias(self, bias: torch.Tensor, dtype: torch.dtype) -> "ForwardContext":
        """This context with its boolean mask turned into an additive one (ALiBi and its kin): `bias`,
        broadcastable to (B, heads, T, length), where a key is visible, -inf where hidden, in `dtype`."""
        if self.mask is None:
            raise ValueError("packed prompts take no ALiBi bias")
        self.mask = bias.masked_fill(~self.mask, float("-inf")).to(dtype)  # (B, heads, T, length)
        return self

    @classmethod
    def packed(cls, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor,
               sliding_window: int | None = None) -> "ForwardContext":
        """Context for packed prompts: slots, positions (1, T), consecutive tokens of one sequence
        sharing a slot. One host sync to find where each sequence ends."""
        if slots.shape != positions.shape or slots.shape[0] != 1:
            raise ValueError(f"packed prompts take slots and positions of one shape (1, T), not "
                             f"{tuple(slots.shape)} and {tuple(positions.shape)}")
        row = slots[0].tolist()
        edges = [0, *(t for t in range(1, len(row)) if row[t] != row[t - 1]), len(row)]
        segments = tuple((begin, end, cls.build(cache, slots[0, begin: begin + 1], positions[:, begin:end],
                                                sliding_window))
                         for begin, end in zip(edges, edges[1:]))
        end = positions + 1
        windowed = any(context.windowed for _, _, context in segments)
        start = (end - sliding_window).clamp(min=0) if windowed else torch.zeros_like(end)
        return cls(cache, slots, positions, max(context.length for _, _, context in segments), None, (start, end),
                   windowed=windowed, segments=segments)


# The dtypes the C++ kernels are compiled for (one template each, float32 arithmetic inside).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernel module where its fused ops take `x` (a CPU tensor of KERNEL_DTYPES, not under torch.compile,
    which cannot trace them); None for PyTorch's ops."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES or torch.compiler.is_compiling():
        return None
    return cpu_kernels()


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as in transformers' LlamaRMSNorm (one C++ call
    where the kernels are built, with the same result bit for bit, in half precision too)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, round_to_bf16: bool = False) -> torch.Tensor:
        """norm(x), of x's dtype; with `round_to_bf16` (for a GEMM that rounds its inputs so anyway, see
        rounds_inputs_to_bf16) rounded to bfloat16 where the kernel writes it so (float32 x): the same products."""
        kernels = fused_kernels(x)
        if kernels is not None and self.weight.dtype == x.dtype:
            rounded = round_to_bf16 and x.dtype == torch.float32
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps, rounded)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor,
                     round_to_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and the next norm, in one C++ call where it
        can (which then updates x in place); `round_to_bf16` as in forward."""
        kernels = fused_kernels(x)
        if (kernels is not None and x.is_contiguous() and delta.is_contiguous() and delta.dtype == x.dtype
                and self.weight.dtype == x.dtype):
            rounded = round_to_bf16 and x.dtype == torch.float32
            return x, kernels.add_rms_norm_(x, delta, self.weight, self.eps, rounded)
        x = x + delta
        return x, self(x)


def rounds_inputs_to_bf16(layer: nn.Module) -> bool:
    """Whether `layer` is a bfloat16 GEMM that rounds its inputs to bfloat16 (modelzoo/cpu/precision.py): a bfloat16
    input is then multiplied as it is, the same products as its float32 source's, and its producer may write it so."""
    return bool(getattr(layer, "rounds_inputs_to_bf16", False))


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(B, T, heads * head_dim) -> (B, heads, T, head_dim)."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, num_heads, head_dim).transpose(1, 2)


def attention_kernel(q: torch.Tensor, ctx: ForwardContext) -> ModuleType | None:
    """The C++ kernel module where it handles this attention of q (B, heads, T, hd) (attention_kernel_for); None for
    the PyTorch path."""
    return attention_kernel_for(q.device, q.dtype, q.shape[1], q.shape[3], ctx)


def attention_kernel_for(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                         ctx: ForwardContext) -> ModuleType | None:
    """The C++ kernel module where it handles attention of queries of `dtype` on `device` over ctx's cache (on the
    CPU, queries and cache of one of KERNEL_DTYPES, the cache of the queries' dtype or 16-bit under float32 queries,
    no ALiBi bias, 1 to 8 query heads per kv head, head_dim 16, 32, 64 or 128, not under torch.compile); None for the
    PyTorch path."""
    storage = ctx.cache.keys[0].dtype
    if (device.type != "cpu" or dtype not in KERNEL_DTYPES
            or not (storage == dtype or (dtype == torch.float32 and storage in KERNEL_DTYPES))
            or torch.compiler.is_compiling()
            or (ctx.mask is not None and ctx.mask.dtype != torch.bool)):
        return None
    kv_heads = ctx.cache.keys[0].shape[1]
    if head_dim not in (16, 32, 64, 128) or heads % kv_heads or heads // kv_heads > 8:
        return None
    return cpu_kernels()


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: ForwardContext,
                     scale: float | None = None,
                     rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Stores this step's k, v in the cache and attends q over everything cached so far.

    q: (B, heads, T, hd); k, v: (B, kv_heads, T, hd); any strides with each head's hd features
    contiguous (views of one fused projection are fine). scale: None = 1 / sqrt(hd). rotary: the
    (cos, sin) tables (B, 1, T, hd) of `RotaryEmbedding` to rotate q and k by first (two-halves
    layout, the whole head), or None. Returns (B, T, heads * hd), or (B, N, heads * hd) at the
    positions ctx.read.
    """
    batch, heads, seq, head_dim = q.shape
    kernel = attention_kernel(q, ctx)
    if kernel is not None:  # rotates, stores k, v and reads only the keys each query sees, in one C++ call
        start, end = ctx.key_ranges
        cos, sin = (None, None) if rotary is None else (rotary[0][:, 0], rotary[1][:, 0])  # (B, T, hd)
        out = kernel.cached_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, T, heads, hd)
                                      ctx.cache.keys[layer], ctx.cache.values[layer], ctx.rows, start, end,
                                      head_dim ** -0.5 if scale is None else scale, cos, sin)  # (B, T, heads, hd)
        return ctx.kept(out.view(batch, seq, heads * head_dim))
    if ctx.segments:  # packed prompts: one sequence at a time
        out = torch.cat([cached_attention(q[:, :, begin:end], k[:, :, begin:end], v[:, :, begin:end], layer, context,
                                          scale, None if rotary is None else (rotary[0][:, :, begin:end],
                                                                              rotary[1][:, :, begin:end]))
                         for begin, end, context in ctx.segments], dim=1)
        return ctx.kept(out)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    storage = ctx.cache.keys[layer].dtype
    k, v = to_cache_storage(k, storage), to_cache_storage(v, storage)  # attend over the values as stored
    ctx.cache.update(layer, ctx.slots, ctx.positions, k, v)
    if ctx.fresh:  # new prompts: their own keys are all there is to attend to
        keys, values = k, v  # (B, kv_heads, T, hd), T == length
    else:
        keys, values = ctx.cache.read(layer, ctx.slots, ctx.length)  # (B, kv_heads, length, hd)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if seq == 1:
        return grouped_query_attention(q, keys, values, ctx.sdpa_mask(q.dtype), scale).view(batch, seq, heads * head_dim)
    # Plain causal attention over fresh keys lets SDPA skip the hidden half instead of masking it.
    causal = ctx.fresh and not ctx.windowed and ctx.mask.dtype == torch.bool
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if causal else ctx.sdpa_mask(q.dtype),
                                         is_causal=causal, scale=scale, enable_gqa=bool(q.shape[1] != keys.shape[1]))
    return ctx.kept(out.transpose(1, 2).reshape(batch, seq, heads * head_dim))


def grouped_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
    """One query per row over the cache, with each kv head's query heads as the rows of one query block (one row
    where every query head has its own kv head): q (B, heads, 1, hd) viewed as (B, kv_heads, heads / kv_heads, hd)
    against keys, values (B, kv_heads, L, hd); mask (B, 1, 1, L) bool or additive, or (B, heads, 1, L) additive.
    SDPA then reads each kv head once and takes its fast kernels, where `enable_gqa` with a mask falls back to
    expanding K/V per query head (its math path). Returns (B, heads, hd)."""
    batch, heads, _, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # head h = kv * group + g
    if mask.shape[1] != 1:  # a bias per query head: (B, heads, 1, L) -> (B, kv_heads, group, L)
        mask = mask.reshape(batch, kv_heads, heads // kv_heads, mask.shape[-1])
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)  # (B, kv, group, hd)
    return out.reshape(batch, heads, head_dim)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU, spelled out as transformers' NewGELUActivation does."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU of transformers' FastGELUActivation (SantaCoder), same op order."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_fast": gelu_fast,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    """The activation function called `name` in a Hugging Face config."""
    from modelzoo.errors import UserError

    if name not in ACTIVATIONS:
        raise UserError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class DenseMLP(nn.Module):
    """down(act(up(x))): the two-matrix MLP of GPT-NeoX, GPT-J, Falcon, BLOOM and MPT.

    `names` are the checkpoint's (up, down) module names, so weights load by name; `linear` builds each
    projection (Falcon's adds its bias as a separate op); `act` is a config activation name or a function.
    """

    def __init__(self, hidden: int, intermediate: int, act: str | Callable[[torch.Tensor], torch.Tensor], bias: bool,
                 names: tuple[str, str], linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.names = names
        self.add_module(names[0], linear(hidden, intermediate, bias=bias))
        self.add_module(names[1], linear(intermediate, hidden, bias=bias))
        self.act = activation(act) if isinstance(act, str) else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, name) for name in self.names)  # looked up per call: packing replaces modules
        return down(self.act(up(x)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the SwiGLU MLP of Llama, Mistral, Qwen2.

    gate and up are one fused `gate_up_proj` (gate rows first): one wider matrix multiply.
    """

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    @property
    def silu_gated(self) -> bool:
        """Whether the gate's activation is SiLU: a GEMM kernel may then apply it to gate_up_proj's output."""
        return self.act is F.silu

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): down_proj's input."""
        if getattr(self.gate_up_proj, "applies_silu_gate", False):  # bf16_silu_gate (modelzoo/cpu/precision.py)
            # rounded to bfloat16 on the way out where down_proj rounds its inputs so anyway: the same products
            return self.gate_up_proj(x, round_to_bf16=rounds_inputs_to_bf16(self.down_proj))
        gate_up = self.gate_up_proj(x)
        kernels = fused_kernels(gate_up) if self.act is F.silu else None
        if kernels is not None:
            return kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the same bits: added into `residual` by the down projection's GEMM where it can
        (BF16Linear.add_into; residual float32 and not needed after), else through forward (and its hooks)."""
        add_into = getattr(self.down_proj, "add_into", None)
        if (add_into is None or self._forward_hooks or self._forward_pre_hooks or residual.dtype != torch.float32
                or not residual.is_contiguous()):
            return residual + self(x)
        return add_into(residual, self.gated(x))


def last_token_states(hidden: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """The hidden states (B, hidden) at index `last` (B,) of each row (None = the final position),
    or (B, N, hidden) at several indices `last` (B, N) per row (speculative verification)."""
    if last is None:
        return hidden[:, -1]
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows if last.dim() == 1 else rows[:, None], last]
