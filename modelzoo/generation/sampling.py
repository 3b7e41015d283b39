"""Choosing the next token: repetition control, then greedy or seeded sampling, as `transformers` does it.

The order is that of transformers' `generate()`: the repetition penalty, then the n-gram ban, on the whole row
(prompt included); then, only when sampling, temperature, top-k, top-p and min-p; then softmax and a draw.
Everything is vectorised over rows and stateless, so the engine can call it for any subset of slots, and
speculative decoding can pass hypothetical histories.

Randomness is counter-based: the uniform number behind a row's draw is a hash of (seed, sample index, row length),
never of the row's batch position or of how many draws came before. The same seed therefore gives the same
tokens whatever the batch size, the number of ranks, the device or a resume in between.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from modelzoo.generation.ngrams import earlier_occurrences
from modelzoo.generation.options import GenerationOptions, RequestVariety
from modelzoo.models.layers import fused_kernels

# splitmix64 (Steele, Lea and Flood, 2014): the increment and the two finaliser multipliers, and a second odd
# constant to step along the row (it must differ from the increment, or (index, length + 1) and (index + 1, length)
# would share a stream key).
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_STEP = 0xD1B54A32D192ED03
_UNIFORM_BITS = 53  # float64 holds 53 bits exactly: u = k / 2**53, k < 2**53


def _signed(value: int) -> int:
    """The int64 whose two's complement bits are `value` mod 2**64."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def splitmix64(value: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2**64): the reference for `_mix64`, and the seed's own hash."""
    value &= _MASK64
    value ^= value >> 30
    value = (value * _MIX1) & _MASK64
    value ^= value >> 27
    value = (value * _MIX2) & _MASK64
    return value ^ (value >> 31)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors, bit for bit the same as `splitmix64`.

    int64 products wrap mod 2**64 (two's complement) on CPU and CUDA, which is the unsigned product's bits.
    `>>` on int64 is arithmetic: the copied sign bits are masked off to make it a logical shift.
    """
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _signed(_MIX1)
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _signed(_MIX2)
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def seed_key(seed: int) -> int:
    """The int64 key a seed's random streams start from (the seed is a Python int of any size: hashed once)."""
    return _signed(splitmix64(seed + _GOLDEN))


def uniforms(seed: int, sample_index: Tensor, position: Tensor) -> Tensor:
    """One uniform number in [0, 1) per row, a pure function of (seed, sample_index, position).

    sample_index, position: (B,) long, the key of the row's random stream and the step along it (the row's
    length before the new token). Returns (B,) float64 on their device, a multiple of 2**-53.
    """
    return keyed_uniforms(seed_key(seed), sample_index, position)


def keyed_uniforms(key: int | Tensor, sample_index: Tensor, position: Tensor) -> Tensor:
    """`uniforms` from the seed's key (`seed_key`), one for every row or (B,) long, one per row."""
    h = _mix64(sample_index.long() * _signed(_GOLDEN) + key)
    h = _mix64(position.long() * _signed(_STEP) + h)
    bits = (h >> (64 - _UNIFORM_BITS)) & ((1 << _UNIFORM_BITS) - 1)  # the top 53 bits, as a non-negative int64
    return bits.double() * 2.0 ** -_UNIFORM_BITS


def greedy_tokens(scores: Tensor) -> Tensor:
    """scores.argmax(-1): the first index of each row's largest value (NaN counting as the largest, token 0 for a row
    of -inf). On the CPU through max(-1)'s indices: the same index, and PyTorch's argmax over a vocabulary is several
    times slower (benchmarks/README.md, the AMX section)."""
    return scores.max(-1).indices if scores.device.type == "cpu" else scores.argmax(-1)


def vocabulary_kernels(scores: Tensor) -> ModuleType | None:
    """The C++ kernels where they take these (B, V) float32 rows (`fused_kernels`: on the CPU, not under
    torch.compile): `sort_rows` and `draw_rows`, each with its PyTorch spelling's results over a vocabulary in a
    fraction of its time; None for PyTorch's ops."""
    return fused_kernels(scores) if scores.dtype == torch.float32 and scores.dim() == 2 else None


