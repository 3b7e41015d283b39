"""Which library multiplies the weights on this CPU, chosen by measuring, and the weights in its layout.

The fastest GEMM differs from one CPU to the next (measured with torch 2.13, 2 threads, float32,
576 x 1536 at M = 32: on AMD EPYC Zen 4 MKL reaches 93-142 GFLOP/s and oneDNN with a prepacked
weight 191-207; on Intel Ice Lake MKL's packed GEMM was the fastest). So for each weight shape the
job multiplies, the candidates are timed on this machine at a prefill-sized and a decode-sized M:

- `torch`:  `F.linear` on the checkpoint's weight (MKL for float32, oneDNN for bfloat16).
- `onednn`: the weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`, the ops
            PyTorch's Inductor emits); the reordered copy *replaces* the checkpoint's.
- `mkl`:    MKL's packed GEMM for the decode batch's row count (`torch.ops.mkl`, float32 only); MKL
            needs the plain weight for every other row count, so it keeps two copies.
- `packed`: zoo-infer's own C++ GEMM (`half_linear`, modelzoo/cpu/kernels/half_gemm.cpp) over the weight packed
            in blocks of 16 outputs, each output one float32 fused multiply-add chain in ascending k: batch-invariant
            by construction, its work split in tasks small enough to keep every thread busy; the packed copy
            replaces the checkpoint's. float32, where the C++ kernels are built.
- `onednn_blocks`, `torch_blocks`: `onednn` and `torch` called on fixed blocks of rows, the last one
            zero-padded: every call the library sees has the same shape, so its blocking (AMX tiles included)
            cannot follow the number of rows, and neither can a row's bits. They cost the padding and a copy
            of the output; auto takes them where the plain call is not batch-invariant (on Intel AMX CPUs, in
            bfloat16, neither oneDNN nor torch is). The block (16, 32 or 64 rows: BLOCK_ROWS) is measured
            too, per shape: small blocks pad a decode step less, large ones let the library block a prefill.

A candidate must also be batch-invariant here: each row of its output must not depend on how many
rows share the call or where it sits among them (checked bit for bit at M = 1, 7 and 32 against the same
rows in a larger call, at its start and further in), or
a job's tokens would depend on which rows share its batch, and a resumed job's files would differ
from an uninterrupted one's. A candidate that fails is not chosen (a forced one runs, with a
warning). The fastest remaining one (time per row at M = 256 plus time per row at M = 32: as many
prompt tokens as generated ones) is kept, logged with its rates, and cached per CPU model, flags
and torch version beside the C++ kernels' builds (<root>/<machine>/gemm_choices.json: read from every
kernel root of modelzoo/cpu/kernels, the first root's entry winning, written to its writable root), so that
every job on this machine type makes the same choice and produces the same bits.

The bfloat16 precision policy's GEMMs (float32 outputs, modelzoo/cpu/precision.py) are chosen the same way
(`apply_bf16_kernels`): bf16_linear against amx_bf16_linear where the CPU has AMX-BF16, cached apart in
bf16_gemm_choices.json.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.cpu.memory import PackedWeightArena, release_freed_memory, release_mapped
from modelzoo.cpu.precision import (BF16Linear, HalfLinear, InPlaceBF16Linear, InPlaceHalfLinear, apply_bf16_gemm,
                                    apply_half_gemm, linear_like, linear_shape, linear_shape_key, pack_bf16_weight,
                                    pack_half_weight, packed_bytes_bound, reads_in_place)
from modelzoo.errors import UserError
from modelzoo.cpu.kernels import cpu_kernels, kernel_build_dir, read_machine_choices, write_machine_choices

log = logging.getLogger("zoo-infer")

BACKENDS = ("mkl", "onednn", "packed", "torch", "onednn_blocks", "torch_blocks")
PREFILL_ROWS, DECODE_ROWS = 256, 32  # the row counts timed (fixed, so the choice does not depend on the job)
INVARIANCE_ROWS = (1, 7, DECODE_ROWS)  # row counts whose rows must equal the same rows in a larger call
INVARIANCE_OFFSETS = (0, 5, 70)  # where those rows sit in the larger call (70: past a block of any BLOCK_ROWS)
BLOCK_ROWS = (16, 32, 64)  # the row blocks a *_blocks backend is timed with; each shape keeps its fastest
BLOCK_BACKENDS = ("onednn_blocks", "torch_blocks")
MEASURED_WEIGHT_BYTES = 64 * 2**20  # a wider weight (a vocabulary head) is timed on as many outputs as fit
CACHE_VERSION = 3  # 2: the *_blocks backends' measured block rows; 3: candidates timed taking turns


class OneDNNLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)  # (N, K), blocked
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            # One row goes to oneDNN's matrix-vector kernel, which sums in another order than its GEMM (seen
            # on Zen 4 for K >= 1536): run it as two rows so that its bits do not depend on the row count.
            pair = x.reshape(1, -1).expand(2, -1).contiguous()  # (2, K)
            out = torch.ops.mkldnn._linear_pointwise(pair, self.packed, self.bias, "none", [], "")[:1]
            return out.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N)

    def packed_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class MKLPackedLinear(nn.Module):
    """nn.Linear whose weight is also packed by MKL for calls of exactly `rows` rows; other calls
    multiply the plain weight (MKL needs it), so the layer holds two copies."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.weight, self.bias, self.rows = linear.weight, linear.bias, rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), rows)  # not a buffer: never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] != self.rows:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)

    def packed_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class RowBlockLinear(nn.Module):
    """A linear layer multiplied by `backend` (torch or onednn) on fixed blocks of `block_rows` rows, the last one
    zero-padded. With torch it holds the weight itself (no plain nn.Linear left inside to be swapped again)."""

    def __init__(self, linear: nn.Linear, backend: str, block_rows: int) -> None:
        super().__init__()
        self.out_features, self.block_rows = linear.out_features, block_rows
        if backend == "torch":
            self.weight, self.bias = linear.weight, linear.bias
            self.packed: OneDNNLinear | None = None
        else:
            self.packed = OneDNNLinear(linear)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """One block (block_rows, K) -> (block_rows, N)."""
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (M, K)
        rows = flat.shape[0]
        out = flat.new_empty(rows, self.out_features)  # (M, N)
        block = self.block_rows
        whole = rows - rows % block
        for start in range(0, whole, block):
            out[start: start + block] = self.inner(flat[start: start + block])
        if whole < rows:
            padded = flat.new_zeros(block, flat.shape[1])  # (block_rows, K)
            padded[: rows - whole] = flat[whole:]
            out[whole:] = self.inner(padded)[: rows - whole]
        return out.view(*x.shape[:-1], self.out_features)


