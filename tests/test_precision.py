"""The precision policy (modelzoo/cpu/precision.py): which policy a dtype gets on CPUs with and without native
bfloat16; its GEMMs (bfloat16 inputs, or 16-bit weights, with float32 outputs), batch invariant; float32 queries over
a 16-bit KV cache."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch
from torch import nn

from modelzoo.cpu import precision
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models.layers import GatedMLP
from precision_policies import (BF16, BF16_GEMMS, F16, F32, HALF, MIXED, WIDENED, bf16_layout, needs_bf16,
                                needs_kernels)


def assert_rows_do_not_depend_on_the_batch(layer: nn.Module, x: torch.Tensor, got: torch.Tensor,
                                           generator: torch.Generator) -> None:
    """layer's rows of x (rows, K) are got's bits wherever x sits in a larger call (first, inside, last)."""
    rows, in_features = x.shape
    larger = torch.randn(rows + 70, in_features, generator=generator)
    for offset in (0, 5, 70):
        larger[offset: offset + rows] = x
        assert torch.equal(layer(larger)[offset: offset + rows], got)
        larger[offset: offset + rows] = torch.randn(rows, in_features, generator=generator)


@pytest.mark.parametrize("flags, kernel, dtype, device, int8, compiled, expected", [
    (set(), False, BF16, "cpu", False, False, HALF[BF16]),
    (set(), False, F16, "cpu", False, False, HALF[F16]),
    (set(), False, BF16, "cpu", True, False, WIDENED[BF16]),  # int8 weights: no 16-bit GEMM
    (set(), False, F16, "cpu", False, True, WIDENED[F16]),  # compiled step: no C++ GEMM
    ({"avx512_bf16"}, True, BF16, "cpu", False, False, MIXED),
    ({"amx_bf16", "avx512_bf16"}, True, BF16, "cpu", False, False, MIXED),
    ({"avx512_bf16"}, False, BF16, "cpu", False, False, precision.PrecisionPolicy(BF16, BF16, BF16)),  # no kernels
    ({"avx512_bf16"}, True, BF16, "cpu", True, False, precision.PrecisionPolicy(BF16, BF16, BF16)),  # int8 weights
    ({"avx512_bf16"}, True, BF16, "cpu", False, True, precision.PrecisionPolicy(BF16, BF16, BF16)),  # compiled step
    ({"avx512_bf16"}, True, F16, "cpu", False, False, HALF[F16]),
    ({"avx512_fp16"}, True, F16, "cpu", False, False, precision.PrecisionPolicy(F16, F16, F16)),
    (set(), False, F32, "cpu", False, False, precision.PrecisionPolicy(F32, F32, F32)),
    ({"avx512_bf16"}, True, BF16, "cuda", False, False, precision.PrecisionPolicy(BF16, BF16, BF16)),
])
def test_precision_policy(monkeypatch, flags, kernel, dtype, device, int8, compiled, expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(precision, "bf16_kernel_available", lambda: kernel)
    monkeypatch.setattr(precision, "half_kernel_available", lambda: True)
    assert precision.precision_policy(dtype, torch.device(device), int8, compiled) == expected


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_without_the_kernels_16_bit_weights_are_widened_at_load(monkeypatch, dtype):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(precision, "half_kernel_available", lambda: False)
    assert precision.precision_policy(dtype, torch.device("cpu")) == WIDENED[dtype]


@needs_bf16
def test_packed_bf16_weight_layout():
    weight = torch.arange(17 * 5, dtype=torch.float32).view(17, 5)  # N = 17, K = 5: both padded
    packed = precision.pack_bf16_weight(weight)
    assert packed.shape == (2, 3, 16, 2) and packed.dtype == BF16
    assert packed[0, 1, 3, 0] == weight[3, 2] and packed[0, 1, 3, 1] == weight[3, 3]
    assert packed[1, 0, 0, 1] == weight[16, 1] and packed[0, 2, 0, 1] == 0 and packed[1, 0, 1].abs().sum() == 0


@needs_bf16
@pytest.mark.parametrize("part_rows, in_features", [((17,), 5), ((48,), 64), ((48, 32, 17), 71), ((16, 16), 33),
                                                    ((64, 96), 600)])
def test_bf16_weight_packed_from_its_parts_where_they_lie(part_rows, in_features):
    """pack_bf16_parts packs parts (one strided, at an odd 2-byte offset) straight into the layout of their stack; a
    gate | up pair into bf16_silu_gate's tiles (32 gate rows, then the same features' up rows)."""
    generator = torch.Generator().manual_seed(in_features)
    wide = torch.randn(part_rows[0], in_features + 3, generator=generator).to(BF16)
    parts = [wide[:, 1:in_features + 1]] + [torch.randn(n, in_features, generator=generator).to(BF16)
                                            for n in part_rows[1:]]
    assert torch.equal(precision.pack_bf16_parts(parts), bf16_layout(torch.cat(parts)))
    gate, up = torch.randn(2, 64, in_features, generator=generator).to(BF16)
    tiles = torch.cat([torch.cat([gate[i:i + 32], up[i:i + 32]]) for i in (0, 32)])
    assert torch.equal(precision.pack_bf16_parts([gate, up], silu_gate=True), bf16_layout(tiles))
    assert torch.equal(precision.pack_bf16_parts([torch.cat([gate, up])], silu_gate=True), bf16_layout(tiles))


def random_bf16_linear(in_features: int, out_features: int, bias: bool, amx: bool,
                       generator: torch.Generator) -> tuple[nn.Linear, precision.BF16Linear]:
    """A bfloat16 nn.Linear (its bias, if any, drawn from `generator`) and its BF16Linear on either GEMM."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=BF16)
    if bias:
        with torch.no_grad():
            linear.bias.normal_(generator=generator)
    return linear, precision.BF16Linear(linear, amx)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