def sort_ascending(scores: Tensor) -> tuple[Tensor, Tensor]:
    """torch.sort(scores, -1, stable=True) of (B, V) rows: (values, indices); on the CPU by the kernels' radix sort."""
    kernels = vocabulary_kernels(scores)
    if kernels is None:
        return torch.sort(scores, dim=-1, descending=False, stable=True)
    return kernels.sort_rows(scores.contiguous())


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: for each row, the first token whose cumulative probability exceeds u * total.

    probs: (B, V) non-negative weights, not necessarily normalised; u: (B,) in [0, 1). Returns (B,) long. A token
    of probability 0 is never picked: the cumulative sum does not rise there, so it never first exceeds the
    threshold, and the pick is capped at the last token of positive probability (u * total < total, but float64
    rounding should not be trusted with that). A row with nothing to draw from (total 0 or NaN: softmax of a row
    that is all -inf) gets token 0, what argmax gives there and so what transformers' greedy search picks.
    On the CPU the kernels' `draw_rows` adds the same float64 sums in the same order without writing them out.
    """
    kernels = vocabulary_kernels(probs)
    if kernels is not None:
        return kernels.draw_rows(probs.contiguous(), u.to(torch.float64).contiguous())
    cdf = probs.double().cumsum(-1)  # (B, V), non-decreasing; float64: a float32 running sum over 150k terms drifts
    total = cdf[:, -1:].contiguous()  # (B, 1)
    token = torch.searchsorted(cdf, u.to(cdf)[:, None] * total, right=True)  # (B, 1): first cdf > threshold
    last = torch.searchsorted(cdf, total, right=False)  # (B, 1): first cdf == total, the last positive token
    token = torch.minimum(token, last).clamp(max=probs.shape[-1] - 1)
    return torch.where(total > 0, token, 0).squeeze(1)  # NaN > 0 is False


def _valid_ids(sequences: Tensor, lengths: Tensor, vocab_size: int) -> Tensor:
    """(B, L) ids with every position past the row's length, or out of [0, vocab), set to the spare id vocab_size."""
    positions = torch.arange(sequences.shape[1], device=sequences.device)
    valid = (positions[None, :] < lengths[:, None]) & (sequences >= 0) & (sequences < vocab_size)
    return torch.where(valid, sequences, vocab_size)


