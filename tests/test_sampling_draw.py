"""The seeded draw of token choice, reproducible and unbiased, and token choice at its edges."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from modelzoo.generation.sampling import (TokenChoice, apply_temperature, draw, keep_top_k, keep_top_p, splitmix64,
                                          uniforms)
from sampling_batches import NEG_INF, batch, same

# Five-token distribution for the statistical tests.
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)


def chi_square_sf_df4(x: float) -> float:
    """Survival function of chi-square with 4 degrees of freedom (closed form: e^{-x/2} (1 + x/2))."""
    return math.exp(-x / 2) * (1 + x / 2)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def sample(choice: TokenChoice, logits_row: torch.Tensor, sample_index: torch.Tensor, lengths: torch.Tensor):
    """Draws for many rows sharing one logits row (no penalties, so no sequences needed)."""
    logits = logits_row.float().expand(len(sample_index), -1)
    return choice.choose(logits, None, lengths, sample_index)


# ---- the seeded draw ----------------------------------------------------------------------------------------

def test_uniforms_are_splitmix64_of_the_key():
    """The int64 tensor hash equals the same hash in Python's exact integers (wrapping products, logical shifts)."""
    keys = [(0, 0, 0), (0, 1, 0), (0, 0, 1), (5, 123456, 789), (2 ** 64 + 7, 2 ** 63 - 1, 2 ** 62), (1, 3, 17)]
    for seed, index, position in keys:
        h = splitmix64(index * 0x9E3779B97F4A7C15 + splitmix64(seed + 0x9E3779B97F4A7C15))
        h = splitmix64(position * 0xD1B54A32D192ED03 + h)
        u = uniforms(seed, torch.tensor([index]), torch.tensor([position]))
        assert u.dtype == torch.float64 and float(u) == (h >> 11) / 2 ** 53
    assert splitmix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0
    u = uniforms(0, torch.arange(100_000), torch.zeros(100_000, dtype=torch.long))
    assert 0 <= float(u.min()) and float(u.max()) < 1


def test_same_key_same_token_whatever_the_batch():
    logits, _, lengths = batch(64, 30, 50, seed=6)
    index = torch.randperm(10_000, generator=torch.Generator().manual_seed(0))[:64]
    choice = TokenChoice(temperature=1.3, top_k=20, top_p=0.95, seed=11)
    tokens = choice.choose(logits, None, lengths, index)
    order = torch.randperm(64)
    assert torch.equal(choice.choose(logits[order], None, lengths[order], index[order]), tokens[order])
    split = torch.cat([choice.choose(logits[a:b], None, lengths[a:b], index[a:b])
                       for a, b in ((0, 1), (1, 8), (8, 9), (9, 64))])
    assert torch.equal(split, tokens)
    # A single row alone, e.g. after a resume, draws what it drew inside the batch.
    assert int(choice.choose(logits[40:41], None, lengths[40:41], index[40:41])) == int(tokens[40])


def test_different_keys_give_independent_draws():
    """Over a uniform 500-token distribution two unrelated streams agree on 1/500 of rows (sd 0.001 over 2000
    rows); 1% agreement (8 sd) would mean the streams are related."""
    n, vocab = 2000, 500
    logits = torch.zeros(vocab)
    index, length = torch.arange(n), torch.full((n,), 10)

    def tokens(seed=0, shift_index=0, shift_length=0):
        return sample(TokenChoice(temperature=1.0, seed=seed), logits, index + shift_index, length + shift_length)

    base = tokens()
    related = {"seed": tokens(seed=1), "sample index": tokens(shift_index=n), "step": tokens(shift_length=1),
               "seed vs shifted index": tokens(seed=1, shift_index=1),
               "index vs step": tokens(shift_index=1, shift_length=-1), "seed 2**40": tokens(seed=2 ** 40)}
    assert len(set(base.tolist())) > 450  # 500 (1 - e^-4) = 491 distinct expected
    for name, other in related.items():
        assert (other == base).double().mean() < 0.01, name
    assert torch.equal(tokens(), base)


