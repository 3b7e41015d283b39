"""params.yaml -> frozen, validated dataclasses. Unknown keys and bad values are one-line errors."""
from __future__ import annotations

import difflib
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from modelzoo.errors import UserError
from modelzoo.generation.options import BOUNDS, PARAM_OPTIONS, GenerationOptions
from modelzoo.generation.formats import schema_format
from modelzoo.runtime_spec import RuntimeSpec, SpeculativeParams

DATA_PROCESSOR = "GptHDF5MapDataProcessor"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
GEMM_BACKENDS = ("auto", "mkl", "onednn", "packed", "torch", "onednn_blocks", "torch_blocks")  # modelzoo/cpu/gemm.py
INT8_BACKENDS = ("auto", "vnni16", "vnni8", "float")  # modelzoo/cpu/int8_compute.py
DECODE_STEPS = ("auto", "eager", "compiled", "cuda_graph")  # modelzoo/generation/step.py
WEIGHT_DTYPES = ("int8",)
SPECULATIVE_METHODS = ("prompt_lookup", "draft_model")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(minimum: int, nullable: bool = False) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value is None and nullable:
            return None
        if not _is_int(value) or value < minimum:
            null = " or null" if nullable else ""
            raise UserError(f"{key} must be an integer >= {minimum}{null}, got {value!r}")
        return value
    return check


def _choice(options: tuple, kind: Callable[[Any], bool] = lambda v: True) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if not kind(value) or value not in options:
            raise UserError(f"{key} must be one of {', '.join(map(str, options))}, got {value!r}")
        return value
    return check


def _option(name: str) -> Callable[[str, Any], Any]:
    """The check of GenerationOptions field `name`: its declared range (null where its default is None), or true /
    false for a flag."""
    default = GenerationOptions.__dataclass_fields__[name].default
    if isinstance(default, bool):
        return _bool
    bound, nullable = BOUNDS[name], default is None

    def check(key: str, value: Any) -> Any:
        if value is None and nullable:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (_is_int(value) if bound.integer else number) or not bound.holds(value):
            raise UserError(f"{key} must be {bound.text()}{' or null' if nullable else ''}, got {value!r}")
        return value if bound.integer else float(value)
    return check


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{key} must be true or false, got {value!r}")
    return value


def _path(nullable: bool) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, (str, Path)) or not str(value):
            raise UserError(f"{key} must be a path, got {value!r}")
        return str(value)
    return check


def _start_token(key: str, value: Any) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(_is_int(i) and i >= 0 for i in ids):
        raise UserError(f"{key} must be an integer >= 0 or a non-empty list of them, got {value!r}")
    return tuple(ids)


def _stop_sequences(key: str, value: Any) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise UserError(f"{key} must be a list of token-id lists (e.g. [[2]]), got {value!r}")
    for i, seq in enumerate(value):
        if not isinstance(seq, list) or not seq or not all(_is_int(t) and t >= 0 for t in seq):
            raise UserError(f"{key}[{i}] must be a non-empty list of token ids >= 0, got {seq!r}")
    return tuple(tuple(seq) for seq in value)


