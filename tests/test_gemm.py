"""GEMM backends chosen by measurement: each one's layer matches nn.Linear, holds one copy of the
weight (oneDNN), and the choice keeps only batch-invariant candidates, is cached and can be forced."""
from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

import modelzoo.cpu.gemm as gemm
import modelzoo.cpu.kernels
from modelzoo.cpu import precision
from modelzoo.cpu.precision import HalfLinear
from precision_policies import amx_tiles, bf16_layout
from modelzoo.errors import UserError
from modelzoo.cpu.gemm import (INVARIANCE_ROWS, MKLPackedLinear, OneDNNLinear, RowBlockLinear, apply_gemm_backend,
                           available_backends, linear_layers, measure_shape, weight_bytes, wrap)

CPU = torch.device("cpu")
FLOAT32_BACKENDS = available_backends(CPU, torch.float32)


@pytest.fixture(autouse=True)
def choices_in_tmp(tmp_path, monkeypatch):
    """Each test measures afresh into its own cache file: every kernel root in tmp_path."""
    monkeypatch.delenv("ZOO_INFER_KERNEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(modelzoo.cpu.kernels, "BUILD_ROOT", tmp_path / "build")


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_each_backend_matches_linear_for_any_row_count(backend):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    layer = wrap(linear, backend, decode_rows=8)
    with torch.inference_mode():
        for shape in ((8, 1, 48), (8, 48), (3, 1, 48), (3, 7, 48), (1, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("onednn" not in FLOAT32_BACKENDS, reason="this torch build has no oneDNN")
def test_onednn_layer_keeps_one_copy_of_the_weight():
    layer = OneDNNLinear(nn.Linear(64, 32))
    assert set(layer.state_dict()) == {"bias"}  # the checkpoint's weight is gone, only the blocked copy
    assert layer.packed_bytes() == 64 * 32 * 4


def test_swap_replaces_every_linear_and_keeps_a_tied_embedding():
    model = nn.Sequential(nn.Embedding(30, 16), nn.Linear(16, 16), nn.Linear(16, 30, bias=False))
    model[2].weight = model[0].weight  # a tied LM head
    plan = apply_gemm_backend(model, torch.float32, CPU, "auto")
    assert not linear_layers(model)  # none left as plain nn.Linear unless torch won
    chosen = set(plan.layers.values())
    assert chosen <= set(FLOAT32_BACKENDS)
    assert model[0].weight.shape == (30, 16)  # the embedding keeps the checkpoint's values
    assert weight_bytes(model) >= 30 * 16 * 4 + 16 * 16 * 4


def test_a_linear_subclass_is_swapped_too():
    """FalconLinear (x @ W.T + b as two ops) is multiplied by the chosen backend like any nn.Linear: left to PyTorch's
    own GEMM, its rows' bits followed the batch where MKL is not batch-invariant (an Intel Xeon with AMX)."""
    from modelzoo.models.falcon import FalconLinear

    model = nn.Sequential(FalconLinear(16, 24), nn.Linear(24, 16))
    assert [layer for _, _, layer in linear_layers(model)] == list(model)
    plan = apply_gemm_backend(model, torch.float32, CPU, "auto")
    assert set(plan.layers) == {"float32 16x24", "float32 24x16"}
    assert all(isinstance(layer, nn.Linear) == (plan.layers[key] == "torch")
               for layer, key in zip(model, ("float32 16x24", "float32 24x16")))


def test_candidates_are_timed_taking_turns(monkeypatch):
    """The candidates' calls alternate, one of each a round after a warm-up call of each, so that a spell where the
    machine runs slow falls on all of them; each keeps its least time, over TIMING_ROUNDS rounds."""
    clock, order = [0.0], []

    def call(key: str, seconds: list[float]):
        def run():
            order.append(key)
            clock[0] += seconds[min(order.count(key) - 1, len(seconds) - 1)]
        return run

    monkeypatch.setattr(gemm.time, "perf_counter", lambda: clock[0])
    least, most = gemm.TIMING_ROUNDS
    # slow spells over some of the timed calls: each keeps its least time
    calls = {"a": call("a", [1.0, 9.0, 9.0, 2.0]), "b": call("b", [1.0, 3.0, 1.5, 1.5, 1.5, 8.0])}
    best = gemm._seconds_per_call(calls, budget_s=0.0)
    assert order == ["a", "b"] + ["a", "b"] * least
    assert best == {"a": 2.0, "b": 1.5}
    order.clear()
    gemm._seconds_per_call({"a": call("a", [0.001]), "b": call("b", [0.001])}, budget_s=1e9)
    assert order == ["a", "b"] * (1 + most)


def test_measure_prefers_batch_invariant_candidates_and_says_why():
    choice = measure_shape(96, 160, torch.float32, FLOAT32_BACKENDS)
    assert set(choice.gflops) | set(choice.rejected) == set(FLOAT32_BACKENDS)
    assert all(rate > 0 for rates in choice.gflops.values() for rate in rates.values())
    if any(choice.invariant.values()):
        assert choice.invariant[choice.backend]
    assert choice.invariant.get("packed", "packed" not in FLOAT32_BACKENDS)  # invariant by construction
    # the property itself, checked again here on other data for the chosen backend
    linear = nn.Linear(96, 160, bias=False)
    layer = wrap(linear, choice.backend, decode_rows=INVARIANCE_ROWS[-1])
    x = torch.randn(256, 96)
    with torch.inference_mode():
        full = layer(x)
        for rows in (1, 5, 32, 100):
            if choice.invariant[choice.backend]:
                assert torch.equal(layer(x[:rows].contiguous()), full[:rows])


def test_a_vocabulary_sized_weight_is_timed_on_its_first_outputs(monkeypatch):
    assert gemm.measured_out_features(2048, 49152, torch.float32) == 8192  # 64 MiB of float32
    assert gemm.measured_out_features(2048, 49152, torch.bfloat16) == 16384
    assert gemm.measured_out_features(576, 1536, torch.float32) == 1536  # fits: all of it
    assert gemm.measured_out_features(2**25, 100, torch.float32) == 64  # never fewer than 64
    monkeypatch.setattr(gemm, "MEASURED_WEIGHT_BYTES", 96 * 4 * 128)
    built = []

    def build(linear: nn.Linear, backend: str) -> nn.Module:
        built.append(tuple(linear.weight.shape))
        return linear

    choice = measure_shape(96, 5000, torch.float32, ["torch"], build=build)
    assert built == [(128, 96)]
    assert choice.backend == "torch" and set(choice.gflops["torch"]) == {"M=256", "M=32"}


def test_choice_is_cached_and_reused(tmp_path, monkeypatch):
    apply_gemm_backend(nn.Sequential(nn.Linear(32, 48)), torch.float32, CPU, "auto")
    cached = json.loads((modelzoo.cpu.kernels.machine_dir(tmp_path / "build") / "gemm_choices.json").read_text())
    assert list(cached["shapes"]) == ["float32 32x48"]
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: pytest.fail("measured again"))
    plan = apply_gemm_backend(nn.Sequential(nn.Linear(32, 48)), torch.float32, CPU, "auto")
    assert plan.layers == {"float32 32x48": cached["shapes"]["float32 32x48"]["backend"]}


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_forced_backend_is_used_everywhere(backend):
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16))
    plan = apply_gemm_backend(model, torch.float32, CPU, backend)
    assert set(plan.layers.values()) == {backend}
    kinds = {"onednn": OneDNNLinear, "mkl": MKLPackedLinear, "packed": HalfLinear, "torch": nn.Linear,
             "onednn_blocks": RowBlockLinear, "torch_blocks": RowBlockLinear}
    assert all(type(layer) is kinds[backend] for layer in model)


