"""The C++ kernel adding each row's own LoRA update: the masked formula whatever the batch; bad inputs refused."""
from __future__ import annotations

import pytest
import torch

from modelzoo.cpu.kernels import cpu_kernels

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels could not be built here")


def _update_layout(in_features: int, pieces: list[tuple[int, int]], ranks: list[int], seed: int = 0):
    """A stacked LoRA layout for the kernel: adapter g has rank ranks[g] on every piece (output rows) of `pieces`.
    Returns a (C, Kp), b_t (C, N), segments (S, 5) and each column's adapter (C,)."""
    generator = torch.Generator().manual_seed(seed)
    width = pieces[-1][1]
    columns = sum(ranks) * len(pieces)
    a = torch.zeros(columns, -(-in_features // 16) * 16)
    a[:, :in_features] = torch.randn(columns, in_features, generator=generator)
    b_t = torch.zeros(columns, width)
    segments, owner, column = [], [], 0
    for adapter, rank in enumerate(ranks):
        for first, end in pieces:
            b_t[column: column + rank, first:end] = torch.randn(rank, end - first, generator=generator)
            segments.append((adapter, column, column + rank, first, end))
            owner += [adapter] * rank
            column += rank
    return a, b_t, torch.tensor(segments), torch.tensor(owner)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,pieces", [(64, [(0, 48)]), (37, [(0, 20), (20, 27), (27, 34)])])
def test_lora_update_kernel_adds_each_rows_own_adapter_whatever_the_batch(dtype, in_features, pieces):
    """out[m] += B_g A_g x[m] for row m's adapter g only (-1, or an adapter with no update here: unchanged), equal
    to float64 of the masked formula; a row's bits do not depend on the rows beside it."""
    a, b_t, segments, owner = _update_layout(in_features, pieces, ranks=[4, 1, 6])
    rows = 37
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    row_adapter = torch.tensor([(row * 7) % 5 - 1 for row in range(rows)])  # -1 .. 3; 3 has no update
    start = torch.randn(rows, pieces[-1][1], generator=generator).to(dtype)
    out = start.clone()
    cpu_kernels().lora_update_(out, x, row_adapter, a, b_t, segments)
    mask = (row_adapter[:, None] == owner).double()
    expected = start.double() + ((x.double() @ a[:, :in_features].double().T) * mask) @ b_t.double()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    untouched = row_adapter >= 3
    assert torch.equal(out[untouched | (row_adapter == -1)], start[untouched | (row_adapter == -1)])
    for begin, end in [(0, 1), (5, 12), (9, 37)]:
        part = start[begin:end].clone()
        cpu_kernels().lora_update_(part, x[begin:end].contiguous(), row_adapter[begin:end].contiguous(), a, b_t,
                                   segments)
        assert torch.equal(part, out[begin:end]), (begin, end)


@needs_kernels
@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(x=t["x"][:, :-8].contiguous()), "a must be contiguous float32"),
    (lambda t: t.update(x=t["x"][:, :-1]), "x must be a contiguous"),
    (lambda t: t.update(out=t["out"].double()), "out must be contiguous"),
    (lambda t: t.update(row_adapter=t["row_adapter"].int()), "row_adapter must be contiguous int64"),
    (lambda t: t.update(row_adapter=t["row_adapter"] - 2), "row_adapter holds -2"),
    (lambda t: t.update(b_t=t["b_t"][:, :-1].contiguous()), "b_t must be contiguous float32"),
    (lambda t: t.update(a=t["a"][:, :-16].contiguous()), "a must be contiguous float32"),
    (lambda t: t.update(segments=t["segments"][:, :4].contiguous()), "segments must be contiguous int64"),
    (lambda t: t["segments"].__setitem__((0, 4), 999), "segment 0 is out of range"),
    (lambda t: t["segments"].__setitem__((1, 0), -1), "segment 1 is out of range"),
])
def test_lora_update_kernel_rejects_bad_inputs(change, message):
    a, b_t, segments, _ = _update_layout(24, [(0, 16)], ranks=[2, 3])
    tensors = {"out": torch.zeros(4, 16), "x": torch.randn(4, 24), "row_adapter": torch.tensor([0, 1, -1, 0]),
               "a": a, "b_t": b_t, "segments": segments}
    change(tensors)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels().lora_update_(tensors["out"], tensors["x"], tensors["row_adapter"], tensors["a"], tensors["b_t"],
                                   tensors["segments"])
