"""The precision policy: which tensors a job keeps and computes in which float type, for its dtype and device.

- float32: everything in float32.
- bfloat16 on a CPU with AVX512-BF16 (AMX-BF16 CPUs have it too) and the C++ kernels built: **bfloat16
  GEMMs, float32 everywhere else.** The linear layers keep bfloat16 weights and multiply with bf16_linear
  (modelzoo/cpu/kernels/bf16_gemm.cpp), or on AMX CPUs amx_bf16_linear (amx_gemm.cpp) where it measures faster
  (modelzoo/cpu/gemm.py): inputs rounded to bfloat16, products summed and returned in float32 (a SiLU GatedMLP's
  gate | up with bf16_silu_gate, which returns silu(gate) * up with silu_mul's bits). The
  residual stream, norms, rotary, attention's softmax, biases and embeddings' outputs are float32; the KV cache
  stores float16 (values beyond its range saturate at its largest). Chosen by benchmarks/precision_study.py,
  which adds one rounding at a time to the float32 path (figures in benchmarks/README.md): rounding the GEMM
  outputs to bfloat16 costs far more rows than rounding their inputs, hence a GEMM with float32 outputs; a
  float16 KV cache keeps float32's log-probabilities as closely as a float32 cache does, at half its bytes and
  bfloat16's speed, where a bfloat16 cache adds about a tenth of the policy's difference from float32.
- bfloat16 or float16 on a CPU without native multiplies for it (PyTorch emulates them there, at less than half the
  float32 rate): **16-bit weights, float32 arithmetic.** With the C++ kernels built, the linear layers keep their
  weights in the dtype's 2 bytes and multiply with half_linear (modelzoo/cpu/kernels/half_gemm.cpp), which widens them
  to float32 as it reads them: a float32 GEMM over the 16-bit values at half the bytes of weights held and read per
  decode step. Without the kernels the weights are widened once, at load. Everything else, the KV cache included,
  is float32: faster there, and closer to float32.
- otherwise (CUDA, float16 on AVX512-FP16, int8 weights, a compiled CPU decode step, which cannot trace the C++
  GEMM): everything in the job's dtype, as PyTorch computes it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.cpu.memory import Memory, PackedWeightArena, new_memory, release_freed_memory, release_mapped
from modelzoo.cpu.facts import cpu_flags


# dtype -> CPU flags (/proc/cpuinfo) of which any one means native matrix multiplies.
NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
GEMM_BLOCK = 16  # output rows per packed block of bf16_linear's weights
SILU_GATE_TILE = 32  # features per register tile of bf16_silu_gate (its 4 blocks: 2 of gate rows, 2 of up rows)
TRIM_BYTES = 256 << 20  # dropped weights replace_linear_layers lets the allocator hold before it asks for them back


@dataclass(frozen=True)
class PrecisionPolicy:
    """weights: the values the weights keep; activations: the dtype of the residual stream, norms, rotary, softmax
    and GEMM outputs; kv_cache: the KV cache's storage; bf16_gemm: the linear layers multiply with bf16_linear
    (bfloat16 weights, float32 in and out); half_gemm: with half_linear (16-bit weights widened to float32)."""

    weights: torch.dtype
    activations: torch.dtype
    kv_cache: torch.dtype
    bf16_gemm: bool = False
    half_gemm: bool = False

    @property
    def packed_gemm(self) -> bool:
        """Whether the linear layers keep their weights in `weights`' dtype, packed for a C++ GEMM."""
        return self.bf16_gemm or self.half_gemm

    def describe(self) -> str:
        """'bfloat16' where one dtype holds everything, else what holds which."""
        name = lambda dtype: str(dtype).replace("torch.", "")
        if self.bf16_gemm:
            return (f"{name(self.weights)} weights and GEMM inputs, {name(self.activations)} GEMM outputs and "
                    f"activations, {name(self.kv_cache)} KV cache")
        if self.weights == self.activations == self.kv_cache:
            return name(self.weights)
        return f"{name(self.weights)} weights, {name(self.activations)} arithmetic and KV cache"