def test_unavailable_backend_is_a_user_error():
    with pytest.raises(UserError, match="runconfig.gemm_backend mkl is not available for bfloat16"):
        apply_gemm_backend(nn.Sequential(nn.Linear(16, 16, dtype=torch.bfloat16)), torch.bfloat16, CPU, "mkl")


def test_cuda_models_are_left_to_torch():
    model = nn.Sequential(nn.Linear(16, 16))
    plan = apply_gemm_backend(model, torch.float32, torch.device("cuda"), "auto")
    assert plan.layers == {"float32 16x16": "torch"} and type(model[0]) is nn.Linear


@pytest.mark.skipif("onednn" not in FLOAT32_BACKENDS, reason="this torch build has no oneDNN")
def test_onednn_single_row_equals_that_row_among_others():
    """oneDNN multiplies one row with another kernel (a matrix-vector product summing in another order,
    seen on Zen 4 at K >= 1536): the layer runs it as two rows, so its bits do not depend on the count."""
    torch.manual_seed(2)
    layer = OneDNNLinear(nn.Linear(2048, 256))
    x = torch.randn(32, 1, 2048)
    with torch.inference_mode():
        together = layer(x)
        for row in (0, 17):
            assert torch.equal(layer(x[row: row + 1]), together[row: row + 1])
            assert torch.equal(layer(x[row, 0]), together[row, 0])  # a 1-D input too