@pytest.mark.parametrize("axis", ["sample index", "step"])
def test_empirical_distribution_matches_probabilities(axis):
    """20,000 draws over 5 tokens: chi-square (4 degrees of freedom) with a p-value above 1e-4, and every
    frequency within 5 standard deviations (sqrt(p (1 - p) / n) <= 0.0035) of its probability."""
    n = 20_000
    keys = torch.arange(n)
    index, length = (keys, torch.full((n,), 7)) if axis == "sample index" else (torch.full((n,), 3), keys)
    for seed in (0, 12345):
        tokens = sample(TokenChoice(temperature=1.0, seed=seed), PROBS.log(), index, length)
        assert chi_square_sf_df4(chi_square(tokens, PROBS)) > 1e-4
        freq = torch.bincount(tokens, minlength=5).double() / n
        assert ((freq - PROBS).abs() <= 5 * (PROBS * (1 - PROBS) / n).sqrt()).all()


def test_filtered_tokens_are_never_drawn():
    n = 20_000
    index, length = torch.arange(n), torch.full((n,), 5)
    logits = PROBS.log()
    # top_k 2 keeps tokens 0 and 1, in ratio 2:1; top_p 0.6 keeps the same two (0.5 < 0.6 <= 0.75).
    for choice in (TokenChoice(temperature=1.0, top_k=2), TokenChoice(temperature=1.0, top_p=0.6)):
        tokens = sample(choice, logits, index, length)
        assert set(tokens.tolist()) == {0, 1}
        assert abs(float((tokens == 0).double().mean()) - 2 / 3) < 5 * math.sqrt(2 / 9 / n)
    # -inf logits, first and last included.
    gapped = torch.tensor([NEG_INF, 0.0, NEG_INF, 1.0, NEG_INF])
    assert set(sample(TokenChoice(temperature=2.0), gapped, index, length).tolist()) == {1, 3}


def test_draw_at_the_extremes_of_u():
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)  # exact in binary: the cut is at u = 0.25
    u = torch.tensor([0.0, 0.25 - 2 ** -53, 0.25, 1 - 2 ** -53], dtype=torch.float64)
    assert draw(probs, u).tolist() == [2, 2, 4, 4]
    # Weights need not be normalised, and float32 rounding of the total is harmless.
    assert draw(probs * 3, u).tolist() == [2, 2, 4, 4]
    one = torch.tensor([[0.0, 0.0, 1e-30, 0.0]] * 2)
    assert draw(one, torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64)).tolist() == [2, 2]
    # Nothing to draw from (softmax of all -inf is NaN): token 0.
    empty = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3])
    assert draw(empty, torch.tensor([0.5, 0.5], dtype=torch.float64)).tolist() == [0, 0]


# ---- edge cases ---------------------------------------------------------------------------------------------

def test_top_k_above_vocab_and_top_p_one_change_nothing():
    logits, _, lengths = batch(8, 3, 10, seed=8)
    index = torch.arange(8)
    plain = TokenChoice(temperature=0.9, seed=2)
    for choice in (TokenChoice(temperature=0.9, seed=2, top_k=1000), TokenChoice(temperature=0.9, seed=2, top_p=1.0)):
        assert same(choice.process(logits, None, lengths), plain.process(logits, None, lengths))
        assert torch.equal(choice.choose(logits, None, lengths, index), plain.choose(logits, None, lengths, index))


def test_very_small_temperature_is_argmax():
    logits, _, lengths = batch(50, 3, 40, seed=9)
    index = torch.arange(50)
    assert same(apply_temperature(logits, 1e-6), TemperatureLogitsWarper(1e-6)(None, logits.clone()))
    for temperature in (1e-6, 1e-38):  # 1e-38 overflows logits / T to inf: rows are shifted by their max first
        tokens = TokenChoice(temperature=temperature).choose(logits, None, lengths, index)
        assert torch.equal(tokens, logits.argmax(-1)), temperature
    assert not torch.isnan(apply_temperature(logits, 1e-38).softmax(-1)).any()


