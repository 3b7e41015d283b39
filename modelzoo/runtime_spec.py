"""What a Runtime is opened from: the checkpoint and how to run it, in plain values (no torch).

The job derives one from its params (`InferenceParams.runtime_spec`), `ZooModel` from its keyword arguments, and
the lm-eval backend through `ZooModel`; `modelzoo/runtime.py` opens it. Options of the requests themselves
(temperature, stops, max_tokens...) are not here: they are `GenerationOptions` (modelzoo/generation/options.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculativeParams:
    """`model.speculative:` draft K tokens per step, then verify them in one forward of the model.

    prompt_lookup drafts from earlier n-grams (up to max_ngram tokens) of the row's own prompt and
    output; draft_model drafts with a smaller checkpoint of the same vocabulary.
    """

    method: str
    num_tokens: int = 4
    checkpoint_path: str | None = None
    max_ngram: int = 3


@dataclass(frozen=True)
class RuntimeSpec:
    """A model to run and how.

    checkpoint: a Hugging Face folder; dtype: auto, float32, bfloat16 or float16 (auto: the checkpoint's);
    weight_dtype: None or int8 (int8_group_size inputs per scale, 0: one per output channel); device: auto, cpu or
    cuda; max_seq_len: the longest row (prompt + completion); rows_in_flight: rows generated together (auto: sized
    by the memory, at least min_rows, at most the rows to do); num_threads: CPU threads (None: every core
    available); decode_step: auto, eager, compiled or cuda_graph; gemm_backend / int8_backend: auto (measured) or
    one by name (modelzoo/cpu/gemm.py, modelzoo/cpu/int8_compute.py); tensor_parallel: ranks that split the model;
    speculative: drafted decoding; adapters: LoRA adapter name -> folder, adapter the one of rows that name none
    (merged into the weights when every row runs it); row_adapters: the adapter names rows give (None: rows name
    none); scoring_top_k: the likeliest tokens the scorer reports at each scored position; weight_cache: a folder
    where the model, laid out for the CPU's GEMMs, is saved once and mapped by later runs (modelzoo/weight_cache.py;
    None: off).
    """

    checkpoint: str
    dtype: str = "auto"
    weight_dtype: str | None = None
    int8_group_size: int = 32
    device: str = "auto"
    max_seq_len: int = 2048
    rows_in_flight: int | str = "auto"
    min_rows: int = 1
    num_threads: int | None = None
    decode_step: str = "auto"
    gemm_backend: str = "auto"
    int8_backend: str = "auto"
    tensor_parallel: int = 1
    speculative: SpeculativeParams | None = None
    adapters: dict[str, str] = field(default_factory=dict)
    adapter: str | None = None
    row_adapters: tuple[str, ...] | None = None
    scoring_top_k: int = 0
    weight_cache: str | None = None