def test_onednn_holds_each_projection_once(tmp_path):
    """After the oneDNN backend re-lays the weights out, no linear layer is left holding the checkpoint's layout."""
    import modelzoo.models.checkpoint as checkpoint
    from harness import save_tiny_model
    from tiny_configs import narrow_llama_config

    if "onednn" not in FLOAT32_BACKENDS:
        pytest.skip("this torch build has no oneDNN")
    config = narrow_llama_config(num_hidden_layers=1, num_key_value_heads=1, max_position_embeddings=2048,
                                 architectures=None)
    model, _ = checkpoint.load_model(save_tiny_model(config, tmp_path / "ckpt"), torch.float32, CPU)
    apply_gemm_backend(model, torch.float32, CPU, "onednn")
    assert not linear_layers(model)  # every projection now held only in oneDNN's layout


@pytest.mark.skipif("mkl" not in FLOAT32_BACKENDS, reason="this torch build has no MKL packed GEMM")
def test_mkl_second_copy_only_within_the_spare_memory(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(UserError, match="gemm_backend mkl keeps a second, packed copy of the weights"):
        apply_gemm_backend(model, torch.float32, CPU, "mkl", spare_bytes=1000)
    assert type(model[0]) is nn.Linear  # nothing swapped
    fake = {"backend": "mkl", "gflops": {b: {"M=256": 100.0 + (b == "mkl"), "M=32": 100.0} for b in FLOAT32_BACKENDS},
            "invariant": {b: True for b in FLOAT32_BACKENDS}, "rejected": {}}
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: gemm.ShapeChoice(**fake))  # MKL measured fastest
    other = nn.Sequential(nn.Linear(64, 80))  # a shape not cached yet
    assert apply_gemm_backend(nn.Sequential(nn.Linear(64, 80)), torch.float32, CPU, "auto").layers == {"float32 64x80": "mkl"}
    plan = apply_gemm_backend(other, torch.float32, CPU, "auto", spare_bytes=1000)
    assert plan.layers == {"float32 64x80": "onednn" if "onednn" in FLOAT32_BACKENDS else "torch"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_offered_backend_runs_its_dtype_here(dtype):
    """available_backends offers only what runs on this CPU: each backend it lists for `dtype` wraps and multiplies a
    layer in it (torch's oneDNN bfloat16 path refuses AVX2-only CPUs, so oneDNN is not offered there), and a forced
    backend that is not offered is refused with the list."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48).to(dtype)
    x = torch.randn(5, 32, dtype=dtype)
    backends = available_backends(CPU, dtype)
    assert {"torch", "torch_blocks"} <= set(backends)
    with torch.inference_mode():
        for backend in backends:
            torch.testing.assert_close(wrap(linear, backend)(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    missing = [b for b in ("onednn", "onednn_blocks", "mkl") if b not in backends]
    for backend in missing:
        with pytest.raises(UserError, match=f"gemm_backend {backend} is not available for "):
            apply_gemm_backend(nn.Sequential(nn.Linear(32, 48).to(dtype)), dtype, CPU, backend)


@pytest.mark.parametrize("block_rows", gemm.BLOCK_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [b for b in FLOAT32_BACKENDS if b.endswith("_blocks")])
def test_row_blocks_give_every_row_the_same_bits_wherever_it_sits(backend, dtype, block_rows):
    """The *_blocks backends call the library on fixed blocks of rows: a row's bits do not depend on how many
    rows share the call or where it sits among them, whatever the library does with the row count (on this
    CPU or an AMX one), and the values are the plain layer's."""
    if backend not in available_backends(CPU, dtype):
        pytest.skip(f"{backend} has no {dtype} path on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(96, 200).to(dtype)
    layer = wrap(linear, backend, block_rows=block_rows)
    assert layer.block_rows == block_rows
    x = torch.randn(300, 96, dtype=dtype)
    with torch.inference_mode():
        full = layer(x)
        for rows, offset in ((1, 0), (1, 130), (7, 3), (63, 64), (65, 1), (200, 100)):
            assert torch.equal(layer(x[offset: offset + rows]), full[offset: offset + rows]), (rows, offset)
        assert torch.equal(layer(x[:130].view(10, 13, 96)), full[:130].view(10, 13, 200))
        torch.testing.assert_close(full.float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    assert not linear_layers(nn.Sequential(layer))  # no plain nn.Linear inside to be swapped again


@pytest.mark.parametrize("backend", [b for b in FLOAT32_BACKENDS if b.endswith("_blocks")])
def test_row_block_size_is_measured_and_the_fastest_kept(backend, monkeypatch):
    """measure_shape times a *_blocks backend with every block size and keeps the fastest batch-invariant one (here
    32 rows, made fastest), its rates those of that size; the job's layers then multiply on blocks of that size,
    and the log names it."""
    def timed(calls):  # each call keyed (backend, block rows, rows timed)
        return {key: {16: 2.0, 32: 1.0, 64: 3.0}[key[1]] for key in calls}
    built = gemm.wrap
    block_sizes = []

    def wrap_noting_block(linear, name, decode_rows=gemm.DECODE_ROWS, block_rows=gemm.BLOCK_ROWS[-1]):
        block_sizes.append(block_rows)
        return built(linear, name, decode_rows, block_rows)

    monkeypatch.setattr(gemm, "_seconds_per_call", timed)
    monkeypatch.setattr(gemm, "wrap", wrap_noting_block)
    choice = measure_shape(32, 48, torch.float32, [backend])
    assert block_sizes == list(gemm.BLOCK_ROWS)
    assert choice.block_rows == {backend: 32} and choice.invariant == {backend: True}
    rates = {f"M={rows}": float(f"{2 * rows * 32 * 48 / 1.0 / 1e9:.3g}") for rows in (gemm.PREFILL_ROWS, gemm.DECODE_ROWS)}
    assert choice.gflops == {backend: rates}
    monkeypatch.setattr(gemm, "wrap", built)
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: choice)
    model = nn.Sequential(nn.Linear(32, 48))
    plan = apply_gemm_backend(model, torch.float32, CPU, backend)
    assert type(model[0]) is RowBlockLinear and model[0].block_rows == 32
    assert "(32-row blocks)" in gemm.rates_text(plan.measured["float32 32x48"], backend)


def without_the_bf16_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's log line names how bf16_linear broadcasts, which only a CPU with AVX512-BF16 can time: stood in for,
    so that the plan's logic is tested on any CPU; so is packing (the C++ packer's, AVX512-BF16 too) where the CPU
    lacks it, by the layout's PyTorch spelling."""
    monkeypatch.setattr(gemm, "cpu_kernels", lambda: types.SimpleNamespace(bf16_gemm_broadcast=lambda: "embedded"))
    if not precision.bf16_kernel_available():
        def pack_bf16_parts(parts: list[torch.Tensor], memory=None, silu_gate: bool = False) -> torch.Tensor:
            assert not silu_gate, "these plans have no SiLU-gated MLP"
            return bf16_layout(torch.cat(parts))

        monkeypatch.setattr(precision, "pack_bf16_parts", pack_bf16_parts)


def test_bfloat16_policy_gemm_follows_the_measured_choice_per_shape(monkeypatch):
    """Where both the AVX512-BF16 and the AMX GEMM are offered, each shape's layers take its measured choice."""
    without_the_bf16_kernel(monkeypatch)
    monkeypatch.setattr(gemm, "available_bf16_kernels", lambda: ["bf16_linear", "amx_bf16_linear"])
    measured = {"bfloat16 64x96": "amx_bf16_linear", "bfloat16 96x64": "bf16_linear"}

    def measured_shapes(shapes, dtype, backends, build, choices):
        assert shapes == {"bfloat16 64x96": (64, 96), "bfloat16 96x64": (96, 64)} and dtype == torch.float32
        assert backends == ["bf16_linear", "amx_bf16_linear"] and choices == "bf16_gemm_choices.json"
        assert build(nn.Linear(64, 96), "amx_bf16_linear").amx and not build(nn.Linear(64, 96), "bf16_linear").amx
        return {key: {"backend": kernel, "gflops": {}, "invariant": {kernel: True}, "rejected": {}}
                for key, kernel in measured.items()}

    monkeypatch.setattr(gemm, "measured_shapes", measured_shapes)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 96)).to(torch.bfloat16)
    plan = gemm.apply_bf16_kernels(model)
    assert plan.layers == {"bfloat16 64x96": "amx_bf16_linear", "bfloat16 96x64": "bf16_linear"}
    assert [layer.amx for layer in model] == [True, False, True] and plan.batch_invariant