def test_all_equal_logits():
    n = 20_000
    flat = torch.zeros(4)
    tokens = sample(TokenChoice(temperature=1.0), flat, torch.arange(n), torch.full((n,), 2))
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert ((freq - 0.25).abs() <= 5 * math.sqrt(0.25 * 0.75 / n)).all()  # 5 standard deviations
    assert int(TokenChoice().choose(flat[None], None, torch.ones(1, dtype=torch.long), torch.zeros(1).long())) == 0
    # Ties at the top-k cut all stay, as in transformers; at the top-p cut as many stay as in transformers,
    # the highest ids (stable order).
    equal = torch.zeros(3, 40)
    equal[1, 30:] = -1.0  # a tied block, and lower scores
    assert same(keep_top_k(equal, 3), TopKLogitsWarper(3)(None, equal.clone()))
    assert torch.isfinite(keep_top_k(equal, 3)).sum(-1).tolist() == [40, 30, 40]
    ours = keep_top_p(equal, 0.5)
    theirs = TopPLogitsWarper(0.5)(None, equal.clone())
    assert torch.isfinite(ours).sum(-1).tolist() == torch.isfinite(theirs).sum(-1).tolist()
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == list(range(20, 40))


def test_every_token_banned_falls_back_to_argmax():
    # n = 1 bans every token already in the row; here that is the whole vocabulary.
    sequences = torch.tensor([[0, 1, 2, 0], [2, 2, 2, 2]])
    lengths = torch.tensor([3, 4])
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    for temperature in (0.0, 1.0):
        choice = TokenChoice(temperature=temperature, no_repeat_ngram_size=1)
        tokens = choice.choose(logits, sequences, lengths, torch.arange(2))
        assert tokens[0] == 0  # all banned: argmax of all -inf, as transformers' greedy search
        assert tokens[1] != 2  # 2 is banned
    assert TokenChoice(no_repeat_ngram_size=1).choose(logits, sequences, lengths, torch.arange(2)).tolist() == [0, 1]


