"""half_silu_gate (modelzoo/cpu/kernels/half_gemm.cpp): a SwiGLU MLP's gate | up projection multiplied by half_linear
with its SiLU gate applied as the sums leave, for 16-bit weights on CPUs without native 16-bit multiplies and for the
float32 GEMM candidate `packed`: silu_mul's bits over half_linear's sums, on every code path, batch-invariant."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from modelzoo.cpu import precision
from modelzoo.cpu.gemm import apply_gemm_backend
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.models.layers import GatedMLP
from precision_policies import BF16, F16, F32, needs_kernels
from test_precision import assert_rows_do_not_depend_on_the_batch, half_gemm_paths

pytestmark = needs_kernels


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("intermediate", [32, 96])
def test_gated_packing_puts_each_tiles_gate_blocks_before_its_up_blocks(dtype, intermediate):
    """Packed block b of a gated weight is plain block (b // 4 * 2 + b % 4) of the gate rows for b % 4 < 2, and the
    same features' block of the up rows after; one tile (32 features) is gate | up as it was."""
    weight = torch.randn(2 * intermediate, 40).to(dtype)
    plain, gated = precision.pack_half_weight(weight), precision.pack_half_weight(weight, silu_gate=True)
    assert gated.shape == plain.shape and gated.dtype == dtype
    half = plain.shape[0] // 2
    for block in range(gated.shape[0]):
        tile, j = divmod(block, 4)
        source = 2 * tile + j if j < 2 else half + 2 * tile + j - 2
        assert torch.equal(gated[block], plain[source])
    assert torch.equal(gated, plain) == (intermediate == 32)


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("rows, in_features, intermediate",
                         [(1, 64, 32), (7, 575, 96), (40, 96, 64), (17, 40, 128), (100, 300, 64)])
def test_silu_gated_half_linear_has_silu_muls_bits_and_is_batch_invariant(dtype, rows, in_features, intermediate):
    """On every code path: the bits of silu_mul over half_linear's gate | up output, and a row's bits whatever rows
    share its call (one row tile and several; a run of 48 rows and a part of one)."""
    kernels = cpu_kernels()
    chosen = kernels.half_gemm_path()
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, 2 * intermediate, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
    gated, plain = precision.SiluGatedHalfLinear(linear), precision.HalfLinear(linear)
    assert gated.kernel == "half_silu_gate" and gated.applies_silu_gate
    x = torch.randn(rows, in_features, generator=generator) * 3
    try:
        for path in half_gemm_paths():
            kernels.half_gemm_path(path)
            got = gated(x)
            assert got.dtype == F32 and got.shape == (rows, intermediate)
            assert torch.equal(got, kernels.silu_mul(plain(x)))  # the same bits as the two calls it fuses
            assert_rows_do_not_depend_on_the_batch(gated, x, got, generator)
    finally:
        kernels.half_gemm_path(chosen)


def mlps(dtype: torch.dtype) -> nn.ModuleDict:
    """A SiLU GatedMLP, and three whose gate | up projection cannot take the gate: another activation, a bias, 48
    features (not whole 32-feature tiles)."""
    torch.manual_seed(0)
    return nn.ModuleDict({"silu": GatedMLP(64, 96, "silu", bias=False), "gelu": GatedMLP(64, 96, "gelu", bias=False),
                          "bias": GatedMLP(64, 96, "silu", bias=True),
                          "narrow": GatedMLP(64, 48, "silu", bias=False)}).to(dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_16_bit_weights_fuse_only_a_silu_gated_mlps_gate_up_projection(dtype):
    model = mlps(dtype)
    x = torch.randn(5, 64)
    want = {name: mlp.float()(x) for name, mlp in mlps(dtype).items()}  # the 16-bit values in float32 arithmetic
    shapes = precision.apply_half_gemm(model)
    assert type(model["silu"].gate_up_proj) is precision.SiluGatedHalfLinear
    for name in ("gelu", "bias", "narrow"):
        assert type(model[name].gate_up_proj) is precision.HalfLinear
    name = str(dtype).removeprefix("torch.")
    assert shapes[f"{name} 64x192"] == "half_silu_gate" and shapes[f"{name} 64x96"] == "half_linear"
    for key, mlp in model.items():
        torch.testing.assert_close(mlp(x), want[key], rtol=1e-5, atol=1e-5)


def test_the_float32_packed_backend_fuses_a_silu_gated_mlps_gate_up_projection():
    model, reference = mlps(F32), mlps(F32)
    x = torch.randn(5, 64)
    apply_gemm_backend(model, F32, torch.device("cpu"), "packed")
    assert type(model["silu"].gate_up_proj) is precision.SiluGatedHalfLinear
    assert all(type(model[name].gate_up_proj) is precision.HalfLinear for name in ("gelu", "bias", "narrow"))
    for key, mlp in model.items():
        torch.testing.assert_close(mlp(x), reference[key](x), rtol=1e-5, atol=1e-5)


def test_half_silu_gate_rejects_a_weight_not_in_gated_tiles():
    kernels = cpu_kernels()
    plain = precision.HalfLinear(nn.Linear(32, 48, bias=False, dtype=BF16))  # 3 blocks: no whole tile of 2 + 2
    with pytest.raises(RuntimeError, match="packs gate | up of out_features each"):
        kernels.half_silu_gate(torch.randn(2, 32), plain.packed, 24)
    gated = precision.SiluGatedHalfLinear(nn.Linear(32, 64, bias=False, dtype=BF16))
    with pytest.raises(RuntimeError, match="packs gate | up of out_features each"):
        kernels.half_silu_gate(torch.randn(2, 32), gated.packed, 64)  # out_features is gate's, not gate | up's
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        gated(torch.randn(2, 30))
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        kernels.half_silu_gate(torch.randn(2, 32, dtype=F16), gated.packed, 32)
    with pytest.raises(RuntimeError, match="gate | up with a multiple of 32 features each, not 48 rows"):
        precision.pack_half_weight(torch.randn(48, 32), silu_gate=True)
