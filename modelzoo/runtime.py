"""A job's model, made ready to generate: device, dtypes, loading (this rank's share, int8 if asked),
the memory check, the GEMM path, the drafter, and the engine over them."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from modelzoo.models.checkpoint import load_model
from modelzoo.errors import UserError
from modelzoo.cpu.gemm import GemmPlan, apply_gemm_backend, weight_bytes
from modelzoo.cuda.attention_backends import choose_attention_backends
from modelzoo.generation.engine import GenerationEngine
from modelzoo.models.kv_cache import KVCache
from modelzoo.generation.options import GenerationOptions, RequestVariety
from modelzoo.generation.speculative import DraftModelDrafter, Drafter, PromptLookupDrafter
from modelzoo.generation.structured import FormatCompiler, FormatError, StructuredRows
from modelzoo.cpu.int8_compute import apply_int8_backend
from modelzoo.cpu.kernels import cpu_kernels, machine_dir
from modelzoo.models.lora import AdapterPlan, attach_adapters
from modelzoo.cpu.memory import available_host_memory
from modelzoo.job.params import InferenceParams
from modelzoo.cpu.precision import apply_bf16_gemm, apply_half_gemm, keep_gemm_weights, precision_policy
from modelzoo.cpu.quantization import int8_summary
from modelzoo.models.tensor_parallel import TensorParallelGroup, shard_plan

log = logging.getLogger("zoo-infer")

# runconfig.rows_in_flight auto: at most this many rows generated together, their KV cache in at most
# this share of the memory left once the weights are loaded. Decode steps stream every weight once for
# all their rows: on AMD EPYC Zen 4 (2 vCPU, float32 SmolLM2) 32 rows ran the decode GEMMs at 100-135
# GFLOP/s (memory-bound), 164 rows at 185-200, and the 164-prompt workload 1.27x faster.
AUTO_ROWS_IN_FLIGHT = 256
# On a GPU a decode step's cost hardly grows with its rows until the KV cache's reads dominate, so auto
# takes as many rows as the memory holds, up to this many (thousands for a 1.1B model on 80 GB).
AUTO_ROWS_IN_FLIGHT_CUDA = 4096
KV_CACHE_SHARE = 0.5

# Rows of a decode step once few are left active (CPU). Measured on SmolLM2-135M, 2 cores (Ice Lake):
# a step of 8 rows takes 61-79 ms, one of 32 rows 108-138 ms.
SMALL_STEP_ROWS = 8

# Tokens of one prefill forward: the CPU's packed prompts (its attention kernel is fastest on groups about this
# size); on a GPU, padded rows up to this many tokens, within PREFILL_MEMORY_SHARE of the free memory.
PREFILL_TOKENS_CPU = 1024
PREFILL_TOKENS_CUDA = 16384
PREFILL_MEMORY_SHARE = 0.25


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


def available_memory(device: torch.device) -> int:
    """Bytes free on the device (CPU: the host's, cgroup limits included)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


class ModelSetup:
    """Loads a job's model and builds its engine; `gemm` is the GEMM plan once chosen."""

    def __init__(self, params: InferenceParams, device: torch.device, dtype: torch.dtype, max_seq_len: int,
                 vocab_size: int, adapters: AdapterPlan | None = None) -> None:
        self.params = params
        self.adapters = adapters  # the job's LoRA adapters: merged at load, or attached per row
        self.device = device
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.gemm: GemmPlan | None = None
        self.small_step_rows: int | None = None  # rows of a job's last decode steps, once the GEMMs are chosen
        self.rows_in_flight = params.inference_input.batch_size  # sized by build()
        self.decode_step_mode = self._decode_step_mode()  # checked before anything is loaded or written
        self.policy = precision_policy(dtype, device, int8_weights=params.model.weight_dtype == "int8",
                                       compiled=self.decode_step_mode == "compiled")
        self.dtype = self.policy.activations  # the arithmetic's dtype between the GEMMs
        self.kv_dtype = self.policy.kv_cache
        if self.decode_step_mode in ("compiled", "cuda_graph"):
            # Inductor's compiled code beside the C++ kernels' builds (unless TORCHINDUCTOR_CACHE_DIR says where), so
            # the next job on this machine type reuses it; set before torch first asks for it (importing dynamo does).
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(machine_dir() / "inductor"))
        self.decode_step: dict[str, object] | None = None  # how the decode step ran: summary.json's, once built

    def dtype_name(self) -> str:
        """The precision policy in words (modelzoo/cpu/precision.py)."""
        return self.policy.describe()

    def build(self, tp: TensorParallelGroup, variety: RequestVariety = RequestVariety(), rows_to_do: int = 0,
              response_formats: list[str] = ()) -> tuple[torch.nn.Module, GenerationEngine]:
        """Loads the model (and drafter), sizes the rows in flight, checks the KV cache fits, chooses the GEMM
        path, builds the engine (variety: what the data's rows bring besides the job's options; rows_to_do: the
        real rows this run will generate; response_formats: every response format some row follows, compiled
        before the model loads)."""
        if self.params.model.speculative and variety.samples:
            raise UserError("some rows of the data sample (their own temperature > 0) but model.speculative decodes "
                            "greedily; drop model.speculative or the rows' temperatures")
        compiler = self._format_compiler(response_formats) if response_formats else None
        load_start = time.perf_counter()
        weight_dtype = self.params.model.weight_dtype
        merged = self.adapters.merged if self.adapters is not None else None
        model = self.load(self.params.model.checkpoint_path, tp, weight_dtype,
                          self.adapters.merge_update() if merged is not None else None)
        if merged is not None:
            log.info("LoRA adapter %r (%s, %d projections) merged into the weights", merged.name, merged.folder,
                     len(merged.updates))
        log.info("loaded %s (%s, %s%s) on %s in %.1fs", self.params.model.checkpoint_path, type(model).__name__,
                 self.dtype_name(), f", {weight_dtype} weights" if weight_dtype else "", self.device,
                 time.perf_counter() - load_start)
        if weight_dtype == "int8":
            q = int8_summary(model, self.dtype)
            group = self.params.model.int8_group_size
            log.info("int8 weights: %d linear layers and %d token embedding quantized %s: %.1f MiB instead of %.1f MiB "
                     "in %s, %.1f MiB saved", q.linear_layers, q.embeddings,
                     f"in groups of {group} inputs" if group else "per output channel", q.int8_bytes / 2**20,
                     q.full_bytes / 2**20, str(self.dtype).replace("torch.", ""), q.saved_bytes / 2**20)
        free = available_memory(self.device)
        self.rows_in_flight = self._rows_in_flight(model, rows_to_do, free, tp)
        weights, cache = self.memory_estimate(model)
        log.info("memory: weights %.2f GiB%s + KV cache %.2f GiB (%d rows in flight x max_seq_len %d); %.2f GiB "
                 "available", weights / 2**30, f" ({weight_dtype})" if weight_dtype else "", cache / 2**30,
                 self.rows_in_flight, self.max_seq_len, free / 2**30)
        if tp.size > 1:
            c, n = model.config, tp.size  # the config of one rank's share
            log.info("tensor parallel %d: each rank holds %d of %d query heads, %d of %d kv heads, %d of %d MLP columns "
                     "and 1/%d of the vocabulary rows: this rank %.1f MiB of weights, %.1f MiB of KV cache", n,
                     c.num_heads, c.num_heads * n, c.num_kv_heads, c.num_kv_heads * n, c.intermediate_size,
                     c.intermediate_size * n, n, weights / 2**20, cache / 2**20)
        if cache > free:
            raise UserError(f"the KV cache needs {cache / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is available on "
                            f"{self.device}; lower runconfig.rows_in_flight (or inference_input.batch_size) or the "
                            f"data's max_seq_len")
        if self.adapters is not None and self.adapters.bank:
            attach_adapters(model, self.adapters.bank, self.adapters.projections, self.dtype, self.device,
                            shard_plan(self.params.model.checkpoint_path, tp))
            log.info("LoRA adapters per row: %s (each row's update added to the base projections' output)",
                     ", ".join(f"{a.name} ({len(a.updates)} projections)" for a in self.adapters.bank))
        self.small_step_rows = self._choose_gemm(model, weight_dtype, spare_bytes=(free - cache) // 2)
        engine = self.engine(model, self.params.model.generation_defaults(), variety, compiler, self._drafter())
        return model, engine

    def engine(self, model: torch.nn.Module, defaults: GenerationOptions, variety: RequestVariety = RequestVariety(),
               compiler: FormatCompiler | None = None, drafter: Drafter | None = None) -> GenerationEngine:
        """An engine over the built model (`build` first): its KV cache of the rows in flight, its decode step
        compiled or captured and warmed up as runconfig.decode_step says."""
        c = model.config
        attention = choose_attention_backends(c.num_heads, c.num_kv_heads, c.head_dim, self.kv_dtype, self.device,
                                              self.rows_in_flight)
        engine = GenerationEngine(model, self.rows_in_flight, self.max_seq_len, self.device, self.kv_dtype, defaults,
                                  variety, drafter=drafter, small_step_rows=self.small_step_rows,
                                  structured=None if compiler is None else StructuredRows(
                                      compiler, self.rows_in_flight, model.config.vocab_size, self.device),
                                  prefill_token_budget=self.prefill_token_budget(model), attention=attention)
        self._prepare_decode_step(engine)
        return engine

    def prefill_token_budget(self, model: torch.nn.Module) -> int:
        """Tokens one prefill forward runs at most (padding included where prompts are padded): on the CPU
        PREFILL_TOKENS_CPU; on a GPU as many as PREFILL_MEMORY_SHARE of the memory left free holds (each token's
        activations within a layer, at most PREFILL_TOKENS_CUDA)."""
        if self.device.type != "cuda":
            return PREFILL_TOKENS_CPU
        c = model.config
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = element * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                               + 3 * c.intermediate_size)
        free = available_memory(self.device)
        budget = int(min(PREFILL_TOKENS_CUDA, free * PREFILL_MEMORY_SHARE // per_token))
        log.info("prefill: prompts right-padded in groups of up to %d tokens (%.2f GiB of activations at most)", budget,
                 budget * per_token / 2**30)
        return max(budget, 1)

    def _format_compiler(self, formats: list[str]) -> FormatCompiler:
        """The grammar compiler of the checkpoint's tokenizer, with every response format compiled (one error line for
        the first that cannot be, or for a job that cannot end a row once its document is complete)."""
        model = self.params.model
        if model.speculative:
            raise UserError("some rows follow a response format (model.json_schema or the data's response_format) but "
                            "model.speculative cannot constrain its drafts; drop model.speculative")
        stop_ids = [seq[0] for seq in model.stop_sequences if len(seq) == 1]
        if not stop_ids:
            raise UserError("rows that follow a response format need a one-token stop sequence (the EOS, e.g. "
                            "model.stop_sequences: [[2]]) to end once their JSON is complete")
        start = time.perf_counter()
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model.checkpoint_path)
        except (OSError, ValueError) as error:
            raise UserError(f"rows that follow a response format need the checkpoint's tokenizer, which "
                            f"{model.checkpoint_path} lacks ({str(error).splitlines()[0][:120]})") from None
        try:
            compiler = FormatCompiler(tokenizer, self.vocab_size, stop_ids)
        except FormatError as error:
            raise UserError(str(error)) from None
        for text in formats:
            try:
                compiler.compile(text)
            except FormatError as error:
                raise UserError(f"response format {text[:120]}: {error}") from None
        log.info("structured output: %d response format(s) compiled in %.1fs (xgrammar); a row's document ends on "
                 "stop token(s) %s", len(formats), time.perf_counter() - start, stop_ids)
        return compiler

    def _decode_step_mode(self) -> str:
        """runconfig.decode_step, checked against the job; auto: a CUDA graph on CUDA, eager on the CPU (its C++
        kernels and measured GEMMs run faster than the inductor-compiled step there: benchmarks/decode_step.py);
        eager under speculative decoding, whose verification step is a forward of its own, and with LoRA adapters per
        row (not captured in a CUDA graph yet), and under tensor parallel (its all-reduce is not captured)."""
        requested = self.params.runconfig.decode_step
        if self.adapters is not None and self.adapters.bank:
            if requested == "cuda_graph":
                raise UserError(f"runconfig.decode_step {requested} does not take LoRA adapters per row yet; use auto, "
                                f"eager or compiled (or one adapter for the whole job, model.adapter, merged into the "
                                f"weights)")
            if requested == "auto":
                return "eager"
        if self.params.model.speculative:
            if requested in ("compiled", "cuda_graph"):
                raise UserError(f"runconfig.decode_step {requested} does not apply to speculative decoding, whose "
                                f"steps verify drafted tokens; use auto or eager")
            return "eager"
        if requested == "cuda_graph" and self.device.type != "cuda":
            raise UserError(f"runconfig.decode_step cuda_graph needs a CUDA device; this job runs on {self.device}")
        if requested == "compiled" and self.device.type == "cpu":
            if self.params.model.weight_dtype == "int8":
                raise UserError("runconfig.decode_step compiled does not take int8 weights on the CPU (their C++ "
                                "kernels cannot be compiled); use auto or eager")
            if self.params.runconfig.gemm_backend not in ("auto", "torch"):
                raise UserError(f"runconfig.decode_step compiled multiplies with torch's own GEMMs; gemm_backend "
                                f"{self.params.runconfig.gemm_backend} cannot be compiled (use auto or torch)")
        if requested == "auto":
            return "cuda_graph" if self.device.type == "cuda" and self.params.runconfig.tensor_parallel == 1 else "eager"
        return requested

    def _prepare_decode_step(self, engine: GenerationEngine) -> None:
        """Compiles or captures the decode step as runconfig.decode_step says, and runs it once per shape it can
        take, all before the generation clock starts (kernel builds and GEMM primitives included); logged and kept
        for summary.json."""
        mode = self.decode_step_mode
        shapes = engine.step_shapes()
        if mode == "compiled":
            engine.decode.compile(len(shapes))
        elif mode == "cuda_graph":
            engine.decode.capture(len(shapes))
        seconds = engine.warm_up()
        lengths = sorted({length for _, length in shapes})
        rows = sorted({self.rows_in_flight if slots is None else len(slots) for slots, _ in shapes}, reverse=True)
        with torch.inference_mode():
            attention = engine.model.decode_attention(engine.cache, compiled=mode != "eager")
        captured = ("; captured so far: " + ", ".join(str(length) for _, length in engine.decode.captured_shapes)
                    + " (the other buckets when a step first reaches them)") if mode == "cuda_graph" else ""
        log.info("decode step: %s, attention %s, rows %s, cache length buckets %s; warmed up in %.1fs%s", mode,
                 attention, "/".join(map(str, rows)), lengths, seconds, captured)
        self.decode_step = {"mode": mode, "attention": attention, "rows": rows, "length_buckets": lengths,
                            "warm_up_seconds": round(seconds, 3),
                            "sdpa_backends": {"prefill": engine.attention.prefill, "decode": engine.attention.decode}}

    def memory_estimate(self, model: torch.nn.Module) -> tuple[int, int]:
        """(weight bytes: a tied weight once, prepacked copies counted; KV cache bytes of the rows in flight)."""
        return weight_bytes(model), self.kv_cache_bytes(model, self.rows_in_flight)

    def kv_cache_bytes(self, model: torch.nn.Module, rows: int) -> int:
        """The KV cache of `rows` rows x max_seq_len."""
        c = model.config
        return KVCache.nbytes(c.num_layers, rows, c.num_kv_heads, self.max_seq_len, c.head_dim, self.kv_dtype)

    def _rows_in_flight(self, model: torch.nn.Module, rows_to_do: int, free: int, tp: TensorParallelGroup) -> int:
        """runconfig.rows_in_flight, or for auto: every row to do up to AUTO_ROWS_IN_FLIGHT (on CUDA
        AUTO_ROWS_IN_FLIGHT_CUDA), as many as
        KV_CACHE_SHARE of the `free` bytes hold, never fewer than batch_size (the ranks of a tensor-parallel
        group, which must agree, and speculative decoding, whose steps are worth it only where few rows share
        a step, keep batch_size). Logged with the reason."""
        requested, batch_size = self.params.runconfig.rows_in_flight, self.params.inference_input.batch_size
        if requested != "auto":
            log.info("rows in flight: %d (runconfig.rows_in_flight)", requested)
            return requested
        if tp.size > 1 or self.params.model.speculative:
            log.info("rows in flight: %d (auto under %s: batch_size)", batch_size,
                     "tensor parallel" if tp.size > 1 else "speculative decoding")
            return batch_size
        per_row = self.kv_cache_bytes(model, rows=1)
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
                              shard_plan(checkpoint, tensor_parallel), weight_dtype, self.params.model.int8_group_size,
                              update)
        if mixed and policy.packed_gemm:
            keep_gemm_weights(model, policy.activations)
        elif mixed:
            name = str(policy.weights).replace("torch.", "")
            log.info("this CPU has no native %s matrix multiplies: weights keep their %s values, arithmetic and "
                     "KV cache are float32 (faster here; see modelzoo/cpu/precision.py)", name, name)
            model = model.to(self.dtype)
        return model

    def _choose_gemm(self, model: torch.nn.Module, weight_dtype: str | None, spare_bytes: int) -> int | None:
        """Puts every float linear layer in the layout of the GEMM backend chosen for it (runconfig.gemm_backend;
        MKL's second copy of the weights only within `spare_bytes`), and every int8 one in its backend's
        (runconfig.int8_backend); returns the row count of a job's last
        decode steps, or None to keep every step full.

        Every decode forward has one row per row in flight (times K + 1 when verifying K drafted tokens);
        once at most SMALL_STEP_ROWS rows are left, steps run only those, which keeps each row's bits only
        where every chosen backend is batch-invariant.
        """
        spec = self.params.model.speculative
        rows = self.rows_in_flight
        # Compiled, torch's own GEMMs: the re-laid-out weights of the other backends cannot be traced.
        backend = "torch" if self.decode_step_mode == "compiled" else self.params.runconfig.gemm_backend
        if self.policy.bf16_gemm:
            if backend != "auto":
                log.warning("runconfig.gemm_backend %s ignored: bfloat16 multiplies with bf16_linear here (float32 "
                            "outputs; see modelzoo/cpu/precision.py)", backend)
            self.gemm = GemmPlan(backend, layers=apply_bf16_gemm(model))
            log.info("GEMMs: bf16_linear (bfloat16 weights and inputs, float32 sums and outputs; input pairs broadcast "
                     "%s, the faster here as timed) for %s", cpu_kernels().bf16_gemm_broadcast(),
                     ", ".join(key if kernel == "bf16_linear" else f"{key} (SiLU gate fused: {kernel})"
                               for key, kernel in self.gemm.layers.items()))
            return SMALL_STEP_ROWS if rows > SMALL_STEP_ROWS and not spec else None
        if self.policy.half_gemm:
            if backend != "auto":
                log.warning("runconfig.gemm_backend %s ignored: %s weights multiply with half_linear here (widened to "
                            "float32; see modelzoo/cpu/precision.py)", backend, str(self.policy.weights)[6:])
            self.gemm = GemmPlan(backend, layers=apply_half_gemm(model))
            log.info("GEMMs: half_linear (%s weights widened to float32 as read, float32 inputs, sums and outputs; "
                     "%s code path, the faster here as timed) for %s", str(self.policy.weights)[6:],
                     cpu_kernels().half_gemm_path(), ", ".join(self.gemm.layers))
            return SMALL_STEP_ROWS if rows > SMALL_STEP_ROWS and not spec else None
        self.gemm = apply_gemm_backend(model, self.dtype, self.device, backend,
                                       decode_rows=rows * (1 + (spec.num_tokens if spec else 0)),
                                       spare_bytes=spare_bytes)
        if weight_dtype == "int8":
            self.gemm.add(apply_int8_backend(model, self.dtype, self.device, self.params.runconfig.int8_backend))
        if spec or rows <= SMALL_STEP_ROWS or self.device.type != "cpu" or self.decode_step_mode == "compiled":
            return None  # compiled: another shape is another graph, whose fusions may round a row otherwise
        return SMALL_STEP_ROWS if self.gemm.batch_invariant else None

    def _drafter(self) -> Drafter | None:
        """The speculative-decoding drafter of `model.speculative`, if any (loads the draft model)."""
        spec = self.params.model.speculative
        if spec is None:
            return None
        if spec.method == "prompt_lookup":
            log.info("speculative decoding: prompt lookup, %d tokens per step, n-grams up to %d", spec.num_tokens,
                     spec.max_ngram)
            return PromptLookupDrafter(spec.num_tokens, spec.max_ngram)
        draft = self.load(spec.checkpoint_path)
        if self.policy.bf16_gemm:
            apply_bf16_gemm(draft)
        elif self.policy.half_gemm:
            apply_half_gemm(draft)
        if draft.config.vocab_size != self.vocab_size:
            log.warning("the draft model's vocabulary has %d entries, the model's %d: fine if they share a tokenizer "
                        "and differ only in padding, useless otherwise", draft.config.vocab_size, self.vocab_size)
        log.info("speculative decoding: draft model %s (%s), %d tokens per step", spec.checkpoint_path,
                 type(draft).__name__, spec.num_tokens)
        return DraftModelDrafter(draft, spec.num_tokens, self.rows_in_flight, self.max_seq_len,
                                 self.vocab_size, self.kv_dtype, self.device)