def test_half_precision_logits():
    logits, sequences, lengths = batch(6, 10, 16, seed=10)
    choice = TokenChoice(temperature=0.8, top_p=0.9, repetition_penalty=1.3, no_repeat_ngram_size=2, seed=4)
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        tokens = choice.choose(low, sequences, lengths, torch.arange(6))
        assert tokens.dtype == torch.long
        assert torch.equal(tokens, choice.choose(low.float(), sequences, lengths, torch.arange(6)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_what_cpu_draws():
    logits, sequences, lengths = batch(256, 40, 300, seed=11)
    index = torch.arange(256) * 7919
    choice = TokenChoice(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, no_repeat_ngram_size=3, seed=5)
    cuda = torch.device("cuda")
    assert torch.equal(uniforms(5, index.to(cuda), lengths.to(cuda)).cpu(), uniforms(5, index, lengths))
    on_gpu = choice.choose(logits.to(cuda), sequences.to(cuda), lengths.to(cuda), index.to(cuda)).cpu()
    assert torch.equal(on_gpu, choice.choose(logits, sequences, lengths, index))


def test_choose_rows_equals_each_rows_own_token_choice():
    """Rows with their own temperature, top_p and seed (greedy ones among them), chosen together: each row's
    token and scores are those of a TokenChoice holding that row's options alone (same job-wide top-k and
    repetition penalty)."""
    from modelzoo.generation.sampling import RowSampling, seed_key

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    sequences, lengths = torch.randint(0, 50, (6, 12)), torch.full((6,), 12)
    index = torch.arange(6) + 100
    options = [(0.0, 1.0, 0), (0.7, 1.0, 3), (1.3, 0.9, 3), (0.7, 0.5, 9), (0.0, 1.0, 5), (2.0, 0.8, 1)]
    job = TokenChoice(temperature=0.7, top_k=20, seed=3, repetition_penalty=1.2, min_p=0.05, rows_sample=True,
                      rows_top_p=True)
    rows = RowSampling(torch.tensor([t for t, _, _ in options], dtype=torch.float32),
                       torch.tensor([RowSampling.cut(p) for _, p, _ in options], dtype=torch.float32),
                       torch.tensor([seed_key(s) for _, _, s in options]))
    tokens, scores = job.choose_rows(logits, sequences, lengths, index, rows)
    for b, (temperature, top_p, seed) in enumerate(options):
        sampled = temperature > 0
        own = TokenChoice(temperature=temperature, top_k=20 if sampled else 0, top_p=top_p if sampled else 1.0,
                          seed=seed, repetition_penalty=1.2, min_p=0.05 if sampled else 0.0)
        row = slice(b, b + 1)
        want_scores = own.process(logits[row], sequences[row], lengths[row])
        assert torch.equal(scores[b], want_scores[0]), b
        assert tokens[b] == own.choose_from_scores(want_scores, lengths[row], index[row])[0], b


def test_output_penalties_count_generated_tokens_only():
    """presence / frequency penalties (the OpenAI API's): each generated token's count, never the prompt's."""
    from modelzoo.generation.sampling import apply_output_penalties

    logits, sequences, lengths = batch(5, 30, 16, seed=8)
    prompt_lengths = torch.tensor([3, 10, 16, 0, 7])
    got = apply_output_penalties(logits, sequences, lengths, prompt_lengths, presence=0.4, frequency=0.3)
    want = logits.clone()
    for row in range(5):
        generated = sequences[row, int(prompt_lengths[row]): int(lengths[row])].tolist()
        for token in set(generated):
            want[row, token] -= 0.3 * generated.count(token)
            want[row, token] -= 0.4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    choice = TokenChoice(presence_penalty=0.4, frequency_penalty=0.3)
    assert choice.needs_history and not choice.is_plain_greedy
    with pytest.raises(ValueError, match="prompt length"):
        choice.process(logits, sequences, lengths)


def test_per_row_draws_under_a_token_mask_follow_the_masked_softmax():
    """The per-row path (rows of their own temperatures side by side) after a grammar's token bitmask: 20,000 draws
    of one step per temperature over 6 tokens, 2 of them masked out. The masked tokens never come, and the others
    follow softmax(logits / temperature) over the allowed ones: chi-square (3 degrees of freedom, closed form)
    with a p-value above 1e-4."""
    from modelzoo.generation.sampling import RowSampling, seed_key
    from modelzoo.generation.structured import apply_token_bitmask

    n, logits_row = 20_000, torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    allowed = torch.tensor([True, True, False, True, False, True])
    bitmask = torch.tensor([int(sum(1 << i for i in range(6) if allowed[i]))], dtype=torch.int32).expand(n, 1)
    choice = TokenChoice(rows_sample=True)
    for temperature in (0.6, 1.0, 1.7):
        logits = apply_token_bitmask(logits_row.expand(n, -1), bitmask)
        rows = RowSampling(torch.full((n,), temperature), torch.full((n,), -1.0), torch.full((n,), seed_key(11)))
        tokens, _ = choice.choose_rows(logits, None, torch.full((n,), 9), torch.arange(n), rows)
        assert not (tokens[:, None] == torch.nonzero(~allowed).flatten()[None]).any()
        probs = torch.softmax(logits_row[allowed].double() / temperature, -1)
        counts = torch.bincount(tokens, minlength=6)[allowed].double()
        statistic = float(((counts - probs * n) ** 2 / (probs * n)).sum())
        p_value = math.erfc(math.sqrt(statistic / 2)) + math.sqrt(2 * statistic / math.pi) * math.exp(-statistic / 2)
        assert p_value > 1e-4, (temperature, counts.tolist(), (probs * n).tolist())