@functools.cache
def onednn_reorders(dtype: torch.dtype) -> bool:
    """Whether this torch build lays out a `dtype` weight for oneDNN on this CPU (its bfloat16 path needs AVX512-BW,
    VL and DQ or AVX-NE-CONVERT: not on AVX2-only CPUs such as AMD Zen 3)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The candidates this torch build offers for `dtype` on `device` (CUDA: torch only)."""
    if device.type != "cpu":
        return ["torch"]
    names = ["torch", "torch_blocks"]
    if onednn_reorders(dtype):
        names[:0] = ["onednn", "onednn_blocks"]
    if dtype == torch.float32 and torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        names.insert(0, "mkl")
    if dtype == torch.float32 and cpu_kernels() is not None:
        names.append("packed")
    return names


def wrap(linear: nn.Linear, backend: str, decode_rows: int = DECODE_ROWS, block_rows: int = BLOCK_ROWS[-1],
         arena: PackedWeightArena | None = None) -> nn.Module:
    """`linear` multiplied by `backend` (the module that replaces it); block_rows: a *_blocks backend's block; arena:
    where `packed` lays out its weight (else new memory)."""
    if backend == "onednn":
        return OneDNNLinear(linear)
    if backend == "mkl":
        return MKLPackedLinear(linear, decode_rows)
    if backend == "torch":
        return linear
    if backend == "packed":
        return HalfLinear(linear, arena)
    if backend in BLOCK_BACKENDS:
        return RowBlockLinear(linear, backend.removesuffix("_blocks"), block_rows)
    raise ValueError(f"unknown GEMM backend {backend!r}; one of {', '.join(BACKENDS)}")