def test_bfloat16_policy_gemm_without_amx_is_bf16_linear_unmeasured(monkeypatch):
    without_the_bf16_kernel(monkeypatch)
    monkeypatch.setattr(gemm, "available_bf16_kernels", lambda: ["bf16_linear"])
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: pytest.fail("nothing to choose from"))
    model = nn.Sequential(nn.Linear(64, 96)).to(torch.bfloat16)
    plan = gemm.apply_bf16_kernels(model)
    assert plan.layers == {"bfloat16 64x96": "bf16_linear"} and plan.measured == {} and not model[0].amx


@pytest.mark.skipif(not amx_tiles, reason="needs an AMX-BF16 CPU and the C++ kernels")
def test_amx_and_avx512_bf16_gemms_are_measured_checked_and_cached(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64)).to(torch.bfloat16)
    x = torch.randn(5, 64)
    plan = gemm.apply_bf16_kernels(model)
    for key in ("bfloat16 64x96", "bfloat16 96x64"):
        assert set(plan.measured[key]["gflops"]) == {"bf16_linear", "amx_bf16_linear"}
        assert plan.measured[key]["invariant"] == {"bf16_linear": True, "amx_bf16_linear": True}
        assert plan.layers[key] == plan.measured[key]["backend"] == gemm.fastest(plan.measured[key])
    assert [layer.kernel for layer in model] == [plan.layers["bfloat16 64x96"], plan.layers["bfloat16 96x64"]]
    assert model(x).dtype == torch.float32
    folder = modelzoo.cpu.kernels.machine_dir(tmp_path / "build")
    cached = json.loads((folder / "bf16_gemm_choices.json").read_text())
    assert set(cached["shapes"]) == set(plan.layers) and not (folder / "gemm_choices.json").exists()
    monkeypatch.setattr(gemm, "measure_shape", lambda *args, **kwargs: pytest.fail("measured again"))
    again = gemm.apply_bf16_kernels(nn.Sequential(nn.Linear(64, 96, bias=False)).to(torch.bfloat16))
    assert again.layers == {"bfloat16 64x96": plan.layers["bfloat16 64x96"]}


