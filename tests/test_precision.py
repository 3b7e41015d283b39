"""The precision policy (modelzoo/cpu/precision.py): which tensors are in which dtype, on CPUs with and without native
bfloat16; bfloat16 GEMMs with float32 outputs; how close the bfloat16 policy stays to float32."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from harness import (family_prompts, hf_last_logits, last_logits, prompt_rows, relative_error, run_job, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from modelzoo.cpu import precision
from modelzoo.cpu.kernels import cpu_kernels
from tiny_configs import INT8_FAMILIES, VOCAB, tiny_llama_config

START = VOCAB  # outside the vocabulary, as recommended
POLICY_REL_TOL = 0.04  # the bfloat16 policy's last-position logits against float32's, relative


BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
MIXED = precision.PrecisionPolicy(BF16, F32, F16, bf16_gemm=True)
needs_bf16 = pytest.mark.skipif(not precision.bf16_kernel_available(),
                                reason="bf16_linear needs an AVX512-BF16 CPU and the C++ kernels")
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels could not be built here")


HALF = {dtype: precision.PrecisionPolicy(dtype, F32, F32, half_gemm=True) for dtype in (BF16, F16)}
WIDENED = {dtype: precision.PrecisionPolicy(dtype, F32, F32) for dtype in (BF16, F16)}  # weights widened at load


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


def test_packed_bf16_weight_layout():
    weight = torch.arange(17 * 5, dtype=torch.float32).view(17, 5)  # N = 17, K = 5: both padded
    packed = precision.pack_bf16_weight(weight)
    assert packed.shape == (2, 3, 16, 2) and packed.dtype == BF16
    assert packed[0, 1, 3, 0] == weight[3, 2] and packed[0, 1, 3, 1] == weight[3, 3]
    assert packed[1, 0, 0, 1] == weight[16, 1] and packed[0, 2, 0, 1] == 0 and packed[1, 0, 1].abs().sum() == 0


@needs_bf16
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 48), (7, 575, 1531), (40, 96, 33)])
def test_bf16_linear_sums_bf16_inputs_in_float32_and_is_batch_invariant(rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, out_features, dtype=BF16)
    with torch.no_grad():
        linear.bias.normal_(generator=generator)
    layer = precision.BF16Linear(linear)
    x = torch.randn(rows, in_features, generator=generator)
    got = layer(x)
    assert got.dtype == F32 and got.shape == (rows, out_features)
    want = x.to(BF16).double() @ linear.weight.double().T + linear.bias.double()
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
def test_bf16_linear_of_a_conv1d_layer_takes_its_in_out_weight():
    from modelzoo.models.gpt2 import Conv1D

    layer = Conv1D(48, 80).to(BF16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 5, 48)
    want = x.to(BF16).double() @ layer.weight.double() + layer.bias.double()
    torch.testing.assert_close(precision.BF16Linear(layer)(x).double(), want, rtol=1e-5, atol=1e-5)


@needs_bf16
def test_bf16_linear_rejects_bad_inputs():
    layer = precision.BF16Linear(nn.Linear(32, 16, dtype=BF16))
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        layer(torch.randn(2, 30))
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        from modelzoo.cpu.kernels import cpu_kernels
        cpu_kernels().bf16_linear(torch.randn(2, 32), layer.packed, torch.zeros(16, dtype=BF16), 16)


@needs_bf16
@pytest.mark.parametrize("rows, in_features, intermediate", [(1, 64, 32), (7, 575, 96), (40, 96, 64)])
def test_silu_gated_bf16_linear_has_silu_muls_bits_and_is_batch_invariant(rows, in_features, intermediate):
    from modelzoo.cpu.kernels import cpu_kernels

    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, 2 * intermediate, bias=False, dtype=BF16)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
    gated, plain = precision.SiluGatedBF16Linear(linear), precision.BF16Linear(linear)
    assert gated.packed.shape == plain.packed.shape
    assert torch.equal(gated.packed, plain.packed) == (intermediate == 32)  # one tile: gate | up as it was
    x = torch.randn(rows, in_features, generator=generator) * 3
    got = gated(x)
    assert got.dtype == F32 and got.shape == (rows, intermediate)
    assert torch.equal(got, cpu_kernels().silu_mul(plain(x)))  # the same bits as the two calls it fuses
    assert_rows_do_not_depend_on_the_batch(gated, x, got, generator)


@needs_bf16
def test_only_a_silu_gated_mlps_gate_up_projection_is_fused():
    from modelzoo.models.layers import GatedMLP

    model = nn.ModuleDict({"silu": GatedMLP(64, 96, "silu", bias=False), "gelu": GatedMLP(64, 96, "gelu", bias=False),
                           "bias": GatedMLP(64, 96, "silu", bias=True), "narrow": GatedMLP(64, 48, "silu", bias=False)})
    model.to(BF16)
    x = torch.randn(5, 64)
    want = {name: mlp(x.to(BF16)).float() for name, mlp in model.items()}
    shapes = precision.apply_bf16_gemm(model)
    assert isinstance(model["silu"].gate_up_proj, precision.SiluGatedBF16Linear)
    for name in ("gelu", "bias", "narrow"):  # another activation, a bias, 48 features (not whole 32-feature tiles)
        assert type(model[name].gate_up_proj) is precision.BF16Linear
    assert "bf16_silu_gate" in shapes.values() and shapes["bfloat16 64x96"] == "bf16_linear"  # the narrow one
    for name, mlp in model.items():
        torch.testing.assert_close(mlp(x), want[name], rtol=0.05, atol=0.05)


@needs_bf16
def test_bf16_silu_gate_rejects_a_weight_not_in_gated_tiles():
    from modelzoo.cpu.kernels import cpu_kernels

    layer = precision.BF16Linear(nn.Linear(32, 48, bias=False, dtype=BF16))  # 3 blocks: no whole tile of 2 + 2
    with pytest.raises(RuntimeError, match="packs gate | up of out_features each"):
        cpu_kernels().bf16_silu_gate(torch.randn(2, 32), layer.packed, 24)
    gated = precision.SiluGatedBF16Linear(nn.Linear(32, 64, bias=False, dtype=BF16))
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        gated(torch.randn(2, 30))


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("out_features, in_features", [(17, 5), (48, 3), (33, 130)])
def test_packed_half_weight_layout(dtype, out_features, in_features):
    """packed[b, k, r] = W[16 b + r, k]; the rows past N are zeros."""
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = precision.pack_half_weight(weight)
    blocks = -(-out_features // 16)
    assert packed.shape == (blocks, in_features, 16) and packed.dtype == dtype
    rows = torch.cat([weight, torch.zeros(blocks * 16 - out_features, in_features, dtype=dtype)])
    assert torch.equal(packed, rows.view(blocks, 16, in_features).transpose(1, 2))
    assert torch.equal(precision.pack_half_weight(weight.t().contiguous().t()), packed)  # a strided weight too


def half_gemm_paths() -> list[str]:
    """The code paths of half_linear this build has."""
    return ["avx2", "avx512"] if "avx512f" in precision.cpu_flags() else ["avx2"]


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 48), (7, 575, 1531), (40, 96, 33)])
def test_half_linear_is_float32_arithmetic_over_16_bit_weights_and_batch_invariant(dtype, rows, in_features,
                                                                                    out_features):
    """Every code path: float32 sums of float32 inputs times the 16-bit weights (as a float32 GEMM over the widened
    weights, within float32 rounding), the same bits on each path, and a row's bits whatever rows share its call."""
    kernels = cpu_kernels()
    chosen = kernels.half_gemm_path()
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        linear.bias.normal_(generator=generator)
    layer = precision.HalfLinear(linear)
    assert layer.packed.dtype == dtype and layer.packed_bytes() == -(-out_features // 16) * 16 * in_features * 2
    x = torch.randn(rows, in_features, generator=generator)
    want = x.double() @ linear.weight.double().T + linear.bias.double()
    outputs = []
    try:
        for path in half_gemm_paths():
            assert kernels.half_gemm_path(path) == path
            got = layer(x)
            assert got.dtype == F32 and got.shape == (rows, out_features)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            assert_rows_do_not_depend_on_the_batch(layer, x, got, generator)
            outputs.append(got)
    finally:
        kernels.half_gemm_path(chosen)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


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
    with pytest.raises(RuntimeError, match="packed must be contiguous bfloat16 or float16"):
        kernels.half_linear(torch.randn(2, 32), layer.packed.float(), None, 16)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        kernels.half_linear(torch.randn(2, 32), layer.packed, None, 17)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        kernels.half_linear(torch.randn(2, 32, dtype=F16), layer.packed, None, 16)
    with pytest.raises(RuntimeError, match="path is avx2"):
        kernels.half_gemm_path("sse2")


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


def bfloat16_setup(checkpoint, dtype: torch.dtype = BF16):
    """A job's runtime, model and engine in bfloat16 (or `dtype`; 4 rows in flight, max_seq_len 64), as the runner
    opens them."""
    from modelzoo.runtime import Runtime, RuntimePlan
    from modelzoo.runtime_spec import RuntimeSpec

    spec = RuntimeSpec(str(checkpoint), dtype=str(dtype)[6:], device="cpu", max_seq_len=64, rows_in_flight=4)
    runtime = Runtime(RuntimePlan.of(spec), rows_to_do=4)
    return runtime, runtime.model, runtime.engine


@needs_bf16
def test_bfloat16_policy_keeps_each_tensor_in_its_dtype(tmp_path):
    from modelzoo.generation.engine import Request
    from modelzoo.generation.options import GenerationOptions
    from modelzoo.models.layers import RMSNorm

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    setup, model, engine = bfloat16_setup(checkpoint)
    assert setup.policy == MIXED
    modules = list(model.modules())
    assert not any(isinstance(m, nn.Linear) for m in modules)
    gemms = [m for m in modules if isinstance(m, precision.BF16Linear)]
    assert len(gemms) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    assert all(isinstance(layer.mlp.gate_up_proj, precision.SiluGatedBF16Linear) for layer in model.model.layers)
    assert all(m.packed.dtype == BF16 for m in gemms)
    assert all(m.weight.dtype == F32 for m in modules if isinstance(m, RMSNorm))
    embedding = model.model.embed_tokens
    assert embedding.weight.dtype == BF16 and embedding(torch.tensor([[1, 2]])).dtype == F32
    assert engine.cache.keys[0].dtype == engine.cache.values[0].dtype == F16
    completions = list(engine.generate([Request(0, np.array([5, 9, 2]), GenerationOptions(max_tokens=4))]))
    assert len(completions[0].tokens) == 4


@needs_bf16
def test_bfloat16_job_is_batch_invariant(tmp_path):
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2, 15, 7, 1, 30)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 48, START))
    runs = []
    for batch in (1, 7):
        params = write_params(tmp_path / f"b{batch}.yaml", checkpoint, tmp_path / "data", batch, START,
                              dtype="bfloat16", max_tokens=12, rows_in_flight=batch)
        assert run_job(params, tmp_path / f"b{batch}") == 0
        runs.append(stacked_predictions(tmp_path / f"b{batch}")[: len(prompts)])
    summary = json.loads((tmp_path / "b7" / "artifacts" / "summary.json").read_text())
    assert summary["dtype"] == MIXED.describe()
    np.testing.assert_array_equal(runs[0], runs[1])


