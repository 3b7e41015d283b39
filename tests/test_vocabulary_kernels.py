"""Sampling's whole-vocabulary passes in C++ (token_draws.cpp): the radix sort equal to torch.sort(stable=True), the
draw equal to draw()'s PyTorch spelling, and token choice the same through either."""
from __future__ import annotations

import pytest
import torch

import modelzoo.generation.sampling as sampling
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.generation.sampling import TokenChoice, draw, keep_top_p_cut, uniforms
from sampling_batches import NEG_INF, batch, same

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here")

SPECIALS = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), NEG_INF, 1e-45, -1e-45, 3.0, -3.0,
                         torch.finfo(torch.float32).max, torch.finfo(torch.float32).min])


def rows_of(kind: str) -> torch.Tensor:
    """(B, V) float32 rows of one kind: distinct values, many ties, the special values, a masked vocabulary."""
    gen = torch.Generator().manual_seed(len(kind))
    if kind == "random":
        return torch.randn(24, 5000, generator=gen) * 3
    if kind == "ties":
        return torch.randint(-4, 4, (24, 3000), generator=gen).float()
    if kind == "specials":
        return SPECIALS[torch.randint(0, len(SPECIALS), (24, 700), generator=gen)]
    masked = torch.randn(24, 4000, generator=gen)  # top-k or a token mask before top-p: mostly -inf
    return masked.masked_fill(torch.rand(24, 4000, generator=gen) < 0.98, NEG_INF)


def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token choice as PyTorch's ops spell it, kernels or not."""
    monkeypatch.setattr(sampling, "vocabulary_kernels", lambda scores: None)


@pytest.mark.parametrize("kind", ["random", "ties", "specials", "masked"])
def test_sort_rows_is_torch_stable_sort(kind):
    """The same indices (ties, -0.0 with 0.0 and NaNs among themselves in index order, NaN last) and the same values
    bit for bit (-0.0 and NaN payloads kept)."""
    scores = rows_of(kind)
    values, indices = torch.sort(scores, dim=-1, stable=True)
    ours, order = kernels.sort_rows(scores)
    assert order.dtype == torch.long and torch.equal(order, indices)
    assert torch.equal(ours.view(torch.int32), values.view(torch.int32))


def test_sort_rows_of_one_value_and_of_none():
    one = torch.full((3, 9), 2.5)
    assert torch.equal(kernels.sort_rows(one)[1], torch.arange(9).expand(3, 9))
    values, indices = kernels.sort_rows(torch.empty(2, 0))
    assert values.shape == indices.shape == (2, 0)


@pytest.mark.parametrize("kind", ["random", "ties", "specials", "masked"])
def test_draw_rows_is_draws_torch_spelling(kind, monkeypatch):
    """Every u of a row's softmax, and the extremes of u, pick what the float64 cumsum and searchsorted pick."""
    probs = (rows_of(kind) / 0.7).softmax(-1)
    u = uniforms(5, torch.arange(len(probs)), torch.full((len(probs),), 40))
    u[:4] = torch.tensor([0.0, 2 ** -53, 0.5, 1 - 2 ** -53], dtype=torch.float64)
    ours = draw(probs, u)
    torch_path(monkeypatch)
    assert torch.equal(ours, draw(probs, u))


def test_draw_rows_at_its_edges(monkeypatch):
    """Unnormalised weights, a last positive weight far from the end, rows of zeros or NaN: token for token."""
    probs = torch.zeros(7, 6)
    probs[1, 3] = float("nan")
    probs[2, 5] = 0.5
    probs[3] = 1.0
    probs[4, 0] = 1e-30
    probs[5, 2:4] = 0.25
    probs[6, 1] = 3.0
    u = torch.tensor([0.5, 0.5, 0.999999, 1 - 2 ** -53, 0.0, 0.99, 0.25], dtype=torch.float64)
    ours = draw(probs, u)
    assert ours.tolist() == [0, 0, 5, 5, 0, 3, 1]
    torch_path(monkeypatch)
    assert torch.equal(draw(probs, u), ours)


@pytest.mark.parametrize("cut", [0.01, 0.1, 0.5, 0.95])
def test_top_p_through_the_kernels_is_the_torch_path(cut, monkeypatch):
    logits, _, _ = batch(32, 1, 3000, seed=9)
    logits[0, 7:] = NEG_INF
    logits[1] = 1.0  # every token tied
    ours = keep_top_p_cut(logits, cut)
    torch_path(monkeypatch)
    assert same(ours, keep_top_p_cut(logits, cut))


def test_token_choice_through_the_kernels_is_the_torch_path(monkeypatch):
    """Whole choices (penalty, temperature, top-k, top-p, min-p, the draw) over a 49k vocabulary: the same tokens."""
    logits, sequences, lengths = batch(12, 40, 49152, seed=10)
    choice = TokenChoice(temperature=0.8, top_p=0.9, repetition_penalty=1.2, min_p=0.01, seed=3)
    index = torch.arange(12)
    ours = choice.choose(logits, sequences, lengths, index)
    plain = TokenChoice(temperature=1.3, top_p=0.5, seed=4).choose(logits, sequences, lengths, index)
    torch_path(monkeypatch)
    assert torch.equal(choice.choose(logits, sequences, lengths, index), ours)
    assert torch.equal(TokenChoice(temperature=1.3, top_p=0.5, seed=4).choose(logits, sequences, lengths, index), plain)


@pytest.mark.parametrize("call, message", [
    (lambda: kernels.sort_rows(torch.zeros(3, 4, dtype=torch.float64)), "contiguous float32 CPU rows"),
    (lambda: kernels.sort_rows(torch.zeros(12)), "contiguous float32 CPU rows"),
    (lambda: kernels.sort_rows(torch.zeros(4, 3).t()), "contiguous float32 CPU rows"),
    (lambda: kernels.draw_rows(torch.zeros(2, 3), torch.zeros(2)), "u must be float64"),
    (lambda: kernels.draw_rows(torch.zeros(2, 3), torch.zeros(3, dtype=torch.float64)), "one per row"),
    (lambda: kernels.draw_rows(torch.zeros(2, 0), torch.zeros(2, dtype=torch.float64)), "no columns"),
])
def test_bad_inputs_are_refused(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()