def _json_schema(key: str, value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise UserError(f"{key} must be a JSON schema written as a mapping (e.g. {{type: object, properties: "
                        f"{{answer: {{type: string}}}}}}) or null, got {value!r}")
    return value


def _rows_in_flight(key: str, value: Any) -> int | str:
    if value != "auto" and (not _is_int(value) or value < 1):
        raise UserError(f"{key} must be auto or an integer >= 1 (rows generated together), got {value!r}")
    return value


def _group_size(key: str, value: Any) -> int:
    if not _is_int(value) or value < 0 or value % 16:
        raise UserError(f"{key} must be 0 (one scale per output channel) or a positive multiple of 16 "
                        f"(inputs per scale), got {value!r}")
    return value


def _adapters(key: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(name, str) and name for name in value):
        raise UserError(f"{key} must map adapter names to PEFT LoRA adapter folders (e.g. {{math: adapters/math}}), "
                        f"got {value!r}")
    return {name: _path(nullable=False)(f"{key}.{name}", folder) for name, folder in value.items()}


def _adapter_name(key: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise UserError(f"{key} must be the name of one of model.adapters, or null for the bare base model, "
                        f"got {value!r}")
    return value


def _speculative(key: str, value: Any) -> SpeculativeParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserError(f"{key} must be a mapping such as {{method: prompt_lookup, num_tokens: 4}}, got {value!r}")
    checks = {"method": _choice(SPECULATIVE_METHODS, lambda v: isinstance(v, str)), "num_tokens": _int(1),
              "checkpoint_path": _path(nullable=True), "max_ngram": _int(1)}
    values = {}
    for name, item in value.items():
        if name not in checks:
            raise _unknown_key(f"{key}.", name, list(checks))
        values[name] = checks[name](f"{key}.{name}", item)
    if "method" not in values:
        raise UserError(f"params is missing required key {key}.method ({', '.join(SPECULATIVE_METHODS)})")
    if values["method"] == "draft_model" and not values.get("checkpoint_path"):
        raise UserError(f"{key}.checkpoint_path is required with method draft_model (the draft checkpoint folder)")
    if values["method"] == "prompt_lookup" and values.get("checkpoint_path"):
        raise UserError(f"{key}.checkpoint_path is only for method draft_model")
    return SpeculativeParams(**values)


@dataclass(frozen=True, kw_only=True)
class ModelParams(GenerationOptions):
    """`model:` section: what to run, and the job's generation options (GenerationOptions: how tokens are chosen,
    when a row stops, what is kept of each), the defaults of every request."""

    start_token: tuple[int, ...]
    checkpoint_path: str | None = None
    dtype: str = "auto"
    weight_dtype: str | None = None
    int8_group_size: int = 32  # inputs per int8 scale (0: one per output channel); modelzoo/cpu/quantization.py
    loop_dim: int = 1
    json_schema: dict[str, Any] | None = None  # the output of rows without a response format of their own follows it
    speculative: SpeculativeParams | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> folder (modelzoo/models/lora.py)
    adapter: str | None = None  # the adapter of rows that name none (None: the bare base model)

    def generation_defaults(self) -> GenerationOptions:
        """The job's GenerationOptions: these keys, model.json_schema as the response format."""
        return self.overridden(response_format=None if self.json_schema is None else schema_format(self.json_schema))

    def check_combinations(self) -> None:
        """Keys that are valid alone but not together."""
        if self.greedy and (self.top_k or self.top_p < 1.0 or self.min_p):
            raise UserError("model.top_k, model.top_p and model.min_p only apply when sampling; set "
                            "model.temperature > 0 "
                            "(temperature 0 is greedy decoding)")
        if self.speculative is not None and not self.greedy:
            raise UserError("model.speculative needs greedy decoding (model.temperature 0): it reproduces greedy "
                            "outputs exactly, which sampling has no counterpart for here")
        if self.top_logprobs and not self.logprobs:
            raise UserError("model.top_logprobs needs model.logprobs: true")
        if self.adapter is not None and self.adapter not in self.adapters:
            raise UserError(f"model.adapter {self.adapter!r} is not one of model.adapters "
                            f"({', '.join(self.adapters) or 'none listed'})")
        if self.speculative is not None and self.json_schema is not None:
            raise UserError("model.json_schema cannot be combined with model.speculative")
        if self.speculative is not None and self.logprobs:
            raise UserError("model.logprobs cannot be combined with model.speculative yet")
        if self.speculative is not None and (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size
                                             or self.presence_penalty or self.frequency_penalty):
            raise UserError("model.speculative cannot be combined with model.repetition_penalty, "
                            "model.no_repeat_ngram_size, model.presence_penalty or model.frequency_penalty")


@dataclass(frozen=True)
class InputParams:
    """`inference_input:` section: where the tokenized prompts are and how many rows per step."""

    data_dir: str
    batch_size: int
    data_processor: str = DATA_PROCESSOR


@dataclass(frozen=True)
class RunConfig:
    """`runconfig:` section: options of this run that do not change the outputs."""

    inference_steps: int | None = None
    compile_only: bool = False
    device: str = "auto"
    num_threads: int | None = None
    log_steps: int = 10
    tensor_parallel: int = 1
    gemm_backend: str = "auto"  # auto (measured at start-up), mkl, onednn or torch: see modelzoo/cpu/gemm.py
    int8_backend: str = "auto"  # auto (measured at start-up), vnni16, vnni8 or float: modelzoo/cpu/int8_compute.py
    rows_in_flight: int | str = "auto"  # rows generated together (KV cache slots): auto or >= 1, see modelzoo/runtime.py
    decode_step: str = "auto"  # how the decode step runs: auto, eager, compiled or cuda_graph (generation/step.py)
    weight_cache: str | None = None  # models laid out for the GEMMs, mapped by later jobs: modelzoo/weight_cache.py

    def __post_init__(self) -> None:
        if self.tensor_parallel > 1 and self.decode_step in ("compiled", "cuda_graph"):
            raise UserError(f"runconfig.decode_step {self.decode_step} does not take runconfig.tensor_parallel > 1 (its "
                            f"all-reduce is not compiled or captured); use auto or eager")


@dataclass(frozen=True)
class InferenceParams:
    """The whole params.yaml."""

    model: ModelParams
    inference_input: InputParams
    runconfig: RunConfig

    def runtime_spec(self, max_seq_len: int, row_adapters: list[str] | None, num_threads: int) -> RuntimeSpec:
        """What the job's Runtime is opened from: these params, the data's max_seq_len and the adapter names its rows
        give (None: rows name none), and this process's CPU threads."""
        model, run = self.model, self.runconfig
        return RuntimeSpec(
            checkpoint=model.checkpoint_path, dtype=model.dtype, weight_dtype=model.weight_dtype,
            int8_group_size=model.int8_group_size, device=run.device, max_seq_len=max_seq_len,
            rows_in_flight=run.rows_in_flight, min_rows=self.inference_input.batch_size, num_threads=num_threads,
            decode_step=run.decode_step, gemm_backend=run.gemm_backend, int8_backend=run.int8_backend,
            tensor_parallel=run.tensor_parallel, speculative=model.speculative, adapters=model.adapters,
            adapter=model.adapter, row_adapters=None if row_adapters is None else tuple(row_adapters),
            scoring_top_k=model.top_logprobs, weight_cache=run.weight_cache)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready dict (tuples become lists), each section's keys in the params reference's order."""
        def plain(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value
        sections = plain(asdict(self))
        return {name: {key: sections[name][key] for key in SCHEMA[name][1]} for name in SCHEMA}


# Section -> (dataclass, {key: check}). Order of keys is the order of the params reference.
SCHEMA: dict[str, tuple[type, dict[str, Callable[[str, Any], Any]]]] = {
    "model": (ModelParams, {
        "checkpoint_path": _path(nullable=True),
        "dtype": _choice(DTYPE_NAMES, lambda v: isinstance(v, str)),
        "weight_dtype": lambda key, value: None if value is None else _choice(
            WEIGHT_DTYPES, lambda v: isinstance(v, str))(key, value),
        "int8_group_size": _group_size,
        "start_token": _start_token,
        "stop_sequences": _stop_sequences,
        "max_tokens": _option("max_tokens"),
        "loop_dim": _choice((0, 1), _is_int),
        "logprobs": _bool,
        "top_logprobs": _option("top_logprobs"),
        "json_schema": _json_schema,
        "temperature": _option("temperature"),
        "top_k": _option("top_k"),
        "top_p": _option("top_p"),
        "seed": _option("seed"),
        "repetition_penalty": _option("repetition_penalty"),
        "no_repeat_ngram_size": _option("no_repeat_ngram_size"),
        "min_p": _option("min_p"),
        "presence_penalty": _option("presence_penalty"),
        "frequency_penalty": _option("frequency_penalty"),
        "speculative": _speculative,
        "adapters": _adapters,
        "adapter": _adapter_name,
    }),
    "inference_input": (InputParams, {
        "data_processor": _choice((DATA_PROCESSOR,), lambda v: isinstance(v, str)),
        "data_dir": _path(nullable=False),
        "batch_size": _int(1),
    }),
    "runconfig": (RunConfig, {
        "inference_steps": _int(1, nullable=True),
        "compile_only": _bool,
        "device": _choice(DEVICES, lambda v: isinstance(v, str)),
        "num_threads": _int(1, nullable=True),
        "log_steps": _int(1),
        "tensor_parallel": _int(1),
        "gemm_backend": _choice(GEMM_BACKENDS, lambda v: isinstance(v, str)),
        "int8_backend": _choice(INT8_BACKENDS, lambda v: isinstance(v, str)),
        "rows_in_flight": _rows_in_flight,
        "decode_step": _choice(DECODE_STEPS, lambda v: isinstance(v, str)),
        "weight_cache": _path(nullable=True),
    }),
}

# A GenerationOptions field declared as a params key that the reference above does not list is a model: key too,
# after the others, checked by its declaration: a new option needs no line here.
SCHEMA["model"][1].update({name: _option(name) for name in PARAM_OPTIONS if name not in SCHEMA["model"][1]})


def _unknown_key(where: str, key: str, known: list[str]) -> UserError:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(known)}"
    return UserError(f"unknown key {where}{key!r} in params{hint}")


def _section(name: str, raw: Any) -> Any:
    cls, checks = SCHEMA[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"params section {name!r} must be a mapping, got {type(raw).__name__}")
    values = {}
    for key, value in raw.items():
        if key not in checks:
            raise _unknown_key(f"{name}.", key, list(checks))
        values[key] = checks[key](f"{name}.{key}", value)
    for item in fields(cls):
        if item.name not in values and item.default is MISSING and item.default_factory is MISSING:
            raise UserError(f"params is missing required key {name}.{item.name}")
    return cls(**values)


def parse_params(raw: Any) -> InferenceParams:
    """Validates a params mapping (as read from YAML)."""
    if not isinstance(raw, dict):
        raise UserError("params must be a YAML mapping with sections model, inference_input, runconfig")
    for name in raw:
        if name not in SCHEMA:
            raise _unknown_key("", name, list(SCHEMA))
    params = InferenceParams(**{name: _section(name, raw.get(name)) for name in SCHEMA})
    params.model.check_combinations()
    return params


def load_params(path: str | Path) -> InferenceParams:
    """Reads and validates a params.yaml file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"params file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"params file {path} is not valid YAML: {exc}".replace("\n", " ")) from exc
    return parse_params(raw)


def with_overrides(params: InferenceParams, overrides: dict[str, dict[str, Any]]) -> InferenceParams:
    """Applies CLI overrides ({section: {key: value}}, None values ignored), validated like YAML."""
    sections = {}
    for name in SCHEMA:
        current = getattr(params, name)
        changes = {k: SCHEMA[name][1][k](f"{name}.{k}", v)
                   for k, v in overrides.get(name, {}).items() if v is not None}
        sections[name] = replace(current, **changes)
    params = InferenceParams(**sections)
    params.model.check_combinations()
    return params