def apply_repetition_penalty(scores: Tensor, sequences: Tensor, lengths: Tensor, penalty: float) -> Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on each row's first lengths[b] tokens.

    Every token present in the row, once however often it occurs: negative scores are multiplied by the penalty,
    positive ones divided. scores: (B, V) float; sequences: (B, L) long; lengths: (B,) long. Returns (B, V).
    """
    vocab_size = scores.shape[-1]
    ids = _valid_ids(sequences, lengths, vocab_size)  # (B, L); garbage goes to the spare column, dropped below
    padded = F.pad(scores, (0, 1))  # (B, V + 1)
    seen = padded.gather(1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, ids, seen)[:, :vocab_size]


def ban_repeated_ngrams(scores: Tensor, sequences: Tensor, lengths: Tensor, ngram_size: int) -> Tensor:
    """transformers' NoRepeatNGramLogitsProcessor on each row's first lengths[b] tokens.

    Sets to -inf every token that would complete an n-gram already in the row: for each earlier window whose first
    n - 1 tokens equal the row's last n - 1, the window's last token. Nothing is banned in a row shorter than n.
    scores: (B, V) float; sequences: (B, L) long; lengths: (B,) long. Returns (B, V).
    """
    n = ngram_size
    num_rows, vocab_size = scores.shape
    if sequences.shape[1] < n:  # no row holds a whole n-gram
        return scores
    # Earlier windows whose first n - 1 tokens are the row's last n - 1, and the token after each (B, L - n + 1).
    # The window starting at the row's own last n - 1 tokens would end at the new token, so none bans its successor.
    matches = earlier_occurrences(sequences, lengths, n - 1)
    successor = sequences[:, n - 1:]
    banned_ids = torch.where(matches & (successor >= 0) & (successor < vocab_size), successor, vocab_size)
    banned = torch.zeros((num_rows, vocab_size + 1), dtype=torch.bool, device=scores.device)
    banned.scatter_(1, banned_ids, True)  # non-matching windows land in the spare column, never unbanning
    return scores.masked_fill(banned[:, :vocab_size], -float("inf"))


def apply_output_penalties(scores: Tensor, sequences: Tensor, lengths: Tensor, prompt_lengths: Tensor,
                           presence: float, frequency: float) -> Tensor:
    """The OpenAI API's (and vLLM's) presence and frequency penalties over each row's generated tokens only:
    scores - frequency * count - presence * (count > 0), count being how often the token was generated so far.

    scores: (B, V) float; sequences: (B, L) long; lengths, prompt_lengths: (B,) long (generated: [prompt, length)).
    """
    vocab_size = scores.shape[-1]
    positions = torch.arange(sequences.shape[1], device=sequences.device)
    generated = (positions[None, :] >= prompt_lengths[:, None]) & (positions[None, :] < lengths[:, None])
    ids = torch.where(generated & (sequences >= 0) & (sequences < vocab_size), sequences, vocab_size)  # (B, L)
    counts = torch.zeros((scores.shape[0], vocab_size + 1), dtype=scores.dtype, device=scores.device)
    counts = counts.scatter_add(1, ids, torch.ones_like(ids, dtype=scores.dtype))[:, :vocab_size]  # (B, V)
    return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


def apply_temperature(scores: Tensor, temperature: float) -> Tensor:
    """transformers' TemperatureLogitsWarper: scores / temperature (B, V).

    A tiny temperature can overflow finite scores to +inf, and softmax then gives NaN (inf - inf). Such rows are
    divided after subtracting their maximum instead: the same distribution (its temperature -> 0 limit, the
    argmax), with nothing above 0. Other rows are exactly transformers' result.
    """
    scaled = scores / temperature
    overflow = torch.isposinf(scaled).any(-1, keepdim=True)  # (B, 1)
    if scores.device.type == "cpu" and not torch.compiler.is_compiling() and not overflow.any():
        return scaled  # nothing to shift (a GPU and a compiled step take the where() below: no sync, no branch)
    shifted = (scores - scores.amax(-1, keepdim=True)) / temperature
    return torch.where(overflow, shifted, scaled)


def keep_top_k(scores: Tensor, top_k: int) -> Tensor:
    """transformers' TopKLogitsWarper (min_tokens_to_keep 1): -inf below the k-th largest score; ties with it stay."""
    k = min(max(top_k, 1), scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]  # (B, 1)
    return scores.masked_fill(scores < kth, -float("inf"))


def keep_top_p(scores: Tensor, top_p: float) -> Tensor:
    """`keep_top_p_cut` at transformers' cut, 1 - top_p."""
    return keep_top_p_cut(scores, 1 - top_p)


def keep_top_p_cut(scores: Tensor, cut: float | Tensor) -> Tensor:
    """transformers' TopPLogitsWarper (min_tokens_to_keep 1): the smallest set of most probable tokens whose
    probability adds up to top_p or more, the rest -inf.

    Same operations as transformers, so the same float32 boundary: in ascending order, a token goes when the
    cumulative probability up to it is <= cut = 1 - top_p (a float, or (B, 1) float32 per row holding
    float32(1 - top_p), which compares as transformers' Python float does; -1 keeps every token); the most
    probable token always stays. Ties at the cut are broken by token id (a stable sort: the lower id goes
    first), so the result is the same on every device and batch; transformers' default sort is unstable on CPU
    and may keep another one of the tied tokens there, always as many of them.
    """
    sorted_scores, order = sort_ascending(scores)  # (B, V)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove = cumulative <= cut
    remove[:, -1] = False
    remove = remove.scatter(1, order, remove)  # back to vocabulary order
    return scores.masked_fill(remove, -float("inf"))


