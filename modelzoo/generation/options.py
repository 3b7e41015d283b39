"""How a request is generated: one value object for every option (the role of vLLM's `SamplingParams`).

The params' `model:` section holds a job's defaults (`ModelParams` is a `GenerationOptions`); a request that
brings options of its own (a row of the data, an OpenAI request) carries a whole `GenerationOptions`, the
job's with its own values put in (`Batch.options`). The engine takes options per request and nothing else
about them; what it must know before the first request (which stop sequences, whether some row samples) is
a `RequestVariety`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

MAX_TOP_LOGPROBS = 20  # as the OpenAI API
MAX_SAMPLES = 128  # n: rows of one request


@dataclass(frozen=True)
class Bound:
    """A numeric option's range: from `low` (excluded where `open_low`) to `high` (inf: none), of integers or
    numbers. `holds` takes a value or a numpy array (elementwise)."""

    integer: bool
    low: float
    high: float = math.inf
    open_low: bool = False

    def holds(self, value: Any) -> Any:
        above = value > self.low if self.open_low else value >= self.low
        return above & (value <= self.high)

    def text(self) -> str:
        """The range in words, as error messages give it."""
        if self.integer:
            return f"an integer from {self.low} to {self.high}" if self.high < math.inf else f"an integer >= {self.low}"
        low = f"> {float(self.low)}" if self.open_low else f">= {float(self.low)}"
        return f"a number {low}" + (f" and <= {float(self.high)}" if self.high < math.inf else "")


@dataclass(frozen=True)
class RowDataset:
    """How the .h5 holds a row's own value of an option (modelzoo/job/rows.py): the dataset's dtype ("str": UTF-8)
    and the value of a row that brings none (the job's then)."""

    dtype: str
    missing: Any


def option(default: Any, bound: Bound | None = None, *, per_row: bool = False, row_dataset: RowDataset | None = None,
           openai: str | None = None, manifest_when_set: bool = False, param: bool = True) -> Any:
    """A GenerationOptions field, declared once: its default and range (`bound`); `per_row`: a request may set it
    (the engine honours it row by row; the others are the job's for every row); `row_dataset`: the data holds a
    row's own value; `openai`: the OpenAI batch request key honoured row by row; `manifest_when_set`: an option
    added after runs already on disk, in the resume manifest only when it differs from its default (so they still
    resume); `param`: a key of the params' model: section (checked by its bound, or true / false)."""
    return field(default=default, metadata={"bound": bound, "per_row": per_row, "row_dataset": row_dataset,
                                            "openai": openai, "manifest_when_set": manifest_when_set, "param": param})


@dataclass(frozen=True)
class GenerationOptions:
    """Every option of a request's generation. temperature 0 is greedy (argmax of the penalised scores); top_k 0,
    top_p 1, min_p 0 and the penalties at their neutral values are off."""

    # most tokens generated (None: until the row is full)
    max_tokens: int | None = option(None, Bound(True, 1), per_row=True, row_dataset=RowDataset("int32", 0),
                                    openai="max_tokens")
    # token-id sequences that end the row (kept in it); a row's own: JSON token-id lists, added to the job's
    stop_sequences: tuple[tuple[int, ...], ...] = option((), per_row=True, row_dataset=RowDataset("str", ""))
    temperature: float = option(0.0, Bound(False, 0), per_row=True, row_dataset=RowDataset("float32", math.nan),
                                openai="temperature")
    top_k: int = option(0, Bound(True, 0))
    top_p: float = option(1.0, Bound(False, 0, 1, open_low=True), per_row=True,
                          row_dataset=RowDataset("float32", math.nan), openai="top_p")
    min_p: float = option(0.0, Bound(False, 0, 1), manifest_when_set=True)
    seed: int = option(0, Bound(True, 0), per_row=True, row_dataset=RowDataset("int64", -1), openai="seed")
    repetition_penalty: float = option(1.0, Bound(False, 0, open_low=True))
    no_repeat_ngram_size: int = option(0, Bound(True, 0))
    # the OpenAI API's penalties, over generated tokens
    presence_penalty: float = option(0.0, Bound(False, -2, 2), manifest_when_set=True)
    frequency_penalty: float = option(0.0, Bound(False, -2, 2), manifest_when_set=True)
    # samples of the request: n rows of the data, each drawn from its own stream
    n: int = option(1, Bound(True, 1, MAX_SAMPLES), per_row=True, openai="n", param=False)
    logprobs: bool = option(False, per_row=True, manifest_when_set=True)  # each generated token's log-probability
    # with logprobs: the K likeliest tokens at each position, and theirs
    top_logprobs: int = option(0, Bound(True, 0, MAX_TOP_LOGPROBS), per_row=True, manifest_when_set=True)
    # canonical JSON grammar text (structured.py); None: free text; a row's own: "" for none
    response_format: str | None = option(None, per_row=True, row_dataset=RowDataset("str", ""), param=False)

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.holds(value):
                raise ValueError(f"{type(self).__name__}.{name} out of range: {value!r}")

    @property
    def greedy(self) -> bool:
        """Whether each token is the argmax of the (possibly penalised) logits; no randomness then."""
        return self.temperature == 0.0

    def options(self) -> GenerationOptions:
        """These options as a plain GenerationOptions (a subclass, such as the params' model section, loses the rest)."""
        return GenerationOptions(**{field.name: getattr(self, field.name) for field in fields(GenerationOptions)})

    def overridden(self, **changes: Any) -> GenerationOptions:
        """A copy with `changes` (validated)."""
        return replace(self.options(), **changes)


# Derived from the declarations: each option's range; the options the engine honours row by row (the others are the
# job's for every row: a request asking another value is refused, RequestVariety.check); those a row of the data may
# set, with their .h5 dataset; those an OpenAI batch request sets row by row; those in the resume manifest only when
# set; those that are keys of the params' model: section.
_FIELDS = fields(GenerationOptions)
BOUNDS: dict[str, Bound] = {f.name: f.metadata["bound"] for f in _FIELDS if f.metadata["bound"]}
PER_ROW_OPTIONS = tuple(f.name for f in _FIELDS if f.metadata["per_row"])
ROW_OPTION_DATASETS: dict[str, RowDataset] = {f.name: f.metadata["row_dataset"] for f in _FIELDS
                                              if f.metadata["row_dataset"]}
OPENAI_KEYS: dict[str, str] = {f.metadata["openai"]: f.name for f in _FIELDS if f.metadata["openai"]}
MANIFEST_WHEN_SET = tuple(f.name for f in _FIELDS if f.metadata["manifest_when_set"])
PARAM_OPTIONS = tuple(f.name for f in _FIELDS if f.metadata["param"])


@dataclass(frozen=True)
class RequestVariety:
    """What the requests of a job may bring besides the defaults, known before the first one: every stop sequence
    a request may add, and whether some request samples, or keeps a top-p set, though the defaults do not."""

    stop_sequences: tuple[tuple[int, ...], ...] = ()
    samples: bool = False
    top_p: bool = False

    @classmethod
    def covering(cls, options: Sequence[GenerationOptions]) -> RequestVariety:
        """The variety of requests with these options: each one's stop sequences, whether one samples or keeps a
        top-p set."""
        return cls(tuple(dict.fromkeys(s for o in options for s in o.stop_sequences)),
                   samples=any(not o.greedy for o in options), top_p=any(o.top_p < 1.0 for o in options))

    @classmethod
    def of_rows(cls, given: dict[str, Any]) -> RequestVariety:
        """The variety of rows that set these values of their own (option name -> an array of the values given)."""
        temperature, top_p = given.get("temperature"), given.get("top_p")
        return cls(samples=temperature is not None and bool((temperature > 0).any()),
                   top_p=top_p is not None and bool((top_p < 1).any()))

    def union(self, other: RequestVariety) -> RequestVariety:
        """What either variety may bring."""
        return RequestVariety(tuple(dict.fromkeys(self.stop_sequences + other.stop_sequences)),
                              self.samples or other.samples, self.top_p or other.top_p)

    def check(self, defaults: GenerationOptions, options: GenerationOptions) -> None:
        """Raises ValueError where a request's options ask what the engine cannot give it next to the defaults."""
        for item in _FIELDS:
            name = item.name
            if name not in PER_ROW_OPTIONS and getattr(options, name) != getattr(defaults, name):
                raise ValueError(f"{name} {getattr(options, name)!r} differs from the job's {getattr(defaults, name)!r}: "
                                 "it is not an option of one request")
        if options.top_logprobs > defaults.top_logprobs or (options.logprobs and not defaults.logprobs):
            raise ValueError("a request may ask for at most the job's logprobs and top_logprobs")
        if not options.greedy and defaults.greedy and not self.samples:
            raise ValueError("a request samples but the engine was told none would (RequestVariety.samples)")
        if options.top_p < 1.0 and defaults.top_p == 1.0 and not self.top_p:
            raise ValueError("a request keeps a top-p set but the engine was told none would (RequestVariety.top_p)")
        unknown = set(options.stop_sequences) - set(defaults.stop_sequences) - set(self.stop_sequences)
        if unknown:
            raise ValueError(f"a request's stop sequences {sorted(map(list, unknown))[:4]} were not among the engine's "
                             "(RequestVariety.stop_sequences)")
