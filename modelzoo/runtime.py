"""The front door: a checkpoint opened to run, for the job, the Python API (ZooModel) and the lm-eval backend alike.

A `RuntimeSpec` (plain values, modelzoo/runtime_spec.py) is checked into a `RuntimePlan` before anything loads or
is written (device, precision policy, decode-step mode, LoRA adapters read and checked); a `Runtime` is opened from
the plan: the model loaded in the policy's dtypes (this rank's share, int8 if asked), the rows in flight sized and
the KV cache checked against the memory, the GEMM path chosen for this machine, the drafter, the engine with its
decode step prepared, and the scorer.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from modelzoo.cpu.gemm import (GemmPlan, JobWork, apply_bf16_kernels, apply_gemm_backend, apply_half_kernels,
                               weight_bytes)
from modelzoo.cpu.int8_compute import apply_int8_backend
from modelzoo.cpu.kernels import cpu_kernels, kernel_build_dir, machine_dir
from modelzoo.cpu.memory import keep_freed_memory
from modelzoo.cpu.precision import PrecisionPolicy, apply_half_gemm, keep_gemm_weights, precision_policy
from modelzoo.cpu.quantization import int8_summary
from modelzoo.cuda.attention_backends import choose_attention_backends
from modelzoo.cuda.memory import available_memory, prefill_token_budget
from modelzoo.errors import UserError
from modelzoo.generation.engine import GenerationEngine, PromptSpan
from modelzoo.generation.options import GenerationOptions, RequestVariety
from modelzoo.generation.scoring import Scorer
from modelzoo.generation.step import smaller_steps
from modelzoo.generation.speculative import DraftModelDrafter, Drafter, PromptLookupDrafter
from modelzoo.generation.structured import StructuredRows, compile_formats
from modelzoo.models.checkpoint import load_hf_config, load_model, resolve_dtype
from modelzoo.models.kv_cache import KVCache
from modelzoo.models.lora import AdapterPlan, attach_adapters, plan_adapters
from modelzoo.models.tensor_parallel import TensorParallelGroup, shard_plan
from modelzoo.runtime_spec import RuntimeSpec
from modelzoo import weight_cache
from modelzoo.weight_cache import CachedLayout

log = logging.getLogger("zoo-infer")

# runconfig.rows_in_flight auto: at most this many rows generated together, their KV cache in at most this share
# of the memory left once the weights are loaded (decode steps stream every weight once for all their rows).
AUTO_ROWS_IN_FLIGHT = 256
# On a GPU a decode step's cost hardly grows with its rows until the KV cache's reads dominate, so auto
# takes as many rows as the memory holds, up to this many (thousands for a 1.1B model on 80 GB).
AUTO_ROWS_IN_FLIGHT_CUDA = 4096
KV_CACHE_SHARE = 0.5
# A weight layout at least this long is worth pointing the user to runconfig.weight_cache (a hint in the log).
CACHE_HINT_SECONDS = 2.0

# Rows of the scorer's own cache beside an engine that generates at the same time: continuations scored together at
# most.
SCORING_SLOTS = 32


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA when present, else CPU; `cuda` without a GPU is an error. Under torchrun each
    local rank takes its own GPU (LOCAL_RANK)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("runconfig.device is cuda but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device(name)


def decode_step_mode(spec: RuntimeSpec, device: torch.device, adapters: AdapterPlan | None) -> str:
    """runconfig.decode_step, checked against the job; auto: a CUDA graph on CUDA, eager on the CPU (its C++
    kernels and measured GEMMs run faster than the inductor-compiled step there: benchmarks/decode_step.py);
    eager under speculative decoding, whose verification step is a forward of its own, and with LoRA adapters per
    row (not captured in a CUDA graph yet), and under tensor parallel (its all-reduce is not captured)."""
    requested = spec.decode_step
    if adapters is not None and adapters.bank:
        if requested == "cuda_graph":
            raise UserError(f"runconfig.decode_step {requested} does not take LoRA adapters per row yet; use auto, "
                            f"eager or compiled (or one adapter for the whole job, model.adapter, merged into the "
                            f"weights)")
        if requested == "auto":
            return "eager"
    if spec.speculative:
        if requested in ("compiled", "cuda_graph"):
            raise UserError(f"runconfig.decode_step {requested} does not apply to speculative decoding, whose "
                            f"steps verify drafted tokens; use auto or eager")
        return "eager"
    if requested == "cuda_graph" and device.type != "cuda":
        raise UserError(f"runconfig.decode_step cuda_graph needs a CUDA device; this job runs on {device}")
    if requested == "compiled" and device.type == "cpu":
        if spec.weight_dtype == "int8":
            raise UserError("runconfig.decode_step compiled does not take int8 weights on the CPU (their C++ "
                            "kernels cannot be compiled); use auto or eager")
        if spec.gemm_backend not in ("auto", "torch"):
            raise UserError(f"runconfig.decode_step compiled multiplies with torch's own GEMMs; gemm_backend "
                            f"{spec.gemm_backend} cannot be compiled (use auto or torch)")
    if requested == "auto":
        return "cuda_graph" if device.type == "cuda" and spec.tensor_parallel == 1 else "eager"
    return requested


@dataclass(frozen=True)
class RuntimePlan:
    """A RuntimeSpec checked before anything loads or is written: the device, the checkpoint's vocabulary, the
    precision policy (modelzoo/cpu/precision.py), the decode-step mode and the LoRA adapters (read and checked
    against the checkpoint; None: the bare base). Threads are set as the spec says."""

    spec: RuntimeSpec
    device: torch.device
    vocab_size: int
    policy: PrecisionPolicy
    decode_step_mode: str
    adapters: AdapterPlan | None

    @classmethod
    def of(cls, spec: RuntimeSpec) -> RuntimePlan:
        device = resolve_device(spec.device)
        torch.set_num_threads(spec.num_threads or len(os.sched_getaffinity(0)))
        hf_config = load_hf_config(spec.checkpoint)
        row_adapters = list(spec.row_adapters) if spec.row_adapters is not None else None
        adapters = plan_adapters(spec.adapters, spec.adapter, row_adapters, spec.checkpoint)
        mode = decode_step_mode(spec, device, adapters)
        policy = precision_policy(resolve_dtype(spec.dtype, hf_config), device, int8_weights=spec.weight_dtype == "int8",
                                  compiled=mode == "compiled")
        if mode in ("compiled", "cuda_graph"):
            # Inductor's compiled code beside the C++ kernels' builds (unless TORCHINDUCTOR_CACHE_DIR says where), so
            # the next job on this machine type reuses it; set before torch first asks for it (importing dynamo does).
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(machine_dir() / "inductor"))
        return cls(spec, device, int(hf_config.vocab_size), policy, mode, adapters)


class Runtime:
    """A checkpoint opened to run (module docstring): `model`, `engine`, `scorer()`, and how they were sized and
    set up (`rows_in_flight`, `gemm`, `decode_step`, `dtype_name()`).

    defaults: the options of a request without its own; variety: what the requests may bring besides them;
    rows_to_do: the rows to generate (auto rows in flight take at most these); response_formats: every response
    format some row follows, compiled before the model loads; tp: this rank's tensor-parallel group; prompts: the
    rows' prompt lengths and most tokens, where known (a captured decode step then captures every length bucket the
    rows reach before generating).
    """

    def __init__(self, plan: RuntimePlan, defaults: GenerationOptions = GenerationOptions(),
                 variety: RequestVariety = RequestVariety(), rows_to_do: int = 0, response_formats: Sequence[str] = (),
                 tp: TensorParallelGroup | None = None, prompts: PromptSpan | None = None) -> None:
        spec = self.spec = plan.spec
        self.plan, self.device, self.policy, self.adapters = plan, plan.device, plan.policy, plan.adapters
        self.dtype = self.policy.activations  # the arithmetic's dtype between the GEMMs
        self.kv_dtype = self.policy.kv_cache
        self.max_seq_len, self.vocab_size = spec.max_seq_len, plan.vocab_size
        self.decode_step: dict[str, object] | None = None  # how the decode step ran: summary.json's
        tp = tp or TensorParallelGroup(device=self.device)
        if spec.speculative and variety.samples:
            raise UserError("some rows of the data sample (their own temperature > 0) but model.speculative decodes "
                            "greedily; drop model.speculative or the rows' temperatures")
        if response_formats and spec.speculative:
            raise UserError("some rows follow a response format (model.json_schema or the data's response_format) but "
                            "model.speculative cannot constrain its drafts; drop model.speculative")
        self.compiler = (compile_formats(spec.checkpoint, self.vocab_size, defaults.stop_sequences, list(response_formats))
                         if response_formats else None)
        started = time.perf_counter()
        cache_key = self._weight_cache_key(tp)
        cached = weight_cache.load(Path(spec.weight_cache), cache_key) if cache_key else None
        self.model = cached.model if cached else self._load_model(tp)
        loaded = time.perf_counter()
        free = available_memory(self.device)
        self.rows_in_flight = self._rows_in_flight(rows_to_do, free, tp)
        self.rows_to_do, self.prompts = rows_to_do, prompts
        self._check_memory(free, tp)
        if self.adapters is not None and self.adapters.bank:
            attach_adapters(self.model, self.adapters.bank, self.adapters.projections, self.dtype, self.device,
                            shard_plan(spec.checkpoint, tp))
            log.info("LoRA adapters per row: %s (each row's update added to the base projections' output)",
                     ", ".join(f"{a.name} ({len(a.updates)} projections)" for a in self.adapters.bank))
        self.gemm: GemmPlan | None = None
        cache = self.kv_cache_bytes(self.rows_in_flight)
        if cached:
            self.gemm = cached.gemm
            log.info("GEMMs as the weight cache laid them out: %s", ", ".join(f"{key} {kernel}" for key, kernel
                                                                            in self.gemm.layers.items()))
        else:
            self._choose_gemm(spare_bytes=(free - cache) // 2, cached_layout=bool(cache_key))
            if cache_key:
                weight_cache.save(Path(spec.weight_cache), cache_key, CachedLayout(self.model, self.gemm))
        self.step_rows = self._smaller_steps()  # row counts of smaller decode steps
        laid_out = time.perf_counter()
        if self.device.type == "cpu":
            kept = keep_freed_memory()
            if kept:
                log.info("host memory while generating: %s", kept)
        self.drafter = self._drafter()
        self.engine = self._build_engine(defaults, variety)
        self._scoring_cache: KVCache | None = None
        # Where the set-up's seconds went, for the log and summary.json.
        self.setup_parts = {"load": round(loaded - started, 3), "gemm_layout": round(laid_out - loaded, 3),
                            "kv_cache_and_decode_step": round(time.perf_counter() - laid_out, 3)}
        log.info("set-up parts: load %.1fs, GEMM choice and weight layout %.1fs, KV cache and decode step %.1fs",
                 *self.setup_parts.values())
        if (not spec.weight_cache and self.setup_parts["gemm_layout"] >= CACHE_HINT_SECONDS
                and self._why_no_weight_cache(tp) is None and weight_cache.unsaveable(self.model) is None):
            log.info("the weight layout took %.1fs: with runconfig.weight_cache: FOLDER, later jobs of this checkpoint "
                     "map the laid-out model instead (docs/performance.md, 'Start-up of large models')",
                     self.setup_parts["gemm_layout"])

    def dtype_name(self) -> str:
        """The precision policy in words (modelzoo/cpu/precision.py)."""
        return self.policy.describe()

    def engine_for(self, options: Sequence[GenerationOptions]) -> GenerationEngine:
        """The engine to run requests with these options: the current one where it takes them all (per-row options:
        modelzoo/generation/options.py), else the same one taking them (eager decode step: `GenerationEngine.adopt`)
        or a new one over the same model and cache size (the old one's memory freed first), with the stop sequences
        and sampling the old one took besides."""
        if all(self.engine.accepts(o) for o in options):
            return self.engine
        first = options[0]
        defaults = first.overridden(logprobs=any(o.logprobs for o in options),
                                    top_logprobs=max(o.top_logprobs for o in options))
        variety = self.engine.variety.union(RequestVariety.covering(options))
        if self.engine.decode.mode == "eager":
            self.engine.adopt(defaults, variety)
            return self.engine
        self.engine = None
        self.engine = self._build_engine(defaults, variety)
        return self.engine

    def scorer(self, beside_generation: bool = False) -> Scorer:
        """The scorer (teacher-forced log-probabilities, with the spec's scoring_top_k likeliest tokens): in the
        engine's KV cache, between generations; `beside_generation` (a job whose data mixes rows to generate and to
        score, scored while other rows generate): in a cache of its own of at most SCORING_SLOTS rows."""
        cache = self.engine.cache
        if beside_generation:
            if self._scoring_cache is None:
                c = self.model.config
                self._scoring_cache = KVCache(c.num_layers, min(self.rows_in_flight, SCORING_SLOTS), c.num_kv_heads,
                                              self.max_seq_len, c.head_dim, self.kv_dtype, self.device)
            cache = self._scoring_cache
        return Scorer(self.model, cache, self.device, top_k=self.spec.scoring_top_k)

    def kv_cache_bytes(self, rows: int) -> int:
        """The KV cache of `rows` rows x max_seq_len."""
        c = self.model.config
        return KVCache.nbytes(c.num_layers, rows, c.num_kv_heads, self.max_seq_len, c.head_dim, self.kv_dtype)

    def _load_model(self, tp: TensorParallelGroup) -> torch.nn.Module:
        """The model, the job's merged adapter in its weights, logged with its load time (and int8's savings)."""
        spec = self.spec
        load_start = time.perf_counter()
        merged = self.adapters.merged if self.adapters is not None else None
        model = self.load(spec.checkpoint, tp, spec.weight_dtype,
                          self.adapters.merge_update() if merged is not None else None)
        if merged is not None:
            log.info("LoRA adapter %r (%s, %d projections) merged into the weights", merged.name, merged.folder,
                     len(merged.updates))
        log.info("loaded %s (%s, %s%s) on %s in %.1fs", spec.checkpoint, type(model).__name__, self.dtype_name(),
                 f", {spec.weight_dtype} weights" if spec.weight_dtype else "", self.device,
                 time.perf_counter() - load_start)
        if spec.weight_dtype == "int8":
            q = int8_summary(model, self.dtype)
            group = spec.int8_group_size
            log.info("int8 weights: %d linear layers and %d token embedding quantized %s: %.1f MiB instead of %.1f MiB "
                     "in %s, %.1f MiB saved", q.linear_layers, q.embeddings,
                     f"in groups of {group} inputs" if group else "per output channel", q.int8_bytes / 2**20,
                     q.full_bytes / 2**20, str(self.dtype).replace("torch.", ""), q.saved_bytes / 2**20)
        return model

    def _check_memory(self, free: int, tp: TensorParallelGroup) -> None:
        """Logs the weights and KV cache against the free memory; one error line where the cache does not fit."""
        weights, cache = weight_bytes(self.model), self.kv_cache_bytes(self.rows_in_flight)
        weight_dtype = self.spec.weight_dtype
        log.info("memory: weights %.2f GiB%s + KV cache %.2f GiB (%d rows in flight x max_seq_len %d); %.2f GiB "
                 "available", weights / 2**30, f" ({weight_dtype})" if weight_dtype else "", cache / 2**30,
                 self.rows_in_flight, self.max_seq_len, free / 2**30)
        if tp.size > 1:
            c, n = self.model.config, tp.size  # the config of one rank's share
            log.info("tensor parallel %d: each rank holds %d of %d query heads, %d of %d kv heads, %d of %d MLP columns "
                     "and 1/%d of the vocabulary rows: this rank %.1f MiB of weights, %.1f MiB of KV cache", n,
                     c.num_heads, c.num_heads * n, c.num_kv_heads, c.num_kv_heads * n, c.intermediate_size,
                     c.intermediate_size * n, n, weights / 2**20, cache / 2**20)
        if cache > free:
            raise UserError(f"the KV cache needs {cache / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is available on "
                            f"{self.device}; lower runconfig.rows_in_flight (or inference_input.batch_size) or the "
                            f"data's max_seq_len")

    def _build_engine(self, defaults: GenerationOptions, variety: RequestVariety) -> GenerationEngine:
        """An engine over the model: its KV cache of the rows in flight, its decode step compiled or captured and
        warmed up as the decode-step mode says."""
        c = self.model.config
        attention = choose_attention_backends(c.num_heads, c.num_kv_heads, c.head_dim, self.kv_dtype, self.device,
                                              self.rows_in_flight)
        structured = (None if self.compiler is None else
                      StructuredRows(self.compiler, self.rows_in_flight, c.vocab_size, self.device))
        engine = GenerationEngine(self.model, self.rows_in_flight, self.max_seq_len, self.device, self.kv_dtype,
                                  defaults, variety, drafter=self.drafter, step_rows=self.step_rows,
                                  structured=structured, prefill_token_budget=prefill_token_budget(c, self.dtype, self.device),
                                  attention=attention)
        self._prepare_decode_step(engine)
        return engine

    def _prepare_decode_step(self, engine: GenerationEngine) -> None:
        """Compiles or captures the decode step as runconfig.decode_step says, and warms it up (`engine.warm_up`: the
        shapes it can take, kernel builds, GEMM primitives, compilation and capture), all before the generation clock
        starts; logged and kept for summary.json."""
        mode = self.plan.decode_step_mode
        shapes = engine.step_shapes()
        if mode == "compiled":
            engine.decode.compile(len(shapes))
        elif mode == "cuda_graph":
            engine.decode.capture(len(shapes))
        seconds = engine.warm_up(self.prompts, self.rows_to_do)
        lengths = sorted({length for _, length in shapes})
        rows = sorted({self.rows_in_flight if slots is None else len(slots) for slots, _ in shapes}, reverse=True)
        with torch.inference_mode():
            attention = engine.model.decode_attention(engine.cache, compiled=mode != "eager")
        captured = ("; captured so far: " + ", ".join(str(length) for _, length in engine.decode.captured_shapes)
                    + " (the other buckets when a step first reaches them)") if mode == "cuda_graph" else ""
        warmed = f"warmed up in {seconds:.1f}s" if engine.warm_up_shapes(self.prompts, self.rows_to_do) else "no warm-up"
        tiles = (f" (tiles of 4-6 query heads score {cpu_kernels().attention_keys_at_once()} keys at once, the faster "
                 "here as timed)" if attention == "cpu_kernel" else "")
        log.info("decode step: %s, attention %s%s, rows %s, cache length buckets %s; %s%s", mode, attention, tiles,
                 "/".join(map(str, rows)), lengths, warmed, captured)
        self.decode_step = {"mode": mode, "attention": attention, "rows": rows, "length_buckets": lengths,
                            "warm_up_seconds": round(seconds, 3),
                            "sdpa_backends": {"prefill": engine.attention.prefill, "decode": engine.attention.decode}}

    def _rows_in_flight(self, rows_to_do: int, free: int, tp: TensorParallelGroup) -> int:
        """The spec's rows_in_flight, or for auto: every row to do up to AUTO_ROWS_IN_FLIGHT (on CUDA
        AUTO_ROWS_IN_FLIGHT_CUDA), as many as KV_CACHE_SHARE of the `free` bytes hold, never fewer than min_rows (a
        job's batch_size; the ranks of a tensor-parallel group, which must agree, and speculative decoding, whose
        steps are worth it only where few rows share a step, keep it). Logged with the reason."""
        requested, batch_size = self.spec.rows_in_flight, self.spec.min_rows
        if requested != "auto":
            log.info("rows in flight: %d (runconfig.rows_in_flight)", requested)
            return requested
        if tp.size > 1 or self.spec.speculative:
            log.info("rows in flight: %d (auto under %s: batch_size)", batch_size,
                     "tensor parallel" if tp.size > 1 else "speculative decoding")
            return batch_size
        per_row = self.kv_cache_bytes(rows=1)
        fit = int(free * KV_CACHE_SHARE) // per_row
        cap = AUTO_ROWS_IN_FLIGHT_CUDA if self.device.type == "cuda" else AUTO_ROWS_IN_FLIGHT
        rows = max(batch_size, min(rows_to_do, cap, fit))
        log.info("rows in flight: %d (auto: %d rows to do, at most %d, KV cache within %.0f%% of the free memory: "
                 "%d rows; at least batch_size %d)", rows, rows_to_do, cap, KV_CACHE_SHARE * 100,
                 fit, batch_size)
        return rows

    def load(self, checkpoint: str, tensor_parallel: TensorParallelGroup | None = None,
             weight_dtype: str | None = None, update: Callable[[str], torch.Tensor | None] | None = None,
             ) -> torch.nn.Module:
        """A checkpoint's model (this rank's share of it under tensor parallel), in the precision policy's dtypes.

        Weights load in the policy's weight dtype; where the arithmetic is float32, the linear layers' and
        embeddings' weights keep theirs under bf16_gemm or half_gemm (everything else becomes float32), or all become
        float32 (their half-precision values kept) where neither kernel is built. int8 weights are quantized from the
        checkpoint's values, and their small companions (norms, biases, scales) load straight in the arithmetic
        dtype. A draft model is whole on every rank.
        """
        policy = self.policy
        mixed = policy.weights != policy.activations and not weight_dtype
        model, _ = load_model(checkpoint, policy.weights if mixed else self.dtype, self.device,
                              shard_plan(checkpoint, tensor_parallel), weight_dtype, self.spec.int8_group_size,
                              update, keep_parts=mixed and policy.packed_gemm)
        if mixed and policy.packed_gemm:
            keep_gemm_weights(model, policy.activations)
        elif mixed:
            name = str(policy.weights).replace("torch.", "")
            log.info("this CPU has no native %s matrix multiplies: weights keep their %s values, arithmetic and "
                     "KV cache are float32 (faster here; see modelzoo/cpu/precision.py)", name, name)
            model = model.to(self.dtype)
        return model

    def _why_no_weight_cache(self, tp: TensorParallelGroup) -> str | None:
        """Why this job could not use a weight cache (modelzoo/weight_cache.py), set or not; None where it could."""
        return ("it caches CPU layouts" if self.device.type != "cpu" else
                "its layouts are the C++ kernels', not built here" if cpu_kernels() is None else
                "tensor parallel ranks load their own shares" if tp.size > 1 else
                "LoRA adapters change the weights per job" if self.adapters is not None else
                "a compiled decode step lays out no weights" if self.plan.decode_step_mode == "compiled" else None)

    def _weight_cache_key(self, tp: TensorParallelGroup) -> str | None:
        """The weight cache's key for this model (modelzoo/weight_cache.py), or None where runconfig.weight_cache is
        not set or does not apply (logged why)."""
        spec = self.spec
        if not spec.weight_cache:
            return None
        why_not = self._why_no_weight_cache(tp)
        if why_not:
            log.info("weight cache: not used (%s)", why_not)
            return None
        options = {"policy": self.policy.describe(), "dtype": spec.dtype, "weight_dtype": spec.weight_dtype,
                   "int8_group_size": spec.int8_group_size, "gemm_backend": spec.gemm_backend,
                   "int8_backend": spec.int8_backend}
        return weight_cache.cache_key(spec.checkpoint, options, kernel_build_dir().name + "@" + machine_dir().name)

    def _job_work(self) -> JobWork | None:
        """The most GEMM work of the job's rows to do (None where unknown: a model kept for the API or lm-eval)."""
        if not self.rows_to_do:
            return None
        prompts = self.prompts
        new_tokens = (prompts.most_tokens if prompts and prompts.most_tokens is not None
                      else self.max_seq_len - (prompts.shortest if prompts else 1))
        return JobWork(decode_steps=-(-self.rows_to_do // self.rows_in_flight) * new_tokens,
                       prompt_tokens=prompts.total if prompts else self.rows_to_do * self.max_seq_len,
                       prompts=self.rows_to_do)

    def _choose_gemm(self, spare_bytes: int, cached_layout: bool = False) -> None:
        """Puts every float linear layer in the layout of the GEMM backend chosen for it (runconfig.gemm_backend;
        MKL's second copy of the weights only within `spare_bytes`), and every int8 one in its backend's
        (int8_backend); `self.gemm` says what was chosen. cached_layout: the layout goes to the weight cache (every
        16-bit weight packed, whatever this job's size)."""
        model, weight_dtype, spec = self.model, self.spec.weight_dtype, self.spec.speculative
        rows = self.rows_in_flight
        # Compiled, torch's own GEMMs: the re-laid-out weights of the other backends cannot be traced.
        backend = "torch" if self.plan.decode_step_mode == "compiled" else self.spec.gemm_backend
        if self.policy.bf16_gemm:
            if backend != "auto":
                log.warning("runconfig.gemm_backend %s ignored: bfloat16 multiplies with bf16_linear or amx_bf16_linear "
                            "here, as measured (float32 outputs; see modelzoo/cpu/precision.py)", backend)
            self.gemm = apply_bf16_kernels(model, backend, rows * (1 + (spec.num_tokens if spec else 0)),
                                           None if cached_layout else self._job_work())
            return
        if self.policy.half_gemm:
            if backend != "auto":
                log.warning("runconfig.gemm_backend %s ignored: %s weights multiply with half_linear here (widened to "
                            "float32; see modelzoo/cpu/precision.py)", backend, str(self.policy.weights)[6:])
            log.info("GEMMs: half_linear (%s weights widened to float32 as read, float32 inputs, sums and outputs; "
                     "%s code path, the faster here as timed)", str(self.policy.weights)[6:],
                     cpu_kernels().half_gemm_path())
            self.gemm = apply_half_kernels(model, rows * (1 + (spec.num_tokens if spec else 0)),
                                           None if cached_layout else self._job_work())
            return
        self.gemm = apply_gemm_backend(model, self.dtype, self.device, backend,
                                       decode_rows=rows * (1 + (spec.num_tokens if spec else 0)),
                                       spare_bytes=spare_bytes)
        if weight_dtype == "int8":
            self.gemm.add(apply_int8_backend(model, self.dtype, self.device, self.spec.int8_backend))

    def _smaller_steps(self) -> tuple[int, ...]:
        """The row counts of smaller decode steps (`smaller_steps`), or () to keep every step full.

        Every decode forward has one row per row in flight (times K + 1 when verifying K drafted tokens); with
        fewer rows in flight, steps run fewer rows, which keeps each row's bits only where every chosen backend is
        batch-invariant (bf16_linear, amx_bf16_linear and half_linear are).
        """
        if self.spec.speculative:
            return ()
        if self.policy.bf16_gemm or self.policy.half_gemm:
            return smaller_steps(self.rows_in_flight)
        if self.device.type != "cpu" or self.plan.decode_step_mode == "compiled":
            return ()  # compiled: another shape is another graph, whose fusions may round a row otherwise
        return smaller_steps(self.rows_in_flight) if self.gemm.batch_invariant else ()

    def _drafter(self) -> Drafter | None:
        """The speculative-decoding drafter of `model.speculative`, if any (loads the draft model)."""
        spec = self.spec.speculative
        if spec is None:
            return None
        if spec.method == "prompt_lookup":
            log.info("speculative decoding: prompt lookup, %d tokens per step, n-grams up to %d", spec.num_tokens,
                     spec.max_ngram)
            return PromptLookupDrafter(spec.num_tokens, spec.max_ngram)
        draft = self.load(spec.checkpoint_path)
        if self.policy.bf16_gemm:
            apply_bf16_kernels(draft)
        elif self.policy.half_gemm:
            apply_half_gemm(draft)
        if draft.config.vocab_size != self.vocab_size:
            log.warning("the draft model's vocabulary has %d entries, the model's %d: fine if they share a tokenizer "
                        "and differ only in padding, useless otherwise", draft.config.vocab_size, self.vocab_size)
        log.info("speculative decoding: draft model %s (%s), %d tokens per step", spec.checkpoint_path,
                 type(draft).__name__, spec.num_tokens)
        return DraftModelDrafter(draft, spec.num_tokens, self.rows_in_flight, self.max_seq_len,
                                 self.vocab_size, self.kv_dtype, self.device)