def native_multiplies(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (float32 always)."""
    flags = NATIVE_CPU_FLAGS.get(dtype)
    return flags is None or bool(cpu_flags() & set(flags))


def bf16_kernel_available() -> bool:
    """Whether the C++ kernels are built with bf16_linear (an AVX512-BF16 CPU with a compiler)."""
    from modelzoo.cpu.kernels import cpu_kernels

    kernels = cpu_kernels()
    return kernels is not None and kernels.bf16_dot_available()


def half_kernel_available() -> bool:
    """Whether the C++ kernels are built (half_linear needs AVX2, which every build has)."""
    from modelzoo.cpu.kernels import cpu_kernels

    return cpu_kernels() is not None


def precision_policy(dtype: torch.dtype, device: torch.device, int8_weights: bool = False,
                     compiled: bool = False) -> PrecisionPolicy:
    """The policy for a job in `dtype` on `device` (module docstring); int8_weights: model.weight_dtype int8;
    compiled: the decode step runs under torch.compile."""
    same = PrecisionPolicy(dtype, dtype, dtype)
    if device.type != "cpu" or dtype == torch.float32:
        return same
    if not native_multiplies(dtype):
        half_gemm = not int8_weights and not compiled and half_kernel_available()
        return PrecisionPolicy(dtype, torch.float32, torch.float32, half_gemm=half_gemm)
    if dtype == torch.bfloat16 and not int8_weights and not compiled and bf16_kernel_available():
        return PrecisionPolicy(dtype, torch.float32, torch.float16, bf16_gemm=True)
    return same


def linear_like(module: nn.Module) -> bool:
    """A linear layer: nn.Linear (or a subclass), a JoinedLinear, or a layer declaring `weight_is_in_out` (GPT-2's
    Conv1D)."""
    return isinstance(module, (nn.Linear, JoinedLinear)) or bool(getattr(module, "weight_is_in_out", False))


class JoinedLinear(nn.Module):
    """A linear layer whose weight stacks several checkpoint weights along its outputs (q | k | v, gate | up), kept
    apart as the loader read them (modelzoo/models/checkpoint.py, keep_parts): `parts` (N_i, K), views of the
    checkpoint's memory map, so that a layout packs or reads each part where it lies instead of a stacked copy.
    `weight` is a meta tensor of the stacked shape and dtype (what the layer is, without values); the layer's own
    forward stacks the parts at every call (right but slow: apply_half_gemm's or apply_bf16_gemm's layouts replace
    it)."""

    def __init__(self, parts: list[torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.out_features, self.in_features = sum(part.shape[0] for part in parts), parts[0].shape[1]
        self.weight = torch.empty(self.out_features, self.in_features, dtype=parts[0].dtype, device="meta")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.cat(self.parts).to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def packed_bytes(self) -> int:
        """The parts' bytes (held outside the layer's parameters)."""
        return sum(part.numel() * part.element_size() for part in self.parts)


def weight_parts(layer: nn.Module) -> list[torch.Tensor]:
    """A linear layer's weight as parts (N_i, K) stacked along the outputs: a JoinedLinear's parts, else its weight
    (out_features, in_features) alone."""
    return list(layer.parts) if isinstance(layer, JoinedLinear) else [oriented_weight(layer)]


def keep_gemm_weights(model: nn.Module, activations: torch.dtype) -> None:
    """Puts every float tensor of `model` in `activations`' dtype except the linear layers' weights and the embedding
    tables (which keep theirs; each embedding's output is cast to `activations` as it is read)."""
    for module in model.modules():
        keep = {"weight"} if linear_like(module) or isinstance(module, nn.Embedding) else set()
        for name, param in module.named_parameters(recurse=False):
            if name not in keep and param.is_floating_point():
                param.data = param.data.to(activations)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(activations))
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(CastOutput(activations))