@dataclass
class ShapeChoice:
    """The measurement and decision for one weight shape and dtype."""

    backend: str
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # backend -> {"M=256": rate, "M=32": rate}
    invariant: dict[str, bool] = field(default_factory=dict)  # backend -> rows independent of M
    rejected: dict[str, str] = field(default_factory=dict)  # backend -> why it could not run
    block_rows: dict[str, int] = field(default_factory=dict)  # a *_blocks backend -> its fastest block, as measured


TIMING_ROUNDS = (3, 30)  # the least and most rounds of calls measure_shape times each candidate in


def _seconds_per_call(calls: dict[tuple, Callable[[], object]], budget_s: float = 0.15) -> dict[tuple, float]:
    """Each of `calls`' best time, after a warm-up call of each: the calls take turns, one of each a round, for
    TIMING_ROUNDS rounds, more while less than about `budget_s` a call has passed. A spell where the machine runs slow
    (a neighbour on a VM, a descheduled vCPU: a few milliseconds cover every call of a small GEMM) falls on every
    candidate alike, not on whichever ran through it."""
    for fn in calls.values():
        fn()
    best = dict.fromkeys(calls, float("inf"))
    least, most = TIMING_ROUNDS
    spent, rounds = 0.0, 0
    while rounds < least or (spent < budget_s * len(calls) and rounds < most):
        for key, fn in calls.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            best[key], spent = min(best[key], elapsed), spent + elapsed
        rounds += 1
    return best


def measure_shape(in_features: int, out_features: int, dtype: torch.dtype, backends: list[str],
                  timed_rows: tuple[int, ...] = (PREFILL_ROWS, DECODE_ROWS),
                  build: Callable[[nn.Linear, str], nn.Module] = wrap) -> ShapeChoice:
    """Times (at each of `timed_rows`, the candidates taking turns: _seconds_per_call) and checks each backend on a
    random weight of this shape; keeps the fastest invariant one. build(layer, backend): the module a backend
    multiplies that layer with. A weight over MEASURED_WEIGHT_BYTES is timed on its first outputs only (the rate of a
    GEMM that wide no longer depends on its width), so that the start-up does not hold a second, random copy of a
    vocabulary head (0.4 GiB for a 2048 x 49152 float32 one) and each candidate's layout of it (held side by side
    while they take turns)."""
    generator = torch.Generator().manual_seed(0)
    out_features = measured_out_features(in_features, out_features, dtype)
    linear = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.normal_(0.0, in_features ** -0.5, generator=generator)  # in place: no second copy
    x = torch.randn(max(PREFILL_ROWS, *timed_rows), in_features, generator=generator, dtype=dtype)
    rows_at = [(rows, offset) for rows in INVARIANCE_ROWS for offset in INVARIANCE_OFFSETS]
    choice = ShapeChoice(backend="torch")
    parts = {rows: x[:rows].contiguous() for rows in timed_rows}

    def invariant(module: nn.Module) -> bool:
        """Whether the module's rows are batch-invariant (its first call: a failing candidate raises here)."""
        full = module(x)  # (rows, N)
        return all(torch.equal(module(x[offset: offset + rows].contiguous()), full[offset: offset + rows])
                   for rows, offset in rows_at)

    with torch.inference_mode():
        # (backend, block rows or 0) -> its module and invariance: a *_blocks backend once per block size
        candidates: dict[tuple[str, int], tuple[nn.Module, bool]] = {}
        for backend in backends:
            try:
                if backend in BLOCK_BACKENDS:
                    for rows in BLOCK_ROWS:
                        module = wrap(linear, backend, block_rows=rows)
                        candidates[backend, rows] = module, invariant(module)
                else:
                    module = build(linear, backend)
                    candidates[backend, 0] = module, invariant(module)
            except (RuntimeError, NotImplementedError) as error:  # e.g. a dtype this CPU's oneDNN lacks
                choice.rejected[backend] = str(error).strip().splitlines()[0][:200]
                candidates = {key: value for key, value in candidates.items() if key[0] != backend}
        # every candidate at every row count, taking turns: the same spells of the machine for all
        seconds = _seconds_per_call({(*key, rows): functools.partial(module, parts[rows])
                                     for key, (module, _) in candidates.items() for rows in timed_rows})
    # {"M=256": GFLOP/s, ...} of each candidate, 3 significant digits: never 0, tiny shapes too
    rates = {key: {f"M={rows}": float(f"{2 * rows * in_features * out_features / seconds[(*key, rows)] / 1e9:.3g}")
                   for rows in timed_rows} for key in candidates}
    for backend in dict.fromkeys(backend for backend, _ in candidates):
        blocks = [block for name, block in candidates if name == backend]
        if backend in BLOCK_BACKENDS:  # each block size timed, the fastest batch-invariant one kept
            best = int(fastest({"gflops": {str(block): rates[backend, block] for block in blocks},
                                "invariant": {str(block): candidates[backend, block][1] for block in blocks}}))
            choice.block_rows[backend] = best
        else:
            best = 0
        choice.gflops[backend], choice.invariant[backend] = rates[backend, best], candidates[backend, best][1]
    choice.backend = fastest(asdict(choice))
    return choice


