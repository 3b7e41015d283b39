"""Prepacked decode GEMMs: same outputs as nn.Linear, tie kept, skipped when over the memory budget."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from modelzoo.models.packed_linear import PackedLinear, pack_linear_layers, packing_available

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no MKL packed GEMM")


def test_packed_linear_matches_linear_for_its_rows_and_falls_back_for_others():
    """MKL's packed and plain GEMMs sum in different orders on some CPUs (AMD): close, not bit-equal."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    packed = PackedLinear(linear, rows=[8, 3])
    with torch.inference_mode():
        for shape in ((8, 1, 48), (8, 48), (3, 1, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(3, 7, 48)  # prefill-like: neither 8 nor 3 rows, the plain path
        assert torch.equal(packed(x), linear(x))


def test_copies_packed_for_fewer_rows_give_the_same_rows():
    """The decode batch's last steps use a copy packed for fewer rows: the same bits per row."""
    torch.manual_seed(1)
    linear = nn.Linear(576, 1536)
    packed = PackedLinear(linear, rows=[32, 8])
    x = torch.randn(32, 576)
    with torch.inference_mode():
        assert torch.equal(packed(x[:8].contiguous()), packed(x)[:8])


def test_pack_swaps_every_linear_and_keeps_shared_weights():
    model = nn.Sequential(nn.Embedding(30, 16), nn.Linear(16, 16), nn.Linear(16, 30, bias=False))
    model[2].weight = model[0].weight  # a tied LM head
    assert pack_linear_layers(model, rows=[4], budget_bytes=1 << 30)
    assert all(isinstance(model[i], PackedLinear) for i in (1, 2))
    assert model[2].weight is model[0].weight
    assert set(model.state_dict()) == {"0.weight", "1.weight", "1.bias", "2.weight"}  # packed copies not saved


def test_pack_is_skipped_over_budget():
    model = nn.Sequential(nn.Linear(64, 64))
    assert not pack_linear_layers(model, rows=[4], budget_bytes=1000)
    assert type(model[0]) is nn.Linear