class CastOutput:
    """A forward hook casting a module's output to `dtype` (a class, not a closure: a model holding it can be saved,
    modelzoo/weight_cache.py)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out.to(self.dtype)


class PackedLinear(nn.Module):
    """A linear layer whose weight a C++ GEMM reads in a layout of its own (`pack`), with a float32 bias and float32
    outputs; shape_key names its weight as the GEMM plan does ('bfloat16 576x1536'). The layout is written into
    `arena` where given (beside the model's other packed weights, on huge pages: replace_linear_layers), else into
    new memory; the layer's weight is left as it was."""

    reads_weight_in_place = False  # the layer's weight is copied: its checkpoint pages can go

    def __init__(self, layer: nn.Module, arena: PackedWeightArena | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear_shape(layer)
        self.packed = self.pack_parts(weight_parts(layer), arena.take if arena is not None else new_memory)
        self.shape_key = linear_shape_key(layer, self.packed.dtype)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def pack(self, weight: torch.Tensor, memory: Memory) -> torch.Tensor:
        """W (N, K) -> the kernel's layout, written into memory(shape, dtype)."""
        raise NotImplementedError

    def pack_parts(self, parts: list[torch.Tensor], memory: Memory) -> torch.Tensor:
        """The layout of the parts' stack (N_i, K): here packed from one stacked copy."""
        return self.pack(parts[0] if len(parts) == 1 else torch.cat(parts), memory)

    def packed_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class BF16Linear(PackedLinear):
    """A linear layer multiplied by bf16_linear (AVX512-BF16 dot products) or, with `amx`, by amx_bf16_linear (AMX
    tiles: the same packed weight and inputs, sums in another order): its weight packed into (N/16, K/2, 16, 2)
    bfloat16, a float32 bias, float32 (or 16-bit) inputs, float32 outputs."""

    applies_silu_gate = False
    rounds_inputs_to_bf16 = True  # a bfloat16 input is multiplied as it is: the same products as its float32 source's

    def __init__(self, layer: nn.Module, amx: bool = False, arena: PackedWeightArena | None = None) -> None:
        self.amx = amx
        super().__init__(layer, arena)

    @property
    def kernel(self) -> str:
        """The C++ function this layer calls."""
        return "amx_bf16_linear" if self.amx else "bf16_linear"

    def pack_parts(self, parts: list[torch.Tensor], memory: Memory) -> torch.Tensor:
        return pack_bf16_parts(parts, memory, self.applies_silu_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from modelzoo.cpu.kernels import cpu_kernels

        multiply = getattr(cpu_kernels(), self.kernel)
        return multiply(x, self.packed, self.bias, self.out_features)  # (..., N) float32

    @property
    def fuses_greedy(self) -> bool:
        """Whether `greedy` can pick each row's largest output inside the GEMM, never writing the outputs."""
        return not self.applies_silu_gate

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).max(-1).indices (...) long, the outputs never written: each row's first largest output (the first
        NaN where there is one), from the same float32 sums (amx_bf16_greedy or bf16_greedy)."""
        from modelzoo.cpu.kernels import cpu_kernels

        pick = cpu_kernels().amx_bf16_greedy if self.amx else cpu_kernels().bf16_greedy
        return pick(x, self.packed, self.bias, self.out_features)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += forward(x) in place (residual (..., N) float32), the bits of residual + forward(x): added as the
        GEMM writes its outputs (bf16_linear_add_, amx_bf16_linear_add_)."""
        from modelzoo.cpu.kernels import cpu_kernels

        add = cpu_kernels().amx_bf16_linear_add_ if self.amx else cpu_kernels().bf16_linear_add_
        return add(residual, x, self.packed, self.bias, self.out_features)


class SiluGatedBF16Linear(BF16Linear):
    """The gate | up projection of a SwiGLU MLP multiplied by bf16_silu_gate (amx_bf16_silu_gate with `amx`): returns
    silu(gate) * up (..., N/2) float32, with silu_mul's bits, without writing gate | up. Its weight's blocks of 16 rows
    are packed so that each tile of 4 blocks holds 32 features' gate rows, then their up rows (pack_bf16_parts)."""

    applies_silu_gate = True  # GatedMLP feeds its output straight to down_proj
    add_into = None  # its outputs are gated, never a residual's increment

    def __init__(self, layer: nn.Module, amx: bool = False, arena: PackedWeightArena | None = None) -> None:
        super().__init__(layer, amx, arena)
        self.out_features //= 2  # silu(gate) * up: one output per gate | up pair

    @property
    def kernel(self) -> str:
        return "amx_bf16_silu_gate" if self.amx else "bf16_silu_gate"

    def forward(self, x: torch.Tensor, round_to_bf16: bool = False) -> torch.Tensor:
        """silu(gate) * up (..., N/2) float32; with `round_to_bf16` (for a consumer that rounds its inputs to bfloat16
        anyway) bfloat16, half the bytes."""
        from modelzoo.cpu.kernels import cpu_kernels

        if self.amx:
            return cpu_kernels().amx_bf16_silu_gate(x, self.packed, self.out_features, round_to_bf16)
        return cpu_kernels().bf16_silu_gate(x, self.packed, self.out_features, round_to_bf16)


def silu_gate_fusable(parent: nn.Module, name: str, layer: nn.Module) -> bool:
    """Whether `layer` is the gate | up projection of a SiLU GatedMLP whose gate can be applied in the GEMM: no bias
    (none of our families has one there) and a width in whole tiles."""
    return (name == "gate_up_proj" and getattr(parent, "silu_gated", False) and layer.bias is None
            and isinstance(layer, (nn.Linear, JoinedLinear)) and layer.out_features % (2 * SILU_GATE_TILE) == 0)


def pack_bf16_weight(weight: torch.Tensor, memory: Memory = new_memory) -> torch.Tensor:
    """W (N, K) -> (ceil(N/16), ceil(K/2), 16, 2) bfloat16: for each pair of inputs, 16 output rows' two values
    side by side (zero rows and a zero column pad N and K), written into memory(shape, dtype)."""
    return pack_bf16_parts([weight], memory)


def pack_bf16_parts(parts: list[torch.Tensor], memory: Memory = new_memory, silu_gate: bool = False) -> torch.Tensor:
    """pack_bf16_weight of the parts' stack (N_i, K) (with `silu_gate`: of gate | up, each tile of 4 blocks 32
    features' gate rows then their up rows), packed by the C++ kernels from the parts where they lie (where they are
    bfloat16 rows, every part but the last in whole blocks of 16 rows; else from one stacked bfloat16 copy), every
    block in parallel, into memory(shape, dtype)."""
    from modelzoo.cpu.kernels import cpu_kernels

    if not rows_readable(parts, (torch.bfloat16,)):
        stacked = torch.cat(parts).to(torch.bfloat16).contiguous()
        parts = [stacked]
    if silu_gate and len(parts) == 1:
        parts = list(parts[0].chunk(2))  # gate, up: views of the stack
    out_features, in_features = sum(part.shape[0] for part in parts), parts[0].shape[1]
    shape = (-(-out_features // GEMM_BLOCK), -(-in_features // 2), GEMM_BLOCK, 2)
    return cpu_kernels().pack_bf16_rows(parts, silu_gate, memory(shape, torch.bfloat16))


def replace_linear_layers(model: nn.Module,
                          pack: Callable[[nn.Module, str, nn.Module, PackedWeightArena], tuple[nn.Module, str]],
                          arena_bytes: Callable[[nn.Module], int] | None = None) -> dict[str, str]:
    """Replaces every linear layer of `model` by pack(parent, name, layer, arena) -> (packed layer, its kernel), one at
    a time, the packed weights side by side in one PackedWeightArena of arena_bytes(layer) for each layer (default:
    packed_bytes_bound); each old weight a packed layer copied is dropped at once (the checkpoint's pages it viewed,
    or its own memory, given back every TRIM_BYTES, so that the peak holds one copy of the weights), one a layer reads
    in place is kept. Returns {shape key: kernel} for the GEMM plan."""
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if linear_like(child)][::-1]  # popped first to last: laid out in the order a forward pass reads them
    arena = PackedWeightArena(sum((arena_bytes or packed_bytes_bound)(layer) for _, _, layer in layers))
    shapes, dropped = {}, 0
    while layers:
        parent, name, layer = layers.pop()
        packed, kernel = pack(parent, name, layer, arena)
        shapes[packed.shape_key] = kernel
        setattr(parent, name, packed)
        if not packed.reads_weight_in_place:
            for part in weight_parts(layer):
                release_mapped(part)  # the checkpoint's pages of the weight just packed
                dropped += part.numel() * part.element_size()
        del layer
        if dropped >= TRIM_BYTES or not layers:
            release_freed_memory()  # a fused or cast weight's memory, or the allocator keeps it and the peak doubles
            dropped = 0
    return shapes


def oriented_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as (out_features, in_features): a transposed view of a Conv1D's (in, out) one."""
    weight = layer.weight.detach()
    return weight.t() if getattr(layer, "weight_is_in_out", False) else weight


def packed_bytes_bound(layer: nn.Module) -> int:
    """At least the bytes of any packed layout of a linear layer's weight W (N, K) (rows padded to blocks of 16,
    inputs to pairs, no element narrower than 2 bytes), with its alignment in a PackedWeightArena."""
    in_features, out_features = linear_shape(layer)
    rows = -(-out_features // GEMM_BLOCK) * GEMM_BLOCK
    return rows * (in_features + 1) * max(layer.weight.element_size(), 2) + 64


def linear_shape(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer (linear_like)."""
    out_features, in_features = layer.weight.shape
    return (out_features, in_features) if getattr(layer, "weight_is_in_out", False) else (in_features, out_features)


def linear_shape_key(layer: nn.Module, dtype: torch.dtype) -> str:
    """A linear layer's weight as the GEMM plan names it: 'bfloat16 576x1536' (dtype, in_features x out_features)."""
    in_features, out_features = linear_shape(layer)
    return f"{str(dtype).replace('torch.', '')} {in_features}x{out_features}"


def apply_bf16_gemm(model: nn.Module, amx: Collection[str] = (), in_place: Collection[str] = ()) -> dict[str, str]:
    """Replaces every linear layer of `model` by a BF16Linear (a SiluGatedBF16Linear for a SiLU GatedMLP's gate | up),
    multiplying on AMX tiles the layers whose shape key is in `amx`, or by an InPlaceBF16Linear (InPlaceSiluGated...)
    where its shape key is in `in_place` and its weight can be read where it lies; returns {shape key: kernel} for the
    GEMM plan."""
    def stays(layer: nn.Module) -> bool:
        return linear_shape_key(layer, torch.bfloat16) in in_place and reads_in_place(layer, (torch.bfloat16,))

    def pack(parent: nn.Module, name: str, layer: nn.Module, arena: PackedWeightArena) -> tuple[nn.Module, str]:
        gated = silu_gate_fusable(parent, name, layer)
        if stays(layer):
            kept = (InPlaceSiluGatedBF16Linear if gated else InPlaceBF16Linear)(layer)
            return kept, kept.kernel
        tiles = linear_shape_key(layer, torch.bfloat16) in amx
        packed = (SiluGatedBF16Linear if gated else BF16Linear)(layer, tiles, arena)
        return packed, packed.kernel

    return replace_linear_layers(model, pack, lambda layer: 0 if stays(layer) else packed_bytes_bound(layer))


class HalfLinear(PackedLinear):
    """A linear layer multiplied by half_linear: its bfloat16 or float16 weight packed into (N/16, K, 16) in its own
    dtype, widened to float32 as the kernel reads it; a float32 bias, float32 inputs and outputs. A float32 weight
    packs the same way (the float32 GEMM candidate `packed`, modelzoo/cpu/gemm.py)."""

    kernel = "half_linear"

    def pack(self, weight: torch.Tensor, memory: Memory) -> torch.Tensor:
        return pack_half_weight(weight, memory)

    def pack_parts(self, parts: list[torch.Tensor], memory: Memory) -> torch.Tensor:
        return pack_half_parts(parts, memory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from modelzoo.cpu.kernels import cpu_kernels

        return cpu_kernels().half_linear(x.float(), self.packed, self.bias, self.out_features)  # (..., N) float32

    fuses_greedy = True  # `greedy` picks each row's largest output inside the GEMM, never writing the outputs

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).max(-1).indices (...) long, the outputs never written (half_greedy; BF16Linear.greedy)."""
        from modelzoo.cpu.kernels import cpu_kernels

        return cpu_kernels().half_greedy(x.float(), self.packed, self.bias, self.out_features)


def pack_half_weight(weight: torch.Tensor, memory: Memory = new_memory) -> torch.Tensor:
    """W (N, K) bfloat16, float16 or float32 -> (ceil(N/16), K, 16) in its dtype: for each input, 16 output rows'
    values side by side (zero rows pad N), written by the C++ kernels into memory(shape, dtype), every block in
    parallel."""
    from modelzoo.cpu.kernels import cpu_kernels

    out_features, in_features = weight.shape
    packed = memory((-(-out_features // GEMM_BLOCK), in_features, GEMM_BLOCK), weight.dtype)
    return cpu_kernels().pack_half_weight(weight, packed)


def pack_half_parts(parts: list[torch.Tensor], memory: Memory = new_memory) -> torch.Tensor:
    """pack_half_weight of the parts' stack (N_i, K) without a stacked copy: each part packed straight into its own
    blocks of the layout (where every part but the last fills whole blocks of 16 rows; else stacked first)."""
    from modelzoo.cpu.kernels import cpu_kernels

    if len(parts) == 1 or any(part.shape[0] % GEMM_BLOCK for part in parts[:-1]):
        return pack_half_weight(parts[0] if len(parts) == 1 else torch.cat(parts), memory)
    blocks = [-(-part.shape[0] // GEMM_BLOCK) for part in parts]
    packed = memory((sum(blocks), parts[0].shape[1], GEMM_BLOCK), parts[0].dtype)
    first = 0
    for part, count in zip(parts, blocks):
        cpu_kernels().pack_half_weight(part, packed[first:first + count])  # a contiguous slice of whole blocks
        first += count
    return packed


class InPlaceLinear(nn.Module):
    """A linear layer whose 16-bit weight a C++ GEMM reads where it lies, in rows (a view of the checkpoint's memory
    map, or a JoinedLinear's parts side by side), with the bits of the same GEMM over the packed weight: nothing is
    written at set-up. A float32 bias, float32 inputs (any float dtype where the kernel rounds them to bfloat16 itself)
    and float32 outputs."""

    kernel = ""  # the C++ function, called (x, parts, bias)
    greedy_kernel = ""  # the same GEMM's picks, called (x, parts, bias): each row's first largest output
    dtypes: tuple[torch.dtype, ...] = ()  # the weight dtypes it reads
    reads_weight_in_place = True  # its checkpoint pages are the weight
    rounds_inputs_to_bf16 = False  # True: the kernel takes inputs of any float dtype as they are, else float32

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if not reads_in_place(layer, self.dtypes):
            raise ValueError(f"{self.kernel} reads {' or '.join(str(d)[6:] for d in self.dtypes)} rows with unit "
                             "stride, every part but the last in whole blocks of 16 rows")
        self.parts = tuple(weight_parts(layer))
        self.in_features, self.out_features = linear_shape(layer)
        self.shape_key = linear_shape_key(layer, self.parts[0].dtype)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from modelzoo.cpu.kernels import cpu_kernels

        return getattr(cpu_kernels(), self.kernel)(self.kernel_input(x), list(self.parts), self.bias)  # (..., N) f32

    def kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the kernel takes it: as it is where the kernel rounds it to bfloat16 itself, else float32."""
        return x if self.rounds_inputs_to_bf16 else x.float()

    @property
    def fuses_greedy(self) -> bool:
        """Whether `greedy` can pick each row's largest output inside the GEMM, never writing the outputs."""
        return bool(self.greedy_kernel)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).max(-1).indices (...) long, the outputs never written: each row's first largest output (the first
        NaN where there is one), from the same float32 sums."""
        from modelzoo.cpu.kernels import cpu_kernels

        return getattr(cpu_kernels(), self.greedy_kernel)(self.kernel_input(x), list(self.parts), self.bias)

    def packed_bytes(self) -> int:
        """The weight's bytes (held outside the layer's parameters)."""
        return sum(part.numel() * part.element_size() for part in self.parts)


class InPlaceHalfLinear(InPlaceLinear):
    """half_linear_rows: a bfloat16 or float16 weight read where it lies, widened to float32 as the kernel reads it,
    with half_linear's bits."""

    kernel = "half_linear_rows"
    greedy_kernel = "half_greedy_rows"
    dtypes = (torch.bfloat16, torch.float16)


class InPlaceBF16Linear(InPlaceLinear):
    """bf16_linear_rows: a bfloat16 weight read where it lies, times the inputs rounded to bfloat16, with bf16_linear's
    bits."""

    kernel = "bf16_linear_rows"
    greedy_kernel = "bf16_greedy_rows"
    dtypes = (torch.bfloat16,)
    rounds_inputs_to_bf16 = True  # as BF16Linear

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += forward(x) in place, as BF16Linear.add_into (bf16_linear_rows_add_)."""
        from modelzoo.cpu.kernels import cpu_kernels

        return cpu_kernels().bf16_linear_rows_add_(residual, self.kernel_input(x), list(self.parts), self.bias)


class InPlaceSiluGatedBF16Linear(InPlaceBF16Linear):
    """A SwiGLU MLP's gate | up projection read where it lies by bf16_silu_gate_rows: silu(gate) * up (..., N/2)
    float32, with bf16_silu_gate's bits."""

    kernel = "bf16_silu_gate_rows"
    greedy_kernel = ""  # its outputs are silu(gate) * up, not a head's
    applies_silu_gate = True  # GatedMLP feeds its output straight to down_proj
    add_into = None  # nor a residual's increment

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        if len(self.parts) == 1:
            self.parts = tuple(self.parts[0].chunk(2))  # gate, up: views of the stacked weight
        self.out_features //= 2

    def forward(self, x: torch.Tensor, round_to_bf16: bool = False) -> torch.Tensor:
        """silu(gate) * up (..., N/2) float32, or rounded to bfloat16 with `round_to_bf16` (SiluGatedBF16Linear)."""
        from modelzoo.cpu.kernels import cpu_kernels

        return cpu_kernels().bf16_silu_gate_rows(self.kernel_input(x), *self.parts, round_to_bf16)


def reads_in_place(layer: nn.Module, dtypes: Collection[torch.dtype] = (torch.bfloat16, torch.float16)) -> bool:
    """Whether half_linear_rows (bf16_linear_rows: `dtypes` bfloat16 alone) can read a linear layer's weight where it
    lies: rows of `dtypes` with unit stride (not a Conv1D's (in, out) weight), every part but the last in whole blocks
    of 16 rows."""
    return rows_readable(weight_parts(layer), dtypes)


def rows_readable(parts: list[torch.Tensor], dtypes: Collection[torch.dtype]) -> bool:
    """Whether the C++ kernels read these weight parts (N_i, K) as rows: `dtypes`, unit column stride, every part but
    the last in whole blocks of 16 rows."""
    return (all(part.dtype in dtypes and part.stride(-1) == 1 for part in parts)
            and all(part.shape[0] % GEMM_BLOCK == 0 for part in parts[:-1]))


class TiedHalfEmbedding(nn.Module):
    """A token embedding whose table is its tied head's packed weight (one copy for both, where a 3B model's
    vocabulary table alone is 0.3 GB): each token's row read back from the (N/16, K, 16) layout, as float32."""

    def __init__(self, embedding: nn.Embedding, head: HalfLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.head = [head]  # a plain list: the head stays registered where it lives, not twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) -> (..., dim) float32."""
        return self.head[0].packed[tokens // GEMM_BLOCK, :, tokens % GEMM_BLOCK].float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the tied head's packed table"


def apply_half_gemm(model: nn.Module, in_place: Collection[str] = ()) -> dict[str, str]:
    """Replaces every linear layer of `model` (16-bit weights) by an InPlaceHalfLinear where its shape key is in
    `in_place` and its weight can be read where it lies (reads_in_place), else by a HalfLinear, and a token embedding
    tied to a HalfLinear by a TiedHalfEmbedding (one tied to a layer read in place reads its own table: the same
    pages); returns {shape key: kernel} for the GEMM plan."""
    embeddings = {module.weight.data_ptr(): (parent, name, module) for parent in model.modules()
                  for name, module in parent.named_children() if isinstance(module, nn.Embedding)}

    def stays(layer: nn.Module) -> bool:
        return linear_shape_key(layer, layer.weight.dtype) in in_place and reads_in_place(layer)

    def pack(parent: nn.Module, name: str, layer: nn.Module, arena: PackedWeightArena) -> tuple[nn.Module, str]:
        if stays(layer):
            return InPlaceHalfLinear(layer), InPlaceHalfLinear.kernel
        packed = HalfLinear(layer, arena)
        tied = embeddings.pop(layer.weight.data_ptr(), None)
        if tied is not None and not getattr(layer, "weight_is_in_out", False):
            owner, attribute, _ = tied
            setattr(owner, attribute, TiedHalfEmbedding(tied[2], packed))
        return packed, HalfLinear.kernel

    return replace_linear_layers(model, pack, lambda layer: 0 if stays(layer) else packed_bytes_bound(layer))