@pytest.mark.parametrize("rows, in_features, out_features, bias", [(1, 64, 48, True), (7, 575, 1531, True),
                                                                   (40, 96, 33, True), (17, 40, 80, True),
                                                                   (33, 1000, 16, True), (80, 96, 80, False),
                                                                   (64, 40, 128, False), (300, 4000, 80, True),
                                                                   (40, 96, 600, True)])
def test_bf16_linear_sums_bf16_inputs_in_float32_and_is_batch_invariant(rows, in_features, out_features, bias, amx):
    """Both GEMMs, on every tile shape: 1-6 rows of a register tile or 1-32 of AMX tiles (17 and 33: 16 and 32 and one
    more), 1-4 blocks, input pairs in whole AMX tiles of 16 or not (40 inputs: 20 pairs; 1000: 500); without a bias,
    whole AMX tasks of 32 rows x 4 blocks (stored straight into the output) beside partial ones (80 rows, 5 blocks);
    long rows (4000 inputs) in several groups of AMX row tiles, each over several groups of output columns; 10 column
    tiles of AMX outputs (600) in groups of 3 on two threads, the last group and tile partial."""
    generator = torch.Generator().manual_seed(rows)
    linear, layer = random_bf16_linear(in_features, out_features, bias, amx, generator)
    x = torch.randn(rows, in_features, generator=generator)
    got = layer(x)
    assert got.dtype == F32 and got.shape == (rows, out_features)
    want = x.to(BF16).double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got.double() - want).abs().max() < (got.to(BF16).double() - want).abs().max()  # finer than a bf16 output
    assert_rows_do_not_depend_on_the_batch(layer, x, got, generator)


@needs_bf16
def test_both_broadcasts_of_the_bf16_gemms_give_the_same_bits():
    """The kernel times its two ways of broadcasting the input pairs and keeps the faster; either gives the same
    sums, on every tile shape (1-6 rows, 1-4 blocks, the SiLU-gated one), so the choice changes speed only."""
    from modelzoo.cpu.kernels import cpu_kernels

    kernels = cpu_kernels()
    chosen = kernels.bf16_gemm_broadcast()
    assert chosen in ("embedded", "register")
    torch.manual_seed(0)
    # 7 blocks of outputs (a tile of 4, then 3), 2 blocks, 1 block, and the SiLU-gated tiles; rows in tiles of 6, 6, 5
    layers = [precision.BF16Linear(nn.Linear(96, out, dtype=BF16)) for out in (112, 24, 16)]
    layers.append(precision.SiluGatedBF16Linear(nn.Linear(96, 128, bias=False, dtype=BF16)))
    x = torch.randn(17, 96)
    outputs = {}
    try:
        for use in ("embedded", "register"):
            assert kernels.bf16_gemm_broadcast(use) == use
            outputs[use] = [layer(x[:rows]) for layer in layers for rows in (1, 2, 3, 4, 17)]
    finally:
        kernels.bf16_gemm_broadcast(chosen)
    assert all(torch.equal(a, b) for a, b in zip(outputs["embedded"], outputs["register"]))
    with pytest.raises(RuntimeError, match="broadcast is embedded or register, not sideways"):
        kernels.bf16_gemm_broadcast("sideways")


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_bf16_linear_of_a_conv1d_layer_takes_its_in_out_weight(amx):
    from modelzoo.models.gpt2 import Conv1D

    layer = Conv1D(48, 80).to(BF16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 5, 48)
    want = x.to(BF16).double() @ layer.weight.double() + layer.bias.double()
    torch.testing.assert_close(precision.BF16Linear(layer, amx)(x).double(), want, rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_bf16_linear_rejects_bad_inputs(amx):
    from modelzoo.cpu.kernels import cpu_kernels

    layer = precision.BF16Linear(nn.Linear(32, 16, dtype=BF16), amx)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        layer(torch.randn(2, 30))
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        getattr(cpu_kernels(), layer.kernel)(torch.randn(2, 32), layer.packed, torch.zeros(16, dtype=BF16), 16)
    with pytest.raises(RuntimeError, match="out_features does not match the packed weight"):
        getattr(cpu_kernels(), layer.kernel)(torch.randn(2, 32), layer.packed, None, 17)
    with pytest.raises(RuntimeError, match=r"packed must be contiguous bfloat16 \(N/16, K/2, 16, 2\)"):
        getattr(cpu_kernels(), layer.kernel)(torch.randn(2, 32), layer.packed.float(), None, 16)
    empty = torch.zeros((1, 0, 16, 2), dtype=BF16)  # a weight of no inputs, packed
    with pytest.raises(RuntimeError, match=r"x has no inputs \(K = 0\)"):
        getattr(cpu_kernels(), layer.kernel)(torch.randn(2, 0), empty, None, 16)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
@pytest.mark.parametrize("rows, in_features, intermediate", [(1, 64, 32), (7, 575, 96), (40, 96, 64), (17, 40, 128)])
def test_silu_gated_bf16_linear_has_silu_muls_bits_and_is_batch_invariant(rows, in_features, intermediate, amx):
    from modelzoo.cpu.kernels import cpu_kernels

    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, 2 * intermediate, bias=False, dtype=BF16)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
    gated, plain = precision.SiluGatedBF16Linear(linear, amx), precision.BF16Linear(linear, amx)
    assert gated.packed.shape == plain.packed.shape
    assert torch.equal(gated.packed, plain.packed) == (intermediate == 32)  # one tile: gate | up as it was
    x = torch.randn(rows, in_features, generator=generator) * 3
    got = gated(x)
    assert got.dtype == F32 and got.shape == (rows, intermediate)
    assert torch.equal(got, cpu_kernels().silu_mul(plain(x)))  # the same bits as the two calls it fuses
    assert_rows_do_not_depend_on_the_batch(gated, x, got, generator)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