@needs_bf16
@pytest.mark.parametrize("family", list(INT8_FAMILIES))
def test_bfloat16_policy_is_closer_to_float32_than_bfloat16_everywhere(family, tmp_path):
    """Every family's tiny config: the policy's last-position logits are within POLICY_REL_TOL of transformers'
    float32 ones; and, against float32 arithmetic on the same bfloat16-rounded weights (what rounding the weights
    alone costs is the same for both), at most 0.8 times as far as transformers' bfloat16 logits."""
    from transformers import AutoModelForCausalLM

    checkpoint = save_tiny_model(INT8_FAMILIES[family](), tmp_path / "model")
    prompts = family_prompts(VOCAB)
    want = torch.stack(hf_last_logits(checkpoint, prompts))
    hf = {dtype: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval() for dtype in (F32, BF16)}
    with torch.no_grad():
        for param in hf[F32].parameters():
            param.copy_(param.to(BF16).float())
    with torch.inference_mode():
        logits = {dtype: torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])
                  for dtype, model in hf.items()}
    _, model, _ = bfloat16_setup(checkpoint)
    got = last_logits(model, prompts, dtype=BF16)
    assert relative_error(got, want).max() < POLICY_REL_TOL
    ours, theirs = relative_error(got, logits[F32]), relative_error(logits[BF16], logits[F32])
    assert ours.mean() < 0.8 * theirs.mean(), (ours, theirs)