def fake_layout_rates(packed: float, in_place: float, rows: int, layouts: gemm.Layouts = gemm.HALF_LAYOUTS) -> dict:
    """A measured_shapes answer: the packed and in-place kernels at these GFLOP/s, at every row count timed."""
    rates = lambda rate: {f"M={gemm.PREFILL_ROWS}": rate, f"M={rows}": rate}
    return {"backend": layouts.packed, "gflops": {layouts.packed: rates(packed), layouts.in_place: rates(in_place)},
            "invariant": {layouts.packed: True, layouts.in_place: True}, "rejected": {}, "block_rows": {}}


@pytest.mark.skipif(modelzoo.cpu.kernels.cpu_kernels() is None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("gemm_kernel", ["half_linear", "bf16_linear"])
@pytest.mark.parametrize("work, in_place_rate, packed", [
    (None, 50.0, True),  # work unknown (the API, the weight cache): packed
    (gemm.JobWork(decode_steps=8, prompt_tokens=64, prompts=2), 90.0, False),  # small: packing costs more than it saves
    (gemm.JobWork(decode_steps=10**6, prompt_tokens=10**8, prompts=10**6), 90.0, True),  # a long one: packing pays
    (gemm.JobWork(decode_steps=10**6, prompt_tokens=10**8, prompts=10**6), 110.0, False),  # in place faster: never packed
])
def test_16_bit_weights_are_packed_only_where_the_jobs_work_pays_for_it(work, in_place_rate, packed, gemm_kernel,
                                                                         monkeypatch):
    """apply_half_kernels (apply_bf16_kernels without AMX) packs a shape where the time the job saves by it (its most
    work at the measured rates) exceeds the time packing takes (at the measured packing rate), reads it in place
    otherwise, and packs a Conv1D's (in, out) weight whatever the work: the in-place kernels read rows."""
    from modelzoo.models.gpt2 import Conv1D

    if gemm_kernel == "bf16_linear":
        if not precision.bf16_kernel_available():
            pytest.skip("bf16_linear needs AVX512-BF16")
        monkeypatch.setattr(gemm, "available_bf16_kernels", lambda: ["bf16_linear"])
        layouts, packed_layer, in_place_layer = gemm.BF16_LAYOUTS, precision.BF16Linear, precision.InPlaceBF16Linear
        apply = lambda model: gemm.apply_bf16_kernels(model, "auto", 4, work)
    else:
        layouts, packed_layer, in_place_layer = gemm.HALF_LAYOUTS, precision.HalfLinear, precision.InPlaceHalfLinear
        apply = lambda model: gemm.apply_half_kernels(model, 4, work)
    monkeypatch.setattr(gemm, "measured_shapes", lambda shapes, *args, **kwargs: {
        key: fake_layout_rates(100.0, in_place_rate, 4, layouts) for key in shapes})
    monkeypatch.setattr(gemm, "packing_rate", lambda dtype, pack=None: 1e9)
    model = nn.Sequential(nn.Linear(256, 512, dtype=torch.bfloat16), Conv1D(512, 256).to(torch.bfloat16))
    plan = apply(model)
    assert type(model[0]) is (packed_layer if packed else in_place_layer)
    assert type(model[1]) is packed_layer
    assert plan.layers == {"bfloat16 256x512": layouts.packed if packed else layouts.in_place,
                           "bfloat16 512x256": layouts.packed}


def test_the_layout_gain_counts_decode_steps_and_prompt_tokens():
    """Seconds saved by packing one weight: decode steps at the rows in flight plus prompt tokens PREFILL_ROWS a call,
    each at the difference of the two kernels' times for the weight's FLOPs."""
    flops = 2 * 1000 * 2000
    step = flops * 8 / 50e9 - flops * 8 / 100e9
    prefill = flops * gemm.PREFILL_ROWS / 50e9 - flops * gemm.PREFILL_ROWS / 100e9
    for layouts in (gemm.HALF_LAYOUTS, gemm.BF16_LAYOUTS):
        rates = fake_layout_rates(100.0, 50.0, 8, layouts)["gflops"]
        gain = gemm.layout_gain(rates, (1000, 2000), 8, gemm.JobWork(decode_steps=30, prompt_tokens=512, prompts=4),
                                layouts)
        assert gain == pytest.approx(30 * step + 2 * prefill)


@pytest.mark.skipif(modelzoo.cpu.kernels.cpu_kernels() is None, reason="the C++ kernels cannot be built here")
def test_the_vocabulary_heads_layout_counts_one_prefill_row_per_prompt(monkeypatch):
    """The head multiplies each prompt's last token alone in prefill: its layout weighs the decode steps and one row
    per prompt, not every prompt token, so a head that packing only speeds up in prefill is read in place while a
    layer of its shape inside the model would be packed."""
    from modelzoo.models.llama import LlamaForCausalLM
    from tiny_configs import tiny_llama_config

    monkeypatch.setattr(gemm, "measured_shapes", lambda shapes, *args, **kwargs: {
        key: {**fake_layout_rates(100.0, 100.0, 4), "gflops": {
            "half_linear": {f"M={gemm.PREFILL_ROWS}": 100.0, "M=4": 100.0},
            "half_linear_rows": {f"M={gemm.PREFILL_ROWS}": 50.0, "M=4": 100.0}}} for key in shapes})
    monkeypatch.setattr(gemm, "packing_rate", lambda dtype, pack=None: 1e9)
    config = LlamaForCausalLM.config_from_hf(tiny_llama_config(tie_word_embeddings=False))
    work = gemm.JobWork(decode_steps=10**6, prompt_tokens=10**7, prompts=10)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    plan = gemm.apply_half_kernels(model, 4, work)
    head_key = f"bfloat16 {config.hidden_size}x{config.vocab_size}"
    assert plan.layers[head_key] == "half_linear_rows" and type(model.lm_head) is precision.InPlaceHalfLinear
    assert all(kernel == "half_linear" for key, kernel in plan.layers.items() if key != head_key)
    many_prompts = gemm.JobWork(decode_steps=10**6, prompt_tokens=10**7, prompts=10**7)
    assert gemm.apply_half_kernels(LlamaForCausalLM(config).to(torch.bfloat16), 4, many_prompts).layers[head_key] == (
        "half_linear")