@pytest.mark.parametrize("rows, in_features, intermediate", [(1, 64, 32), (7, 575, 96), (40, 96, 64)])
def test_the_silu_gate_rounded_for_the_down_projection_changes_no_bit(rows, in_features, intermediate, amx):
    """bf16_silu_gate(_rows) or amx_bf16_silu_gate with `rounded` writes its outputs as bfloat16, each the float32 one
    rounded as bf16_linear rounds its inputs; bf16_linear (amx_bf16_linear) multiplies a bfloat16 input where it lies
    (even K) or rounded (odd K), with the same sums as from the float32 it came from: the MLP's output is the same bits
    (GatedMLP hands them over so)."""
    kernels = cpu_kernels()
    silu_gate = kernels.amx_bf16_silu_gate if amx else kernels.bf16_silu_gate
    linear = kernels.amx_bf16_linear if amx else kernels.bf16_linear
    generator = torch.Generator().manual_seed(rows)
    gate, up = torch.randn(2, intermediate, in_features, generator=generator).to(BF16)
    gated = precision.pack_bf16_parts([gate, up], silu_gate=True)
    x = torch.randn(rows, in_features, generator=generator) * 3
    full = silu_gate(x, gated, intermediate)  # (rows, intermediate) float32
    rounded = silu_gate(x, gated, intermediate, True)
    assert full.dtype == F32 and rounded.dtype == BF16 and torch.equal(rounded, full.to(BF16))
    if not amx:
        assert torch.equal(kernels.bf16_silu_gate_rows(x, gate, up, True), rounded)
    for width in (intermediate, intermediate - 1):  # pairs read in place; an odd K rounded into pairs
        down = torch.randn(48, width, generator=generator).to(BF16)
        packed = precision.pack_bf16_weight(down)
        want = linear(full[:, :width], packed, None, 48)
        assert torch.equal(linear(rounded[:, :width], packed, None, 48), want)
        assert torch.equal(linear(rounded[:, :width].contiguous(), packed, None, 48), want)
    mlp = GatedMLP(in_features, intermediate, "silu", bias=False).to(BF16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.cat([gate, up]))
        mlp.down_proj.weight.normal_(generator=generator)
    mlp.gate_up_proj = precision.SiluGatedBF16Linear(mlp.gate_up_proj, amx)
    mlp.down_proj = precision.BF16Linear(mlp.down_proj, amx)
    assert mlp.gate_up_proj(x, round_to_bf16=True).dtype == BF16
    got = mlp(x)
    assert got.dtype == F32 and torch.equal(got, mlp.down_proj(full))  # as from the float32 gate it rounds


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("rows, in_features, out_features, bias", [(1, 64, 48, False), (7, 575, 1531, True),
                                                                   (40, 96, 33, True), (164, 1536, 576, False)])