def measured_out_features(in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """The outputs timed for a weight shape: all of them, or as many as fit in MEASURED_WEIGHT_BYTES
    (a multiple of 64, at least 64)."""
    fit = MEASURED_WEIGHT_BYTES // (in_features * dtype.itemsize) // 64 * 64
    return min(out_features, max(64, fit))


def fastest(measured: dict, exclude: tuple[str, ...] = ()) -> str:
    """The backend of least time per row summed over the row counts timed (M = 256 and M = 32 in a job:
    as many prompt tokens as generated ones) among the batch-invariant ones measured (all measured if
    none is), `exclude` left out."""
    cost = {backend: sum(1 / rate for rate in rates.values())  # time per row is proportional to 1 / rate
            for backend, rates in measured["gflops"].items() if backend not in exclude}
    usable = [backend for backend in cost if measured["invariant"][backend]] or list(cost)
    return min(usable, key=cost.__getitem__) if usable else "torch"


GEMM_CHOICES = "gemm_choices.json"


def _shape_key(linear: nn.Linear, dtype: torch.dtype) -> str:
    return f"{str(dtype).replace('torch.', '')} {linear.in_features}x{linear.out_features}"


@dataclass
class GemmPlan:
    """What `apply_gemm_backend` did, for the log and summary.json."""

    requested: str
    layers: dict[str, str] = field(default_factory=dict)  # shape key -> backend
    measured: dict[str, dict] = field(default_factory=dict)  # shape key -> ShapeChoice as a dict
    batch_invariant: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    def check_invariance(self, backends: dict[str, str] | None = None) -> None:
        """Sets batch_invariant, with one warning naming the layers whose rows depend on the batch; `backends`:
        {shape key: measured backend} where `layers` names other kernels."""
        varying = [f"{key} ({backend})" for key, backend in (backends or self.layers).items()
                   if not self.measured[key]["invariant"].get(backend, False)]
        self.batch_invariant = not varying
        if varying:
            log.warning("not batch-invariant on this CPU, so a row's tokens may depend on which rows share its batch: "
                        "%s", ", ".join(varying))

    def add(self, other: GemmPlan) -> None:
        """Takes in another plan's layers (the int8 ones of modelzoo/cpu/int8_compute.py)."""
        self.requested = f"{self.requested}; int8 {other.requested}"
        self.layers.update(other.layers)
        self.measured.update(other.measured)
        self.batch_invariant &= other.batch_invariant


def measured_shapes(shapes: dict[str, tuple[int, int]], dtype: torch.dtype, backends: list[str],
                    build: Callable[[nn.Linear, str], nn.Module] = wrap,
                    opt_in: tuple[str, ...] = (), choices: str = GEMM_CHOICES,
                    timed_rows: tuple[int, ...] = (PREFILL_ROWS, DECODE_ROWS)) -> dict[str, dict]:
    """{key: ShapeChoice as a dict} for each {key: (in_features, out_features)}: this machine's cached
    choice (in its file `choices`) where it covers `backends`, else measured now with `build` at `timed_rows` (logged,
    and cached). Each one's `backend` is auto's choice: the fastest batch-invariant backend, never one of `opt_in`
    (measured and shown, used only when asked for)."""
    cache, measured = read_machine_choices(choices, CACHE_VERSION), {}
    for key, (in_features, out_features) in shapes.items():
        if key not in cache or set(cache[key]["gflops"]) | set(cache[key]["rejected"]) != set(backends):
            start = time.perf_counter()
            cache[key] = asdict(measure_shape(in_features, out_features, dtype, backends, timed_rows, build))
            log.info("%s measured in %.1fs: %s", key, time.perf_counter() - start,
                     rates_text(cache[key], rows=timed_rows))
            measured[key] = cache[key]
    error = write_machine_choices(choices, CACHE_VERSION, cache) if measured else None
    if error is not None:
        log.warning("GEMM choices not cached (%s); the next job measures again", error)
    return {key: {**cache[key], "backend": fastest(cache[key], exclude=opt_in)} for key in shapes}


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of every nn.Linear of `model`, subclasses (FalconLinear) included: a layer
    left to PyTorch's own GEMM would give rows that depend on the batch where that GEMM is not batch-invariant."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def apply_gemm_backend(model: nn.Module, dtype: torch.dtype, device: torch.device, requested: str = "auto",
                       decode_rows: int = DECODE_ROWS, spare_bytes: int | None = None) -> GemmPlan:
    """Replaces every nn.Linear of `model` by the chosen backend's layer (`requested`: auto or a backend
    name). spare_bytes: memory free for MKL's second copy of the weights (None: no limit)."""
    plan = GemmPlan(requested)
    layers = linear_layers(model)
    backends = available_backends(device, dtype)
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown GEMM backend {requested!r}; one of auto, {', '.join(BACKENDS)}")
    if requested != "auto" and requested not in backends:
        raise UserError(f"runconfig.gemm_backend {requested} is not available for {str(dtype).replace('torch.', '')} "
                        f"on {device} with this torch build; available: {', '.join(backends)}")
    if device.type != "cpu" or not layers:
        plan.layers = {_shape_key(layer, dtype): "torch" for _, _, layer in layers}
        return plan
    plan.measured = measured_shapes({_shape_key(layer, dtype): (layer.in_features, layer.out_features)
                                     for _, _, layer in layers}, dtype, backends)
    for key, measured in plan.measured.items():
        plan.layers[key] = measured["backend"] if requested == "auto" else requested
    # MKL keeps the plain weight beside its packed copy: only where that second copy fits.
    extra = sum(layer.weight.numel() * layer.weight.element_size() for _, _, layer in layers
                if plan.layers[_shape_key(layer, dtype)] == "mkl")
    if spare_bytes is not None and extra > spare_bytes:
        if requested == "mkl":
            raise UserError(f"runconfig.gemm_backend mkl keeps a second, packed copy of the weights ({extra / 2**30:.2f} "
                            f"GiB) but only {spare_bytes / 2**30:.2f} GiB is spare; use auto or onednn")
        log.info("MKL's packed copies would take %.2f GiB, over the %.2f GiB spare: the next fastest backend instead",
                 extra / 2**30, spare_bytes / 2**30)
        for key, backend in plan.layers.items():
            if backend == "mkl":
                plan.layers[key] = fastest(plan.measured[key], exclude=("mkl",))
    plan.check_invariance()
    arena = PackedWeightArena(sum(packed_bytes_bound(layer) for _, _, layer in layers  # `packed`'s weights
                                  if plan.layers[_shape_key(layer, dtype)] == "packed"))
    layers.reverse()  # popped first to last: `packed`'s weights laid out in the order a forward pass reads them
    while layers:  # one layer at a time, dropping each old layer at once: at most one weight is held twice
        parent, name, layer = layers.pop()
        key = _shape_key(layer, dtype)
        block_rows = plan.measured[key].get("block_rows", {}).get(plan.layers[key], BLOCK_ROWS[-1])
        setattr(parent, name, wrap(layer, plan.layers[key], decode_rows, block_rows, arena))
        release_mapped(layer.weight)  # re-laid out: its checkpoint pages go (kept as is: read again when used)
        del layer
    release_freed_memory()  # the checkpoint-layout weights just dropped
    log.info("GEMM backends (%s): %s", requested, "; ".join(
        f"{key} {backend} ({rates_text(plan.measured[key], backend)})" for key, backend in plan.layers.items()))
    return plan


