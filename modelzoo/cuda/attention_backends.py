"""On CUDA, the SDPA backend of each form of attention a job runs: timed once at set-up, then pinned for every call.

Left to itself, PyTorch picks a backend per call. On Hopper it prefers cuDNN, which builds an execution plan for
every new shape (every prefill group's length, every cache length bucket) on the host, and a boolean mask sends a
call to slower kernels. A job runs two forms of attention:
- prefill: a group of right-padded prompts attending causally over their own keys, (B, heads, T, hd) queries
  against (B, kv_heads, T, hd) keys and values, no mask;
- decode: one query per row over the cache's first L positions with an additive mask of each row's length, the
  query heads of a kv head grouped as the rows of one query block (`grouped_query_attention`), each call as
  a captured decode step runs it: replayed from a CUDA graph.
Each form is timed under every backend that takes it, on the job's own head layout and dtype; the fastest is pinned
(math stays enabled behind it, for a call it cannot take: an ALiBi bias, say), and remembered for the next job on
the same GPU model and software. The CPU runs its own C++ attention kernel and pins nothing.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from modelzoo.cpu.kernels import read_machine_choices, write_machine_choices
from modelzoo.cuda.graphs import captured
from modelzoo.models.layers import grouped_query_attention

log = logging.getLogger("zoo-infer")

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# The shapes timed: a prefill group of PREFILL_ROWS prompts of PREFILL_LENGTH tokens; decode over DECODE_LENGTH
# cache positions for the job's rows in flight.
PREFILL_ROWS, PREFILL_LENGTH, DECODE_LENGTH = 8, 512, 512
TIMED_CALLS, TIMED_REPLAYS = 5, 20
SDPA_CHOICES, CACHE_VERSION = "sdpa_choices.json", 2  # beside the GEMM choices (modelzoo/cpu/kernels)


@dataclass(frozen=True)
class AttentionBackends:
    """The backend pinned for prefill and for decode (None: PyTorch's own choice), and the timings that chose them
    (form -> backend -> microseconds per call, None where the backend does not take the form)."""

    prefill: str | None = None
    decode: str | None = None
    timings: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def prefill_context(self) -> ContextManager:
        return _pinned(self.prefill)

    def decode_context(self) -> ContextManager:
        return _pinned(self.decode)

    def describe(self) -> str:
        return f"prefill {self.prefill or 'default'}, decode {self.decode or 'default'}"


def _pinned(backend: str | None) -> ContextManager:
    if backend is None:
        return contextlib.nullcontext()
    return sdpa_kernel([BACKENDS[backend], SDPBackend.MATH] if backend != "math" else [SDPBackend.MATH])


def choose_attention_backends(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                              device: torch.device, decode_rows: int) -> AttentionBackends:
    """The backends for these heads, dtype and rows on `device` (CUDA; elsewhere nothing is pinned): as chosen by an
    earlier job on this GPU model and software (`sdpa_choices.json` beside the GEMM choices), else timed now and
    remembered; logged."""
    if device.type != "cuda":
        return AttentionBackends()
    key = choice_key(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), num_heads,
                     num_kv_heads, head_dim, dtype, decode_rows)
    known = read_machine_choices(SDPA_CHOICES, CACHE_VERSION).get(key)
    if known is not None:
        choice = AttentionBackends(known["prefill"], known["decode"], known["timings"])
        log.info("attention (SDPA) backends, as timed by an earlier job on this GPU and pinned: %s (%s)",
                 choice.describe(), SDPA_CHOICES)
        return choice
    choice = time_attention_backends(num_heads, num_kv_heads, head_dim, dtype, device, decode_rows)
    remember_choice(key, choice)
    return choice


def choice_key(gpu: str, capability: tuple[int, int], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, decode_rows: int) -> str:
    """What a choice depends on: the GPU model, the software that runs attention, the head layout, dtype and rows."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (f"{gpu} sm{capability[0]}{capability[1]} torch {torch.__version__} cudnn {cudnn} "
            f"{str(dtype).replace('torch.', '')} heads {num_heads}/{num_kv_heads}x{head_dim} rows {decode_rows}")