def test_a_gemm_adds_its_outputs_into_a_residual_as_an_add_would(rows, in_features, out_features, bias, in_place,
                                                                  amx):
    """add_into(residual, x) leaves residual + layer(x) in residual, bit for bit (each output added as the GEMM writes
    it: bf16_linear_add_, bf16_linear_rows_add_, amx_bf16_linear_add_); from a bfloat16 input as from its float32
    source; whatever rows share the call. GatedMLP.add_to hands its down projection's outputs over so, and calls
    forward (and its hooks) where a hook is set. A bad residual is refused."""
    if in_place and amx:
        pytest.skip("the weights read in place have no AMX kernel")
    generator = torch.Generator().manual_seed(rows)
    linear, layer = random_bf16_linear(in_features, out_features, bias, amx, generator)
    if in_place:
        layer = precision.InPlaceBF16Linear(linear)
    assert precision.BF16Linear.rounds_inputs_to_bf16 and layer.rounds_inputs_to_bf16
    x = torch.randn(rows, in_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    want = residual + layer(x)
    got = residual.clone()
    assert layer.add_into(got, x) is got and torch.equal(got, want)
    if in_features % 2 == 0:
        got = residual.clone()
        assert torch.equal(layer.add_into(got, x.to(BF16)), want)
    added = lambda rows_x: layer.add_into(torch.zeros(rows_x.shape[0], out_features), rows_x)
    assert_rows_do_not_depend_on_the_batch(added, x, added(x), generator)
    kernels = cpu_kernels()
    add = (kernels.amx_bf16_linear_add_ if amx else
           kernels.bf16_linear_rows_add_ if in_place else kernels.bf16_linear_add_)
    weights = (list(layer.parts), layer.bias) if in_place else (layer.packed, layer.bias, out_features)
    for bad in (residual[:, :-1], residual.double(), residual.t().contiguous().t() if rows > 1 else residual[:0]):
        with pytest.raises(RuntimeError, match="residual must be a contiguous float32"):
            add(bad, x, *weights)
    mlp = GatedMLP(in_features, 64, "silu", bias=False).to(BF16)
    mlp.gate_up_proj = precision.SiluGatedBF16Linear(mlp.gate_up_proj, amx)
    mlp.down_proj = precision.BF16Linear(mlp.down_proj, amx)
    residual = torch.randn(rows, in_features, generator=generator)
    want = residual + mlp(x)
    assert torch.equal(mlp.add_to(residual.clone(), x), want)
    calls = []
    handle = mlp.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(mlp.add_to(residual, x), want) and calls == [1]
    handle.remove()


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_only_a_silu_gated_mlps_gate_up_projection_is_fused(amx):
    from modelzoo.models.layers import GatedMLP

    model = nn.ModuleDict({"silu": GatedMLP(64, 96, "silu", bias=False), "gelu": GatedMLP(64, 96, "gelu", bias=False),
                           "bias": GatedMLP(64, 96, "silu", bias=True), "narrow": GatedMLP(64, 48, "silu", bias=False)})
    model.to(BF16)
    x = torch.randn(5, 64)
    want = {name: mlp(x.to(BF16)).float() for name, mlp in model.items()}
    on_tiles = {"bfloat16 64x192", "bfloat16 64x96"} if amx else set()  # AMX for gate | up layers, not down ones
    shapes = precision.apply_bf16_gemm(model, on_tiles)
    assert isinstance(model["silu"].gate_up_proj, precision.SiluGatedBF16Linear)
    for name in ("gelu", "bias", "narrow"):  # another activation, a bias, 48 features (not whole 32-feature tiles)
        assert type(model[name].gate_up_proj) is precision.BF16Linear
    prefix = "amx_" if amx else ""
    assert model["silu"].gate_up_proj.kernel == f"{prefix}bf16_silu_gate"  # its shape key is the others' too
    assert shapes["bfloat16 64x96"] == f"{prefix}bf16_linear"
    assert shapes["bfloat16 96x64"] == shapes["bfloat16 48x64"] == "bf16_linear"
    assert all(mlp.down_proj.amx is False and mlp.gate_up_proj.amx is amx for mlp in model.values())
    for name, mlp in model.items():
        torch.testing.assert_close(mlp(x), want[name], rtol=0.05, atol=0.05)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_bf16_silu_gate_rejects_a_weight_not_in_gated_tiles(amx):
    from modelzoo.cpu.kernels import cpu_kernels

    layer = precision.BF16Linear(nn.Linear(32, 48, bias=False, dtype=BF16))  # 3 blocks: no whole tile of 2 + 2
    gate = "amx_bf16_silu_gate" if amx else "bf16_silu_gate"
    with pytest.raises(RuntimeError, match="packs gate | up of out_features each"):
        getattr(cpu_kernels(), gate)(torch.randn(2, 32), layer.packed, 24)
    gated = precision.SiluGatedBF16Linear(nn.Linear(32, 64, bias=False, dtype=BF16), amx)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        gated(torch.randn(2, 30))


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 48), (7, 575, 1531), (40, 96, 33),
                                                             (164, 576, 4096), (33, 1000, 16), (64, 40, 128),
                                                             (300, 4000, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_greedy_head_picks_its_outputs_argmax(rows, in_features, out_features, bias, amx):
    """The head's fused argmax is torch.max(-1)'s index of its GEMM's outputs, on every tile shape (partial tiles of
    rows and of outputs), with a bias and without; whatever rows share the call."""
    generator = torch.Generator().manual_seed(rows)
    _, layer = random_bf16_linear(in_features, out_features, bias, amx, generator)
    assert layer.fuses_greedy
    x = torch.randn(rows, in_features, generator=generator)
    got = layer.greedy(x)
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, layer(x).max(-1).indices)
    assert torch.equal(layer.greedy(x.view(1, rows, in_features)), got[None])  # (B, N, K) -> (B, N)
    assert_rows_do_not_depend_on_the_batch(layer.greedy, x, got, generator)


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_greedy_head_breaks_ties_and_nan_as_torch_max(amx):
    """Equal largest outputs: the first; a NaN output: the first NaN (torch.max counts NaN as the largest); every
    output -inf: index 0; +inf twice: the first; a row of NaN inputs: index 0."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 64, generator=generator).to(BF16)
    weight[150] = weight[170] = weight[20]  # outputs 20, 150 and 170 equal in every row
    x = torch.randn(50, 64, generator=generator)
    x[3] = float("nan")
    nan_weight = weight.clone()
    nan_weight[77, 3] = nan_weight[130, 5] = float("nan")
    infinities = torch.zeros(200)
    infinities[90] = infinities[180] = float("inf")
    for w, bias in ((weight, None), (nan_weight, None), (weight, torch.full((200,), float("-inf"))),
                    (weight, infinities)):
        linear = nn.Linear(64, 200, bias=bias is not None, dtype=BF16)
        with torch.no_grad():
            linear.weight.copy_(w)
            if bias is not None:
                linear.bias.copy_(bias)
        layer = precision.BF16Linear(linear, amx)
        outputs = layer(x)
        got = layer.greedy(x)
        assert torch.equal(got, outputs.max(-1).indices)
        assert got[3] == 0  # the row of NaN inputs: every output NaN
    assert (got[torch.arange(50) != 3] == 90).all()
    nan_layer = precision.BF16Linear(nn.Linear(64, 200, bias=False, dtype=BF16), amx)
    with torch.no_grad():
        nan_layer.packed.copy_(precision.pack_bf16_weight(nan_weight))
    assert (nan_layer.greedy(x) == torch.where(torch.arange(50) == 3, 0, 77)).all()


@needs_bf16
@pytest.mark.parametrize("amx", BF16_GEMMS)
def test_greedy_head_rejects_bad_inputs(amx):
    from modelzoo.cpu.kernels import cpu_kernels

    layer = precision.BF16Linear(nn.Linear(32, 48, dtype=BF16), amx)
    greedy = cpu_kernels().amx_bf16_greedy if amx else cpu_kernels().bf16_greedy
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        greedy(torch.randn(2, 30), layer.packed, layer.bias, 48)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        greedy(torch.randn(2, 32), layer.packed, None, 64)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        greedy(torch.randn(2, 32), layer.packed, torch.zeros(47), 48)
    assert not precision.SiluGatedBF16Linear(nn.Linear(32, 64, bias=False, dtype=BF16), amx).fuses_greedy


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("out_features, in_features", [(17, 5), (48, 3), (33, 130), (64, 48)])
def test_packed_half_weight_layout(dtype, out_features, in_features):
    """packed[b, k, r] = W[16 b + r, k]; the rows past N are zeros."""
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = precision.pack_half_weight(weight)
    blocks = -(-out_features // 16)
    assert packed.shape == (blocks, in_features, 16) and packed.dtype == dtype
    rows = torch.cat([weight, torch.zeros(blocks * 16 - out_features, in_features, dtype=dtype)])
    assert torch.equal(packed, rows.view(blocks, 16, in_features).transpose(1, 2))
    assert torch.equal(precision.pack_half_weight(weight.t().contiguous().t()), packed)  # a strided weight too


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_half_weight_packed_into_given_memory(dtype):
    """Into memory the caller gives, the packed layout is the one written into new memory, every value overwritten
    (padding rows included); memory of another shape, dtype or layout is refused."""
    weight = torch.randn(37, 70).to(dtype)
    expected = precision.pack_half_weight(weight)
    out = torch.full((3, 70, 16), 7.0, dtype=dtype)
    packed = precision.pack_half_weight(weight, lambda shape, dtype: out)
    assert packed.data_ptr() == out.data_ptr() and torch.equal(packed, expected)
    for wrong in (torch.empty(3, 70, 17, dtype=dtype), torch.empty(2, 70, 16, dtype=dtype),
                  torch.empty(3, 70, 16, dtype=F32 if dtype != F32 else BF16),
                  torch.empty(3, 16, 70, dtype=dtype).transpose(1, 2)):
        with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU tensor of the weight's dtype"):
            cpu_kernels().pack_half_weight(weight, wrong)


@needs_kernels
def test_half_linear_leaves_its_layers_weight_as_it_was(tmp_path):
    """A HalfLinear packs into memory of its own, whatever its layer's weight is (its own memory, a view of a larger
    tensor, a view of a checkpoint's memory map), and leaves that weight's values as they were."""
    from modelzoo.cpu.memory import map_private

    owned = torch.nn.Linear(70, 32, bias=False, dtype=BF16)
    before = owned.weight.detach().clone()
    expected = precision.pack_half_weight(before)
    layer = precision.HalfLinear(owned)
    assert layer.packed.data_ptr() != owned.weight.data_ptr() and torch.equal(layer.packed, expected)
    assert torch.equal(owned.weight, before)
    whole = torch.randn(64, 70).to(BF16)
    part = torch.nn.Linear(70, 32, bias=False, dtype=BF16)
    part.weight = torch.nn.Parameter(whole[16:48], requires_grad=False)
    whole_before = whole.clone()
    assert torch.equal(precision.HalfLinear(part).packed, precision.pack_half_weight(whole_before[16:48]))
    assert torch.equal(whole, whole_before)
    file = tmp_path / "weight.bin"
    file.write_bytes(before.view(-1).view(torch.uint8).numpy().tobytes())
    with open(file, "rb") as handle:
        mapping = map_private(handle)
        mapped = torch.frombuffer(mapping, dtype=BF16).view(32, 70)
        layer = torch.nn.Linear(70, 32, bias=False, dtype=BF16)
        layer.weight = torch.nn.Parameter(mapped, requires_grad=False)
        assert torch.equal(precision.HalfLinear(layer).packed, expected)
        assert torch.equal(mapped, before)  # the map's bytes untouched


def half_gemm_paths() -> list[str]:
    """The code paths of half_linear this build has."""
    return ["avx2", "avx512"] if "avx512f" in precision.cpu_flags() else ["avx2"]


def each_half_gemm_path() -> Iterator[str]:
    """Sets each of half_linear's code paths in turn (yielding its name), then the path chosen before."""
    kernels = cpu_kernels()
    chosen = kernels.half_gemm_path()
    try:
        for path in half_gemm_paths():
            assert kernels.half_gemm_path(path) == path
            yield path
    finally:
        kernels.half_gemm_path(chosen)


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("rows, in_features, out_features",
                         [(1, 64, 48), (7, 575, 1531), (40, 96, 33), (100, 300, 70)])