BF16_GEMM_CHOICES = "bf16_gemm_choices.json"  # apart from GEMM_CHOICES: the same shape keys, other candidates


def available_bf16_kernels() -> list[str]:
    """The bfloat16-policy GEMMs this build offers: bf16_linear (AVX512-BF16), and amx_bf16_linear where the CPU has
    AMX-BF16 and Linux grants its tiles."""
    return ["bf16_linear", *(["amx_bf16_linear"] if cpu_kernels().amx_bf16_available() else [])]


def apply_bf16_kernels(model: nn.Module, requested: str = "auto", rows: int = DECODE_ROWS,
                       work: JobWork | None = None) -> GemmPlan:
    """Lays out every linear layer of `model` for the bfloat16 policy's GEMM (bfloat16 weights and inputs, float32
    sums and outputs). Where the CPU has AMX-BF16: per shape, the faster batch-invariant of bf16_linear and
    amx_bf16_linear as measured (and cached) here, every weight packed. Else bf16_linear, each shape packed or read
    where it lies (bf16_linear_rows: the same bits) as the job's most `work` pays for (choose_layouts; every weight
    packed where the work is unknown)."""
    kernels = available_bf16_kernels()
    plan, in_place, reasons = GemmPlan(requested), set(), []
    if len(kernels) > 1:
        shapes = {linear_shape_key(module, torch.bfloat16): linear_shape(module) for module in model.modules()
                  if linear_like(module)}
        plan.measured = measured_shapes(shapes, torch.float32, kernels, choices=BF16_GEMM_CHOICES,
                                        build=lambda linear, kernel: BF16Linear(linear, kernel == "amx_bf16_linear"))
        plan.check_invariance({key: measured["backend"] for key, measured in plan.measured.items()})
    elif work is not None:
        plan.measured, in_place, reasons = choose_layouts(model, rows, work, BF16_LAYOUTS)
    amx = {key for key, measured in plan.measured.items() if measured["backend"] == "amx_bf16_linear"}
    plan.layers = apply_bf16_gemm(model, amx, in_place)
    vector_dots = any(not kernel.startswith("amx_") for kernel in plan.layers.values())
    broadcast = (f" (bf16_linear's input pairs broadcast {cpu_kernels().bf16_gemm_broadcast()}, the faster here as "
                 "timed)" if vector_dots else "")
    if reasons:
        log.info("GEMMs: bfloat16 weights and inputs, float32 sums and outputs%s, weights packed or read in place "
                 "(for the job's at most %d decode steps of %d rows and %d prompt tokens): %s", broadcast,
                 work.decode_steps, rows, work.prompt_tokens, "; ".join(reasons))
        return plan
    log.info("GEMMs: bfloat16 weights and inputs, float32 sums and outputs%s: %s", broadcast, "; ".join(
        f"{key} {kernel}" + (f" ({rates_text(plan.measured[key], plan.measured[key]['backend'])})"
                             if key in plan.measured else "") for key, kernel in plan.layers.items()))
    return plan