def remember_choice(key: str, choice: AttentionBackends) -> None:
    """Adds `choice` to this machine type's SDPA choices file (best effort)."""
    if choice.prefill is not None or choice.decode is not None:
        entries = read_machine_choices(SDPA_CHOICES, CACHE_VERSION)
        entries[key] = {"prefill": choice.prefill, "decode": choice.decode, "timings": choice.timings}
        error = write_machine_choices(SDPA_CHOICES, CACHE_VERSION, entries)
        if error is not None:
            log.warning("SDPA backend choice not cached (%s); the next job times again", error)


def time_attention_backends(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            device: torch.device, decode_rows: int) -> AttentionBackends:
    """Times each form under each backend on the CUDA `device` and keeps the fastest; logged."""
    longest = PREFILL_LENGTH + 8 * TIMED_CALLS
    q = torch.randn(PREFILL_ROWS, longest, num_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
    k, v = (torch.randn(PREFILL_ROWS, longest, num_kv_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
            for _ in range(2))
    gqa = num_heads != num_kv_heads

    def prefill(call: int) -> torch.Tensor:  # a new length each call, as each prefill group has (views of a
        length = PREFILL_LENGTH + 8 * call  # projection's output, as the model's are)
        return F.scaled_dot_product_attention(q[:, :, :length], k[:, :, :length], v[:, :, :length], is_causal=True,
                                              enable_gqa=gqa)[:, :, :PREFILL_LENGTH]

    rows = decode_rows
    dq = torch.randn(rows, num_heads, 1, head_dim, dtype=dtype, device=device)
    dk, dv = (torch.randn(rows, num_kv_heads, DECODE_LENGTH, head_dim, dtype=dtype, device=device) for _ in range(2))
    lengths = torch.randint(1, DECODE_LENGTH + 1, (rows,), device=device)
    mask = torch.zeros(rows, 1, 1, DECODE_LENGTH, dtype=dtype, device=device).masked_fill(
        torch.arange(DECODE_LENGTH, device=device) >= lengths[:, None, None, None], float("-inf"))

    def decode(call: int) -> torch.Tensor:  # a fixed shape: a captured step's
        return grouped_query_attention(dq, dk, dv, mask, None)

    timings = {"prefill": _time_backends(prefill), "decode": _time_backends(decode, captured=True)}
    chosen = {form: min((t, name) for name, t in times.items() if t is not None)[1] if any(
        t is not None for t in times.values()) else None for form, times in timings.items()}
    choice = AttentionBackends(chosen["prefill"], chosen["decode"], timings)
    log.info("attention (SDPA) backends, timed here and pinned: %s (us per call: %s)", choice.describe(), "; ".join(
        f"{form} " + ", ".join(f"{name} {'-' if t is None else f'{t:.0f}'}" for name, t in times.items())
        for form, times in timings.items()))
    return choice


def _time_backends(call: Callable[[int], torch.Tensor], captured: bool = False) -> dict[str, float | None]:
    """Microseconds per call of `call` under each backend alone, None where the backend does not take it or disagrees
    with the first that does. Eager: the mean of TIMED_CALLS calls, each given its index, after one untimed.
    `captured`: the mean of TIMED_REPLAYS replays of one call captured in a CUDA graph (a decode step's cost: no host
    work per call)."""
    reference, reference_name = None, ""
    times: dict[str, float | None] = {}
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PyTorch warns why a backend cannot take a call: its time says so
                out = call(0)  # loads what the backend loads: not timed
                torch.cuda.synchronize()
                seconds = _replayed_seconds(call) if captured else _called_seconds(call)
        except RuntimeError as error:  # "No available kernel": this backend does not take this form
            if "No available kernel" not in str(error):
                log.warning("attention %s could not be timed (%s): not used", name, str(error).splitlines()[0])
            times[name] = None
            continue
        if reference is None:
            reference, reference_name = out.float(), name
        elif not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            log.warning("SDPA backend %s disagrees with %s on a timed call: not used", name, reference_name)
            times[name] = None
            continue
        times[name] = seconds * 1e6
    return times


def _called_seconds(call: Callable[[int], torch.Tensor]) -> float:
    """Seconds per call of `call`, called TIMED_CALLS times, each given its index."""
    start = time.perf_counter()
    for index in range(1, TIMED_CALLS + 1):
        call(index)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / TIMED_CALLS


def _replayed_seconds(call: Callable[[int], torch.Tensor]) -> float:
    """Seconds per replay of one call of `call` captured in a CUDA graph, as the decode step's graphs are."""
    graph = captured(lambda: call(0), warm_runs=1)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / TIMED_REPLAYS