def test_half_linear_is_float32_arithmetic_over_16_bit_weights_and_batch_invariant(dtype, rows, in_features,
                                                                                    out_features):
    """Every code path: float32 sums of float32 inputs times the 16-bit (or float32: the GEMM candidate `packed`)
    weights (as a float32 GEMM over the widened weights, within float32 rounding), the same bits on each path, and a
    row's bits whatever rows share its call."""
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        linear.bias.normal_(generator=generator)
    layer = precision.HalfLinear(linear)
    assert layer.packed.dtype == dtype
    assert layer.packed_bytes() == -(-out_features // 16) * 16 * in_features * dtype.itemsize
    x = torch.randn(rows, in_features, generator=generator)
    want = x.double() @ linear.weight.double().T + linear.bias.double()
    outputs = []
    for _ in each_half_gemm_path():
        got = layer(x)
        assert got.dtype == F32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert_rows_do_not_depend_on_the_batch(layer, x, got, generator)
        outputs.append(got)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def tied_and_nan_heads(in_features: int, out_features: int, dtype: torch.dtype,
                       generator: torch.Generator) -> tuple[nn.Linear, nn.Linear]:
    """Two heads of `dtype`: one whose largest output, in every row, is tied between outputs out_features // 2 and
    out_features - 1 (their weights and a bias of 50 equal); one whose output out_features // 3 is NaN."""
    linear = nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        linear.bias.normal_(generator=generator)
        linear.weight[out_features - 1] = linear.weight[out_features // 2]  # two equal outputs in every row
        linear.bias[out_features - 1] = linear.bias[out_features // 2] = 50.0  # the largest, tied
    nan_linear = nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        nan_linear.weight[out_features // 3, 0] = float("nan")
    return linear, nan_linear


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 48), (5, 575, 1531), (40, 96, 33),
                                                             (164, 64, 4096)])
def test_half_greedy_picks_half_linears_argmax(dtype, rows, in_features, out_features):
    """On every code path (a decode call of up to 6 rows takes column tiles of one block on AVX2, longer ones of 4):
    torch.max(-1)'s index of half_linear's outputs, with ties and a NaN output picked as torch.max picks them."""
    generator = torch.Generator().manual_seed(rows)
    linear, nan_linear = tied_and_nan_heads(in_features, out_features, dtype, generator)
    x = torch.randn(rows, in_features, generator=generator)
    for _ in each_half_gemm_path():
        for layer in (precision.HalfLinear(linear), precision.HalfLinear(nan_linear)):
            assert layer.fuses_greedy
            got = layer.greedy(x)
            assert got.dtype == torch.long and torch.equal(got, layer(x).max(-1).indices)
            assert_rows_do_not_depend_on_the_batch(layer.greedy, x, got, generator)
        assert (precision.HalfLinear(linear).greedy(x) == out_features // 2).all()
        assert (precision.HalfLinear(nan_linear).greedy(x) == out_features // 3).all()
    with pytest.raises(RuntimeError, match="out_features does not match"):
        cpu_kernels().half_greedy(x, precision.HalfLinear(linear).packed, None, out_features + 16)


IN_PLACE_HEADS = [pytest.param(precision.InPlaceBF16Linear, BF16, id="bf16_linear_rows"),
                  pytest.param(precision.InPlaceHalfLinear, BF16, id="half_linear_rows-bfloat16"),
                  pytest.param(precision.InPlaceHalfLinear, F16, id="half_linear_rows-float16")]


@needs_kernels
@pytest.mark.parametrize("layer_type, dtype", IN_PLACE_HEADS)
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 48), (7, 575, 1531), (40, 96, 33),
                                                             (164, 64, 4096)])