PACKING_PROBE = (2048, 8192)  # the weight (N, K) whose packing into fresh memory times the set-up's packing rate


@dataclass(frozen=True)
class JobWork:
    """The most GEMM work a job may do, to weigh a layout's set-up against its speed: decode steps (each one call of
    every layer at the rows in flight), prompt tokens (prefilled PREFILL_ROWS or so a call) and prompts (the
    vocabulary head's rows in prefill: each prompt's last token alone)."""

    decode_steps: int
    prompt_tokens: int
    prompts: int

    def of_head(self) -> "JobWork":
        """The work of the vocabulary head: every decode step, and one prefill row per prompt."""
        return JobWork(self.decode_steps, self.prompts, self.prompts)


@dataclass(frozen=True)
class Layouts:
    """A GEMM's two layouts of 16-bit weights: `packed` (its kernel, over the weight written at set-up by `pack`
    (weight, memory) into fresh memory) or `in_place` (its kernel reading the weight where it lies, the same bits);
    `build` (layer, kernel) the layer of either; their timings cached per machine in `choices`, in the kernels'
    build folder; `dtypes`: the weight dtypes the in-place kernel reads."""

    packed: str
    in_place: str
    build: Callable[[nn.Module, str], nn.Module]
    pack: Callable[..., torch.Tensor]
    choices: str
    dtypes: tuple[torch.dtype, ...]

    @property
    def kernels(self) -> tuple[str, str]:
        return self.packed, self.in_place


