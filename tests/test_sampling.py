"""Token choice against transformers' logits processors: each processor, their chain, greedy with penalties."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from modelzoo.generation.sampling import (TokenChoice, apply_repetition_penalty, apply_temperature,
                                          ban_repeated_ngrams, greedy_tokens, keep_top_k, keep_top_p)
from modelzoo.job.params import parse_params
from sampling_batches import NEG_INF, batch, same


def per_row(processor, logits, sequences, lengths) -> torch.Tensor:
    """transformers' processor applied row by row, each fed only its valid prefix."""
    return torch.cat([processor(sequences[b:b + 1, : int(lengths[b])], logits[b:b + 1].clone())
                      for b in range(len(logits))])


# ---- greedy: argmax's index ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 33, 49152])
def test_greedy_tokens_are_argmax_on_ties_nan_and_all_inf_rows(dtype, vocab):
    """The first index of the largest value, as argmax (and transformers' greedy search) picks it: on rows of many ties,
    a row of -inf (token 0), rows with a NaN (the first NaN's index), on 1 and 2 threads."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randint(-3, 3, (9, vocab), generator=generator).float()
    scores[2] = float("-inf")
    scores[5, vocab // 2] = scores[5, vocab - 1] = float("nan")
    scores[6] = float("nan")
    scores = scores.to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            tokens = greedy_tokens(scores)
            assert torch.equal(tokens, scores.argmax(-1)) and tokens.dtype == torch.long
            assert tokens[2] == 0 and tokens[5] == vocab // 2 and tokens[6] == 0
    finally:
        torch.set_num_threads(threads)


# ---- each processor equals transformers' -------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.3, 2.0])
@pytest.mark.parametrize("shape", [(1, 1, 7), (5, 12, 10), (8, 40, 50)])
def test_repetition_penalty_matches_transformers(penalty, shape):
    logits, sequences, lengths = batch(*shape, seed=shape[1])
    ours = apply_repetition_penalty(logits, sequences, lengths, penalty)
    theirs = per_row(RepetitionPenaltyLogitsProcessor(penalty), logits, sequences, lengths)
    assert same(ours, theirs)
    assert not torch.equal(ours, logits)
    if shape[1] > 1:  # the garbage past the length must matter, or this test proves nothing about lengths
        assert not same(theirs, RepetitionPenaltyLogitsProcessor(penalty)(sequences, logits.clone()))
    # Out-of-vocabulary and negative garbage past the length is ignored, never indexed.
    for garbage in (-1, shape[2] + 3):
        _, bad, _ = batch(*shape, seed=shape[1], garbage=garbage)
        assert same(apply_repetition_penalty(logits, bad, lengths, penalty), theirs)


@pytest.mark.parametrize("ngram_size", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 1, 5), (2, 2, 5), (6, 15, 4), (8, 40, 6)])
def test_no_repeat_ngram_matches_transformers(ngram_size, shape):
    logits, sequences, lengths = batch(*shape, seed=7 * shape[1] + ngram_size)
    lengths[1 % shape[0]] = min(ngram_size - 1, shape[1]) or 1  # a row shorter than n (when possible)
    ours = ban_repeated_ngrams(logits, sequences, lengths, ngram_size)
    theirs = per_row(NoRepeatNGramLogitsProcessor(ngram_size), logits, sequences, lengths)
    assert same(ours, theirs)
    if shape[1] >= 15:  # small vocabularies and long rows: n-grams repeat, and garbage would ban more
        assert torch.isneginf(ours).any()
        assert not same(theirs, NoRepeatNGramLogitsProcessor(ngram_size)(sequences, logits.clone()))
    for garbage in (-1, shape[2] + 3):
        _, bad, _ = batch(*shape, seed=7 * shape[1] + ngram_size, garbage=garbage)
        assert same(ban_repeated_ngrams(logits, bad, lengths, ngram_size), theirs)


def test_no_repeat_ngram_by_hand():
    # Row 0 = 1 2 3 1 2 (then garbage 3 4): the last bigram prefix "2" was followed by 3 -> ban 3 only.
    # Row 1 = 5 5 5 (n=2): prefix "5" was followed by 5 -> ban 5.  Row 2 = 7: shorter than 2 -> nothing.
    sequences = torch.tensor([[1, 2, 3, 1, 2, 3, 4], [5, 5, 5, 2, 3, 2, 3], [7, 1, 2, 1, 2, 1, 2]])
    lengths = torch.tensor([5, 3, 1])
    banned = torch.isneginf(ban_repeated_ngrams(torch.zeros(3, 8), sequences, lengths, 2))
    assert banned.nonzero().tolist() == [[0, 3], [1, 5]]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(temperature):
    logits, _, _ = batch(6, 1, 30, seed=1)
    logits[0, :3] = NEG_INF
    ours = apply_temperature(logits, temperature)
    assert same(ours, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    if temperature != 1.0:
        assert not torch.equal(ours, logits)


@pytest.mark.parametrize("top_k", [1, 3, 29, 30, 500])
def test_top_k_matches_transformers(top_k):
    logits, _, _ = batch(6, 1, 30, seed=2)
    logits[0, :10] = NEG_INF  # fewer finite scores than k in that row
    ours = keep_top_k(logits, top_k)
    assert same(ours, TopKLogitsWarper(top_k)(None, logits.clone()))
    kept = torch.isfinite(ours).sum(-1)
    assert kept[1:].tolist() == [min(top_k, 30)] * 5


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8, 0.9, 0.99, 1.0])
def test_top_p_matches_transformers(top_p):
    logits, _, _ = batch(16, 1, 40, seed=3)
    logits[0, 5:] = NEG_INF
    ours = keep_top_p(logits, top_p)
    assert same(ours, TopPLogitsWarper(top_p)(None, logits.clone()))
    kept = torch.isfinite(ours).sum(-1)
    assert (kept >= 1).all()
    if top_p < 1.0:
        assert (kept[1:] < 40).all()
    # Kept mass reaches top_p, and dropping the least probable kept token would not.
    probs = logits.softmax(-1)
    mass = (probs * torch.isfinite(ours)).sum(-1)
    smallest = torch.where(torch.isfinite(ours), probs, 1.0).amin(-1)
    assert (mass >= top_p - 1e-6).all() and ((mass - smallest < top_p + 1e-6) | (kept == 1)).all()


@pytest.mark.parametrize("temperature, top_k, top_p, penalty, ngram, min_p", [
    (1.0, 0, 1.0, 1.0, 0, 0.0), (0.7, 5, 0.8, 1.2, 2, 0.0), (1.5, 0, 0.9, 0.8, 1, 0.0), (0.4, 20, 1.0, 1.0, 3, 0.0),
    (1.0, 3, 0.3, 1.5, 0, 0.0), (1.2, 0, 1.0, 1.0, 0, 0.1), (0.8, 10, 0.9, 1.3, 2, 0.3)])
def test_pipeline_matches_transformers_chain(temperature, top_k, top_p, penalty, ngram, min_p):
    logits, sequences, lengths = batch(10, 25, 30, seed=4)
    logits[2, :4] = NEG_INF
    chain = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    chain += [NoRepeatNGramLogitsProcessor(ngram)] if ngram else []
    chain += [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    chain += [TopKLogitsWarper(top_k)] if top_k else []
    chain += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    chain += [MinPLogitsWarper(min_p)] if min_p else []
    choice = TokenChoice(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty,
                         no_repeat_ngram_size=ngram, min_p=min_p)
    ours = choice.process(logits, sequences, lengths)
    theirs = per_row(LogitsProcessorList(chain), logits, sequences, lengths)
    assert same(ours, theirs)
    assert torch.equal(ours.softmax(-1), theirs.softmax(-1))
    # Drawn tokens always come from the filtered distribution.
    tokens = choice.choose(logits, sequences, lengths, torch.arange(10))
    assert torch.isfinite(theirs.gather(1, tokens[:, None])).all()


@pytest.mark.parametrize("penalty, ngram", [(1.0, 2), (1.8, 0), (0.6, 1), (1.5, 3)])
def test_greedy_with_penalties_is_argmax_of_transformers_scores(penalty, ngram):
    logits, sequences, lengths = batch(32, 20, 12, seed=5)
    chain = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    chain += [NoRepeatNGramLogitsProcessor(ngram)] if ngram else []
    choice = TokenChoice(repetition_penalty=penalty, no_repeat_ngram_size=ngram)
    assert choice.greedy and not choice.is_plain_greedy
    tokens = choice.choose(logits, sequences, lengths, torch.arange(32))
    expected = per_row(LogitsProcessorList(chain), logits, sequences, lengths).argmax(-1)
    assert torch.equal(tokens, expected)
    assert not torch.equal(tokens, logits.argmax(-1))  # the penalties changed some choices
    # Greedy ignores the seed.
    assert torch.equal(TokenChoice(repetition_penalty=penalty, no_repeat_ngram_size=ngram, seed=9).choose(
        logits, sequences, lengths, torch.arange(32) + 100), tokens)


def test_plain_greedy_is_argmax_of_raw_logits():
    choice = TokenChoice()
    assert choice.is_plain_greedy and not choice.needs_history
    logits = torch.randn(7, 20, dtype=torch.bfloat16)
    assert torch.equal(choice.choose(logits, None, torch.ones(7, dtype=torch.long), torch.arange(7)),
                       logits.argmax(-1))
    assert not TokenChoice(temperature=1.0).is_plain_greedy


def test_from_options_and_validation():
    raw = {"model": {"start_token": 1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 3,
                     "repetition_penalty": 1.1, "no_repeat_ngram_size": 3},
           "inference_input": {"data_dir": "d", "batch_size": 2}}
    choice = TokenChoice.from_options(parse_params(raw).model.generation_defaults())
    assert choice == TokenChoice(temperature=0.8, top_k=40, top_p=0.95, seed=3, repetition_penalty=1.1,
                                 no_repeat_ngram_size=3)
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1},
                {"repetition_penalty": 0.0}, {"no_repeat_ngram_size": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TokenChoice(**bad)
    with pytest.raises(ValueError, match="sequences"):
        TokenChoice(repetition_penalty=1.2).choose(torch.zeros(1, 4), None, torch.ones(1, dtype=torch.long),
                                                   torch.zeros(1, dtype=torch.long))