def test_in_place_heads_pick_their_outputs_argmax(layer_type, dtype, rows, in_features, out_features):
    """A head read where its weight lies picks, without writing its outputs, torch.max(-1)'s index of its own
    outputs: ties to the first, a NaN output first, with a bias; whatever rows share the call. Bad shapes refused."""
    if layer_type is precision.InPlaceBF16Linear and not precision.bf16_kernel_available():
        pytest.skip("bf16_linear_rows needs AVX512-BF16")
    generator = torch.Generator().manual_seed(rows)
    linear, nan_linear = tied_and_nan_heads(in_features, out_features, dtype, generator)
    x = torch.randn(rows, in_features, generator=generator)
    for layer in (layer_type(linear), layer_type(nan_linear)):
        assert layer.fuses_greedy
        got = layer.greedy(x)
        assert got.dtype == torch.long and got.shape == (rows,) and torch.equal(got, layer(x).max(-1).indices)
        assert torch.equal(layer.greedy(x.view(1, rows, in_features)), got[None])  # (B, N, K) -> (B, N)
        assert_rows_do_not_depend_on_the_batch(layer.greedy, x, got, generator)
    assert (layer_type(linear).greedy(x) == out_features // 2).all()
    assert (layer_type(nan_linear).greedy(x) == out_features // 3).all()
    layer = layer_type(linear)
    with pytest.raises(RuntimeError, match="bias must be"):
        getattr(cpu_kernels(), layer.greedy_kernel)(x, list(layer.parts), torch.zeros(out_features - 1))
    with pytest.raises(RuntimeError):
        getattr(cpu_kernels(), layer.greedy_kernel)(torch.randn(rows, in_features + 2), list(layer.parts), None)
    assert not precision.InPlaceSiluGatedBF16Linear(nn.Linear(32, 64, bias=False, dtype=BF16)).fuses_greedy


@needs_kernels
def test_half_linear_of_a_conv1d_layer_takes_its_in_out_weight():
    from modelzoo.models.gpt2 import Conv1D

    layer = Conv1D(48, 80).to(F16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 5, 48)
    want = x.double() @ layer.weight.double() + layer.bias.double()
    torch.testing.assert_close(precision.HalfLinear(layer)(x).double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_half_linear_rejects_bad_inputs():
    kernels = cpu_kernels()
    layer = precision.HalfLinear(nn.Linear(32, 16, dtype=BF16))
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        layer(torch.randn(2, 30))
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        kernels.half_linear(torch.randn(2, 32), layer.packed, torch.zeros(16, dtype=BF16), 16)
    with pytest.raises(RuntimeError, match="packed must be contiguous bfloat16, float16 or float32"):
        kernels.half_linear(torch.randn(2, 32), layer.packed.double(), None, 16)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        kernels.half_linear(torch.randn(2, 32), layer.packed, None, 17)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        kernels.half_linear(torch.randn(2, 32, dtype=F16), layer.packed, None, 16)
    with pytest.raises(RuntimeError, match="path is avx2"):
        kernels.half_gemm_path("sse2")


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("part_rows, in_features", [((48,), 64), ((48, 32, 17), 70), ((16, 16), 33), ((5,), 1),
                                                    ((64, 96), 600)])
@pytest.mark.parametrize("rows", [1, 4, 6, 7, 50])
def test_half_linear_rows_has_half_linears_bits_over_the_parts_where_they_lie(dtype, part_rows, in_features, rows):
    """Every code path: half_linear_rows over row-major parts (one strided, one at an odd address, a partial last
    block) equals half_linear over the packed stack of the parts bit for bit, at register-tile and panel row counts."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(part_rows[0], in_features + 3, generator=generator).to(dtype)
    parts = [wide[:, 1:in_features + 1]]  # rows 2 * (K + 3) bytes apart, the first at an odd 2-byte offset
    parts += [torch.randn(n, in_features, generator=generator).to(dtype) for n in part_rows[1:]]
    stacked = torch.cat(parts)
    bias = torch.randn(stacked.shape[0], generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = precision.pack_half_weight(stacked)
    for _ in each_half_gemm_path():
        want = kernels.half_linear(x, packed, bias, stacked.shape[0])
        assert torch.equal(kernels.half_linear_rows(x, parts, bias), want)
        assert torch.equal(kernels.half_linear_rows(x, parts), kernels.half_linear(x, packed, None, len(bias)))


@needs_bf16
@pytest.mark.parametrize("part_rows, in_features", [((48,), 64), ((48, 32, 17), 71), ((16, 16), 33), ((5,), 1),
                                                    ((64, 96), 600)])
@pytest.mark.parametrize("rows", [1, 4, 6, 7, 50])
def test_bf16_linear_rows_has_bf16_linears_bits_over_the_parts_where_they_lie(part_rows, in_features, rows):
    """bf16_linear_rows over row-major parts (one strided, at an odd 2-byte offset; a partial last block; an odd K)
    equals bf16_linear over the packed stack bit for bit, with either broadcast, at one row tile (transposed in
    registers) and more (each column tile packed once); bf16_silu_gate_rows equals bf16_silu_gate."""
    kernels = cpu_kernels()
    chosen = kernels.bf16_gemm_broadcast()
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(part_rows[0], in_features + 3, generator=generator).to(BF16)
    parts = [wide[:, 1:in_features + 1]]
    parts += [torch.randn(n, in_features, generator=generator).to(BF16) for n in part_rows[1:]]
    stacked = torch.cat(parts)
    bias = torch.randn(stacked.shape[0], generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = precision.pack_bf16_weight(stacked)
    gate, up = torch.randn(2, 64, in_features, generator=generator).to(BF16)
    gated = precision.pack_bf16_parts([gate, up], silu_gate=True)
    try:
        for broadcast in ("embedded", "register"):
            kernels.bf16_gemm_broadcast(broadcast)
            want = kernels.bf16_linear(x, packed, bias, stacked.shape[0])
            assert torch.equal(kernels.bf16_linear_rows(x, parts, bias), want)
            assert torch.equal(kernels.bf16_linear_rows(x, parts), kernels.bf16_linear(x, packed, None, len(bias)))
            assert torch.equal(kernels.bf16_silu_gate_rows(x, gate, up), kernels.bf16_silu_gate(x, gated, 64))
    finally:
        kernels.bf16_gemm_broadcast(chosen)


@needs_bf16
def test_bf16_linear_rows_rejects_bad_parts():
    kernels = cpu_kernels()
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="at least one weight"):
        kernels.bf16_linear_rows(x, [])
    for bad in ([torch.randn(16, 32)], [torch.randn(16, 32, dtype=F16)], [torch.randn(32, 16, dtype=BF16).T],
                [torch.randn(16, 30, dtype=BF16)]):
        with pytest.raises(RuntimeError, match="every part must be a bfloat16 CPU tensor"):
            kernels.bf16_linear_rows(x, bad)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        kernels.bf16_linear_rows(x, [torch.randn(17, 32, dtype=BF16), torch.randn(16, 32, dtype=BF16)])
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        kernels.bf16_linear_rows(x, [torch.randn(16, 32, dtype=BF16)], torch.zeros(17))
    with pytest.raises(RuntimeError, match="x must be a float32, bfloat16 or float16"):
        kernels.bf16_linear_rows(x.int(), [torch.randn(16, 32, dtype=BF16)])
    for gate, up in ((torch.randn(16, 32, dtype=BF16),) * 2, (torch.randn(32, 32, dtype=BF16),
                                                              torch.randn(64, 32, dtype=BF16))):
        with pytest.raises(RuntimeError, match="two parts, gate and up, of the same shape"):
            kernels.bf16_silu_gate_rows(x, gate, up)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous bfloat16 CPU tensor \(ceil\(N/16\)"):
        kernels.pack_bf16_rows([torch.randn(16, 32, dtype=BF16)], False, torch.empty(1, 15, 16, 2, dtype=BF16))


@needs_kernels
def test_half_linear_rows_rejects_bad_parts():
    kernels = cpu_kernels()
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="at least one weight"):
        kernels.half_linear_rows(x, [])
    with pytest.raises(RuntimeError, match="must be bfloat16 or float16"):
        kernels.half_linear_rows(x, [torch.randn(16, 32)])
    with pytest.raises(RuntimeError, match="unit column stride"):
        kernels.half_linear_rows(x, [torch.randn(32, 16, dtype=BF16).T])
    with pytest.raises(RuntimeError, match="unit column stride"):
        kernels.half_linear_rows(x, [torch.randn(16, 30, dtype=BF16)])
    with pytest.raises(RuntimeError, match="unit column stride"):
        kernels.half_linear_rows(x, [torch.randn(16, 32, dtype=BF16), torch.randn(16, 32, dtype=F16)])
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        kernels.half_linear_rows(x, [torch.randn(17, 32, dtype=BF16), torch.randn(16, 32, dtype=BF16)])
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        kernels.half_linear_rows(x, [torch.randn(16, 32, dtype=BF16)], torch.zeros(17))
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        kernels.half_linear_rows(x.half(), [torch.randn(16, 32, dtype=F16)])


@needs_kernels
@pytest.mark.parametrize("storage", [BF16, F16])
@pytest.mark.parametrize("huge", [False, True])
def test_float32_queries_over_a_16_bit_cache_equal_the_pytorch_path(storage, huge, monkeypatch):
    """The C++ kernel (q float32, cache bfloat16 or float16) stores and attends over the same rounded keys and
    values as the PyTorch path; keys and values beyond float16's range saturate at its largest value in a float16
    cache (both paths), so attention stays finite."""
    from modelzoo.models.kv_cache import KVCache
    from modelzoo.models import layers

    generator = torch.Generator().manual_seed(3)
    batch, width, heads, kv_heads, head_dim = 2, 5, 4, 2, 32
    q = torch.randn(batch, heads, width, head_dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, width, head_dim, generator=generator) for _ in range(2))
    if huge:  # one feature of one key and of one value past float16's range, both signs
        k[0, 1, 2, 7], v[1, 0, 4, 3], v[1, 0, 4, 4] = 1e6, -3e5, 7e4
    outputs, caches = [], []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(layers, "attention_kernel", lambda q, ctx: None)
        cache = KVCache(1, batch, kv_heads, 16, head_dim, storage, torch.device("cpu"))
        positions = 3 + torch.arange(width).expand(batch, width)
        ctx = layers.ForwardContext.build(cache, None, positions)
        outputs.append(layers.cached_attention(q, k, v, 0, ctx))
        caches.append((cache.keys[0].clone(), cache.values[0].clone()))
    assert outputs[0].dtype == F32 and all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    assert torch.isfinite(outputs[0]).all() and torch.isfinite(caches[0][0]).all()
    if huge and storage == F16:
        keys, values = caches[0]  # positions 3 .. 7 of each row
        assert keys[0, 1, 3 + 2, 7] == 65504 and values[1, 0, 3 + 4, 3] == -65504 and values[1, 0, 3 + 4, 4] == 65504
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