HALF_LAYOUTS = Layouts(
    "half_linear", "half_linear_rows",
    lambda linear, kernel: HalfLinear(linear) if kernel == "half_linear" else InPlaceHalfLinear(linear),
    pack_half_weight, "half_gemm_choices.json", (torch.bfloat16, torch.float16))
BF16_LAYOUTS = Layouts(
    "bf16_linear", "bf16_linear_rows",
    lambda linear, kernel: BF16Linear(linear) if kernel == "bf16_linear" else InPlaceBF16Linear(linear),
    pack_bf16_weight, "bf16_layout_choices.json", (torch.bfloat16,))


def packing_rate(dtype: torch.dtype, pack: Callable[..., torch.Tensor] = pack_half_weight) -> float:
    """Bytes a second that `pack` (weight, memory) lays out here into fresh memory (a new PackedWeightArena's pages,
    touched for the first time, as at set-up), timed once on a PACKING_PROBE weight."""
    weight = torch.zeros(PACKING_PROBE, dtype=dtype)
    probe = nn.Linear(PACKING_PROBE[1], PACKING_PROBE[0], bias=False, device="meta", dtype=dtype)
    arena = PackedWeightArena(packed_bytes_bound(probe))
    start = time.perf_counter()
    pack(weight, arena.take)
    return weight.numel() * weight.element_size() / (time.perf_counter() - start)


def layout_gain(rates: dict[str, dict[str, float]], shape: tuple[int, int], rows: int, work: JobWork,
                layouts: Layouts) -> float:
    """Seconds packing one weight of `shape` (in, out) saves over `work` (negative: it loses), from the GFLOP/s of
    `layouts`' packed and in-place kernels at M = PREFILL_ROWS and M = rows."""
    packed, in_place = layouts.kernels
    flops = 2 * shape[0] * shape[1]
    seconds = {kernel: {m: flops * m / (rates[kernel][f"M={m}"] * 1e9) for m in (PREFILL_ROWS, rows)}
               for kernel in (packed, in_place)}
    saved = {m: seconds[in_place][m] - seconds[packed][m] for m in (PREFILL_ROWS, rows)}
    return work.decode_steps * saved[rows] + work.prompt_tokens / PREFILL_ROWS * saved[PREFILL_ROWS]


