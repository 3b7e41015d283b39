"""How a request is generated: one value object for every option (the role of vLLM's `SamplingParams`).

The params' `model:` section holds a job's defaults (`ModelParams` is a `GenerationOptions`); a request that
brings options of its own (a row of the data, an OpenAI request) carries a whole `GenerationOptions`, the
job's with its own values put in (`Batch.options`). The engine takes options per request and nothing else
about them; what it must know before the first request (which stop sequences, whether some row samples) is
a `RequestVariety`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

MAX_TOP_LOGPROBS = 20  # as the OpenAI API
MAX_SAMPLES = 128  # n: rows of one request


@dataclass(frozen=True)
class GenerationOptions:
    """Every option of a request's generation. temperature 0 is greedy (argmax of the penalised scores); top_k 0,
    top_p 1, min_p 0 and the penalties at their neutral values are off."""

    max_tokens: int | None = None  # most tokens generated (None: until the row is full)
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences that end the row (kept in it)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    presence_penalty: float = 0.0  # the OpenAI API's, over generated tokens
    frequency_penalty: float = 0.0
    n: int = 1  # samples of the request: n rows of the data, each drawn from its own stream
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int = 0  # with logprobs: the K likeliest tokens at each position, and theirs
    response_format: str | None = None  # canonical JSON grammar text (structured.py); None: free text

    def __post_init__(self) -> None:
        checks = {"max_tokens": self.max_tokens is None or self.max_tokens >= 1,
                  "temperature": self.temperature >= 0, "top_k": self.top_k >= 0, "top_p": 0 < self.top_p <= 1,
                  "min_p": 0 <= self.min_p <= 1, "seed": self.seed >= 0, "repetition_penalty": self.repetition_penalty > 0,
                  "no_repeat_ngram_size": self.no_repeat_ngram_size >= 0,
                  "presence_penalty": -2 <= self.presence_penalty <= 2,
                  "frequency_penalty": -2 <= self.frequency_penalty <= 2, "n": 1 <= self.n <= MAX_SAMPLES,
                  "top_logprobs": 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}.{name} out of range: {getattr(self, name)!r}")

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


# Options the engine honours row by row; the others are the job's for every row (a request asking another value is
# refused: RequestVariety.check).
PER_ROW_OPTIONS = ("max_tokens", "stop_sequences", "temperature", "top_p", "seed", "n", "response_format",
                   "logprobs", "top_logprobs")


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

    def union(self, other: RequestVariety) -> RequestVariety:
        """What either variety may bring."""
        return RequestVariety(tuple(dict.fromkeys(self.stop_sequences + other.stop_sequences)),
                              self.samples or other.samples, self.top_p or other.top_p)

    def check(self, defaults: GenerationOptions, options: GenerationOptions) -> None:
        """Raises ValueError where a request's options ask what the engine cannot give it next to the defaults."""
        for field in fields(GenerationOptions):
            name = field.name
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