def keep_min_p(scores: Tensor, min_p: float) -> Tensor:
    """transformers' MinPLogitsWarper (min_tokens_to_keep 1): -inf where a token's probability is below min_p times
    the most probable token's (which always stays: min_p <= 1). Same operations, so the same float32 cut."""
    probs = scores.softmax(-1)  # (B, V)
    return scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -float("inf"))


@dataclass
class RowSampling:
    """Each row's own sampling options, (B,) each, where rows of one step differ."""

    temperature: Tensor  # float32; 0: the row is greedy
    top_p_cut: Tensor  # float32: float32(1 - top_p), -1 where the row keeps every token
    seed_key: Tensor  # long: seed_key(the row's seed)

    @staticmethod
    def cut(top_p: float) -> float:
        """A row's top_p as `top_p_cut` holds it."""
        return 1 - top_p if top_p < 1.0 else -1.0

    def put(self, slots: Tensor, options: list[GenerationOptions]) -> None:
        """Rows `slots` take their requests' temperature, top-p cut and seed key."""
        device = self.temperature.device
        self.temperature[slots] = torch.tensor([o.temperature for o in options], dtype=torch.float32, device=device)
        self.top_p_cut[slots] = torch.tensor([self.cut(o.top_p) for o in options], dtype=torch.float32, device=device)
        self.seed_key[slots] = torch.tensor([seed_key(o.seed) for o in options], dtype=torch.long, device=device)

    def rows(self, rows: Tensor | slice) -> RowSampling:
        """The options of rows `rows` only."""
        return RowSampling(self.temperature[rows], self.top_p_cut[rows], self.seed_key[rows])