def choose_layouts(model: nn.Module, rows: int, work: JobWork, layouts: Layouts) -> tuple[dict, set[str], list[str]]:
    """Which shapes of `model`'s linear layers to read in place: both layouts timed here per shape at M = PREFILL_ROWS
    and M = rows (cached per machine, in the kernels' build), a shape packed where packing saves the job's most `work`
    more time than packing its weights takes (at packing_rate, measured now), and where its weight is not in rows.
    Returns ({shape key: measured}, the shape keys read in place, the reason of each choice, to log)."""
    layers = [module for module in model.modules() if linear_like(module)]
    head = model.get_submodule(model.head_name) if isinstance(getattr(model, "head_name", None), str) else None
    keys = [linear_shape_key(layer, layer.weight.dtype) for layer in layers]
    shapes = dict(zip(keys, (linear_shape(layer) for layer in layers)))
    dtype, timed = layers[0].weight.dtype, (PREFILL_ROWS, rows)
    choices = f"{kernel_build_dir().name}/{layouts.choices}"  # timed with the build that runs them
    timings = measured_shapes({f"{key} at M={rows}": shape for key, shape in shapes.items()}, dtype,
                              list(layouts.kernels), layouts.build, choices=choices, timed_rows=timed)
    rate = packing_rate(dtype, layouts.pack)
    measured, in_place, reasons = {}, set(), []
    for key, shape in shapes.items():
        choice = measured[key] = timings[f"{key} at M={rows}"]
        packing = keys.count(key) * shape[0] * shape[1] * dtype.itemsize / rate
        if not all(reads_in_place(layer, layouts.dtypes) for layer, other in zip(layers, keys) if other == key):
            pack, reason = True, "its weight is not in rows"
        else:
            gain = sum(layout_gain(choice["gflops"], shape, rows, work.of_head() if layer is head else work, layouts)
                       for layer, other in zip(layers, keys) if other == key)
            pack, reason = gain > packing, f"saves the job {gain:.1f}s at most, packing takes {packing:.1f}s"
        if not pack:
            in_place.add(key)
        text = rates_text(choice, rows=timed).replace(layouts.in_place, "in place").replace(layouts.packed, "packed")
        reasons.append(f"{key} {'packed' if pack else 'in place'} ({reason}; {text})")
    reasons.append(f"packing {rate / 1e9:.1f} GB/s into fresh memory here")
    return measured, in_place, reasons


def apply_half_kernels(model: nn.Module, rows: int, work: JobWork | None) -> GemmPlan:
    """Lays out every linear layer of `model` (16-bit weights) for half_linear: packed (HalfLinear: the weight written
    once into new memory at set-up, the faster layout at most row counts) or read where it lies (InPlaceHalfLinear,
    half_linear_rows: nothing written; the same bits), as the job's most `work` pays for (choose_layouts); with no
    `work` (a model kept for work unknown, or laid out for the weight cache) every weight is packed."""
    if work is None:
        plan = GemmPlan("auto", layers=apply_half_gemm(model))
        log.info("GEMMs: half_linear, weights packed (the job's work unknown, or the layout cached): %s",
                 ", ".join(plan.layers))
        return plan
    plan = GemmPlan("auto")
    plan.measured, in_place, reasons = choose_layouts(model, rows, work, HALF_LAYOUTS)
    plan.layers = apply_half_gemm(model, in_place)
    log.info("GEMMs: half_linear, weights packed or read in place (for the job's at most %d decode steps of %d rows "
             "and %d prompt tokens): %s", work.decode_steps, rows, work.prompt_tokens, "; ".join(reasons))
    return plan


def rates_text(measured: dict, only: str | None = None, rows: tuple[int, ...] = (PREFILL_ROWS, DECODE_ROWS)) -> str:
    """'onednn 205/190 GFLOP/s, torch_blocks 114/93 (32-row blocks), torch 120/90 (not batch-invariant)'
    (M=256 / M=32: the `rows` timed)."""
    parts = []
    for backend, rates in measured["gflops"].items():
        if only and backend != only:
            continue
        block = measured.get("block_rows", {}).get(backend)
        note = (f" ({block}-row blocks)" if block else "") + ("" if measured["invariant"].get(backend)
                                                              else " (not batch-invariant)")
        timed = "/".join(f"{rates[f'M={m}']:.0f}" for m in rows)
        parts.append(f"{backend} {timed} GFLOP/s{note}")
    return ", ".join(parts) + ("" if only else f" at M={'/'.join(map(str, rows))}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: each parameter or buffer storage once, plus what modules hold outside them
    (`packed_bytes`: a packed layout, or weights read where they lie)."""
    unique = {t.data_ptr(): t for t in model.state_dict(keep_vars=True).values() if t.device.type != "meta"}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    return total + sum(m.packed_bytes() for m in model.modules() if hasattr(m, "packed_bytes"))