@needs_bf16
def test_bfloat16_draft_model_speculation_equals_plain_greedy(tmp_path):
    """The draft model follows the same policy (its linear layers multiply with bf16_linear too), and verifying
    drafted tokens gives the bits of plain decoding."""
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 12, 3, 20)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 48, START))
    runs = {}
    for name, keys in (("plain", {}), ("spec", {"speculative": {"method": "draft_model", "num_tokens": 3,
                                                                "checkpoint_path": str(checkpoint)}})):
        params = write_params(tmp_path / f"{name}.yaml", checkpoint, tmp_path / "data", 2, START, dtype="bfloat16",
                              max_tokens=16, model_keys=keys)
        assert run_job(params, tmp_path / name) == 0
        runs[name] = stacked_predictions(tmp_path / name)
    np.testing.assert_array_equal(runs["spec"], runs["plain"])
    assert json.loads((tmp_path / "spec" / "artifacts" / "summary.json").read_text())["speculative_acceptance_rate"] > 0.9


@pytest.fixture
def avx2_cpu(monkeypatch):
    """The precision policy as on an AVX2 CPU (no native 16-bit multiplies), half_linear on its AVX2 path."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    kernels = cpu_kernels()
    chosen = kernels.half_gemm_path()
    kernels.half_gemm_path("avx2")
    yield
    kernels.half_gemm_path(chosen)


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_16_bit_weights_stay_16_bit_without_native_multiplies(dtype, tmp_path, avx2_cpu):
    from modelzoo.generation.engine import Request
    from modelzoo.generation.options import GenerationOptions
    from modelzoo.cpu.gemm import weight_bytes
    from modelzoo.models.layers import RMSNorm

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    setup, model, engine = bfloat16_setup(checkpoint, dtype)
    assert setup.policy == HALF[dtype]
    modules = list(model.modules())
    assert not any(isinstance(m, nn.Linear) for m in modules)
    gemms = [m for m in modules if isinstance(m, precision.HalfLinear)]
    assert len(gemms) == 4 * model.config.num_layers + 1 and all(m.packed.dtype == dtype for m in gemms)
    assert all(m.weight.dtype == F32 for m in modules if isinstance(m, RMSNorm))
    embedding = model.model.embed_tokens
    assert embedding.weight.dtype == dtype and embedding(torch.tensor([[1, 2]])).dtype == F32
    assert engine.cache.keys[0].dtype == F32
    # every weight in 2 bytes but the norms' (float32) and the packing's padding rows
    parameters = sum(t.numel() for t in load_file(checkpoint / "model.safetensors").values())
    assert weight_bytes(model) < 2.1 * parameters
    completions = list(engine.generate([Request(0, np.array([5, 9, 2]), GenerationOptions(max_tokens=4))]))
    assert len(completions[0].tokens) == 4


@needs_kernels
@pytest.mark.parametrize("dtype, family", [("bfloat16", "llama"), ("float16", "llama"), ("float16", "llama_tied")])
def test_16_bit_job_without_native_multiplies_is_batch_invariant_and_keeps_todays_rows(dtype, family, tmp_path,
                                                                                        avx2_cpu, monkeypatch):
    """half_linear's rows (a tied embedding reading the packed head) do not depend on the batch, and equal those of
    float32 arithmetic over the weights widened at load (the policy where the kernels are not built)."""
    config = tiny_llama_config() if family == "llama" else INT8_FAMILIES[family]()
    checkpoint = save_tiny_model(config, tmp_path / "model")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2, 15, 7, 1, 30)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 48, START))
    runs = {}
    for name, batch in (("b1", 1), ("b7", 7), ("widened", 7)):
        if name == "widened":
            monkeypatch.setattr(precision, "half_kernel_available", lambda: False)
        params = write_params(tmp_path / f"{name}.yaml", checkpoint, tmp_path / "data", batch, START, dtype=dtype,
                              max_tokens=12, rows_in_flight=batch)
        assert run_job(params, tmp_path / name) == 0
        runs[name] = stacked_predictions(tmp_path / name)[: len(prompts)]
    summary = json.loads((tmp_path / "b7" / "artifacts" / "summary.json").read_text())
    assert summary["dtype"] == HALF[getattr(torch, dtype)].describe()
    assert summary["dtype"] == f"{dtype} weights, float32 arithmetic and KV cache"
    assert set(summary["gemm"]["layers"].values()) == {"half_linear"}
    np.testing.assert_array_equal(runs["b1"], runs["b7"])
    np.testing.assert_array_equal(runs["b7"], runs["widened"])


@needs_kernels
@pytest.mark.parametrize("family", ["llama_tied", "gpt2"])
def test_a_tied_embedding_reads_the_packed_head(family, tmp_path):
    """A token embedding tied to the LM head reads its rows from the head's packed weight (one 16-bit copy of the
    table, not two), with the bits the embedding had."""
    from modelzoo.models.checkpoint import load_model
    from modelzoo.cpu.gemm import weight_bytes

    checkpoint = save_tiny_model(INT8_FAMILIES[family](), tmp_path / "model")
    model, _ = load_model(checkpoint, F16, torch.device("cpu"))
    plain = model.get_submodule(model.embedding_name)
    tokens = torch.tensor([[1, 5, VOCAB - 1], [0, 17, 33]])
    want = plain(tokens).float()
    table = plain.weight.numel() * 2
    before = weight_bytes(model)
    precision.apply_half_gemm(model)
    tied = model.get_submodule(model.embedding_name)
    assert isinstance(tied, precision.TiedHalfEmbedding) and tied.head[0] is model.get_submodule(model.head_name)
    assert torch.equal(tied(tokens), want)
    assert weight_bytes(model) < before + table / 2  # the packed head replaces the table; a few padding rows at most