@dataclass(frozen=True)
class TokenChoice(GenerationOptions):
    """The arithmetic of a token choice under a job's GenerationOptions (its penalties, temperature, top-k, top-p,
    min-p and seed).

    The job's temperature, top_p and seed are every row's unless the row brings its own (`RowSampling`):
    `rows_sample` says some row may sample though the job's temperature is 0, `rows_top_p` that some row
    may keep a top-p set though the job's top_p is 1."""

    rows_sample: bool = False
    rows_top_p: bool = False

    @classmethod
    def from_options(cls, options: GenerationOptions, variety: RequestVariety = RequestVariety()) -> TokenChoice:
        """The token choice of a job's options, with what its requests may bring (`variety`)."""
        return cls(**{field.name: getattr(options, field.name) for field in fields(GenerationOptions)},
                   rows_sample=variety.samples, rows_top_p=variety.top_p)

    @property
    def needs_history(self) -> bool:
        """Whether `choose` reads `sequences` (the repetition rules); otherwise only lengths and sample indices."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def is_plain_greedy(self) -> bool:
        """Whether the token is the argmax of the raw logits: the engine's fast path."""
        return self.greedy and not self.needs_history and not self.rows_sample

    def penalize(self, logits: Tensor, sequences: Tensor | None, lengths: Tensor,
                 prompt_lengths: Tensor | None = None) -> Tensor:
        """`process`'s first part, the repetition rules, on every row: float32 (B, V). The presence and frequency
        penalties, after transformers' two, count the generated tokens only: [prompt_lengths, lengths)."""
        scores = logits.float()
        if self.needs_history and sequences is None:
            raise ValueError("the repetition options need each row's tokens (sequences)")
        if self.repetition_penalty != 1.0:
            scores = apply_repetition_penalty(scores, sequences, lengths, self.repetition_penalty)
        if self.no_repeat_ngram_size > 0:
            scores = ban_repeated_ngrams(scores, sequences, lengths, self.no_repeat_ngram_size)
        if self.presence_penalty != 0 or self.frequency_penalty != 0:
            if prompt_lengths is None:
                raise ValueError("presence_penalty and frequency_penalty need each row's prompt length")
            scores = apply_output_penalties(scores, sequences, lengths, prompt_lengths, self.presence_penalty,
                                            self.frequency_penalty)
        return scores

    def process(self, logits: Tensor, sequences: Tensor | None, lengths: Tensor,
                prompt_lengths: Tensor | None = None) -> Tensor:
        """The scores a token is chosen from, float32 (B, V), as transformers' processors leave them.

        logits: (B, V); sequences: (B, L) long, row b's tokens so far valid in [:lengths[b]] (may be None when
        not `needs_history`); lengths: (B,) long; prompt_lengths: (B,) long, for the presence and frequency
        penalties. Penalties always; temperature, top-k, top-p, min-p only when sampling.
        """
        scores = self.penalize(logits, sequences, lengths, prompt_lengths)
        if not self.greedy:
            if self.temperature != 1.0:
                scores = apply_temperature(scores, self.temperature)
            if self.top_k > 0:
                scores = keep_top_k(scores, self.top_k)
            if self.top_p < 1.0:
                scores = keep_top_p(scores, self.top_p)
            if self.min_p > 0:
                scores = keep_min_p(scores, self.min_p)
        return scores

    def choose(self, logits: Tensor, sequences: Tensor | None, lengths: Tensor, sample_index: Tensor) -> Tensor:
        """The next token of every row, (B,) long.

        logits: (B, V) float; sequences: (B, L) long, each row's tokens so far (prompt + generated), valid in
        [:lengths[b]], anything after is ignored (None is fine when not `needs_history`); lengths: (B,) long;
        sample_index: (B,) long, the sample's global index. A sampled row's draw depends only on
        (seed, sample_index[b], lengths[b]) and its own scores. A row whose every token is banned gets token 0
        (the argmax of all -inf, as in transformers' greedy search; its sampling would fail on NaN probabilities).
        """
        if self.is_plain_greedy:
            return greedy_tokens(logits)
        return self.choose_from_scores(self.process(logits, sequences, lengths), lengths, sample_index)

    def choose_rows(self, logits: Tensor, sequences: Tensor | None, lengths: Tensor, sample_index: Tensor,
                    rows: RowSampling, prompt_lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`choose` with each row's own temperature, top_p and seed (`rows`): (tokens (B,) long, the scores
        (B, V) float32 each token was chosen from). Greedy rows and sampled rows side by side; a row's result
        equals a job's whose options are that row's. No host sync."""
        scores = self.penalize(logits, sequences, lengths, prompt_lengths)  # the rest is per row, below
        if self.greedy and not self.rows_sample:
            return greedy_tokens(scores), scores
        sampled = rows.temperature > 0  # (B,)
        warped = apply_temperature(scores, torch.where(sampled, rows.temperature, 1.0)[:, None])
        if self.top_k > 0:
            warped = keep_top_k(warped, self.top_k)
        if self.rows_top_p or self.top_p < 1.0:
            warped = keep_top_p_cut(warped, rows.top_p_cut[:, None])
        if self.min_p > 0:
            warped = keep_min_p(warped, self.min_p)
        scores = torch.where(sampled[:, None], warped, scores)
        drawn = draw(scores.softmax(-1), keyed_uniforms(rows.seed_key, sample_index, lengths))
        return torch.where(sampled, drawn, greedy_tokens(scores)), scores

    def choose_from_scores(self, scores: Tensor, lengths: Tensor, sample_index: Tensor) -> Tensor:
        """`choose` after `process`: the token of each row (B,) from its processed scores (B, V) float32."""
        if self.greedy:
            return greedy_tokens(scores)
        probs = scores.softmax(-1)  # (B, V): what transformers hands to torch.multinomial
        return draw(probs, uniforms(self.seed, sample_index, lengths))
