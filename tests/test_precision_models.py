"""The precision policy over whole models and jobs: each tensor's dtype, batch invariance, closeness to float32."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from harness import (family_prompts, hf_last_logits, last_logits, prompt_rows, relative_error, run_job, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from modelzoo.cpu import precision
from modelzoo.cpu.kernels import cpu_kernels
from precision_policies import BF16, F16, F32, HALF, MIXED, needs_bf16, needs_kernels
from tiny_configs import INT8_FAMILIES, VOCAB, tiny_llama_config

START = VOCAB  # outside the vocabulary, as recommended
POLICY_REL_TOL = 0.04  # the bfloat16 policy's last-position logits against float32's, relative


def bfloat16_setup(checkpoint, dtype: torch.dtype = BF16):
    """A job's runtime, model and engine in bfloat16 (or `dtype`; 4 rows in flight, max_seq_len 64), as the runner
    opens them."""
    from modelzoo.runtime import Runtime, RuntimePlan
    from modelzoo.runtime_spec import RuntimeSpec

    spec = RuntimeSpec(str(checkpoint), dtype=str(dtype)[6:], device="cpu", max_seq_len=64, rows_in_flight=4)
    runtime = Runtime(RuntimePlan.of(spec), rows_to_do=4)
    return runtime, runtime.model, runtime.engine


@needs_bf16
def test_bfloat16_policy_keeps_each_tensor_in_its_dtype(tmp_path, monkeypatch):
    from modelzoo.cpu import gemm
    from modelzoo.generation.engine import Request
    from modelzoo.generation.options import GenerationOptions
    from modelzoo.models.layers import RMSNorm

    monkeypatch.setattr(gemm, "layout_gain", lambda *_: float("inf"))  # every weight packed
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
def test_bfloat16_job_is_batch_invariant_whether_its_weights_are_packed_or_read_in_place(tmp_path, monkeypatch):
    """The bfloat16 policy's rows do not depend on the batch, nor on the weights' layout: packed (bf16_linear,
    bf16_silu_gate) or read where they lie in the checkpoint's map (bf16_linear_rows, bf16_silu_gate_rows). An AMX
    CPU packs every weight for whichever of bf16_linear and amx_bf16_linear it times faster, so the job is held to
    bf16_linear there; the AMX kernels' invariance is tests/test_smollm2.py's
    test_rows_do_not_depend_on_the_batch_or_a_resume."""
    from modelzoo.cpu import gemm

    monkeypatch.setattr(gemm, "available_bf16_kernels", lambda: ["bf16_linear"])
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2, 15, 7, 1, 30)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 48, START))
    runs = {}
    for name, batch in (("b1", 1), ("b7", 7), ("in_place", 7)):
        packing_pays = name != "in_place"
        monkeypatch.setattr(gemm, "layout_gain", lambda *_: float("inf") if packing_pays else float("-inf"))
        params = write_params(tmp_path / f"{name}.yaml", checkpoint, tmp_path / "data", batch, START,
                              dtype="bfloat16", max_tokens=12, rows_in_flight=batch)
        assert run_job(params, tmp_path / name) == 0
        runs[name] = stacked_predictions(tmp_path / name)[: len(prompts)]
    summary = json.loads((tmp_path / "b7" / "artifacts" / "summary.json").read_text())
    assert summary["dtype"] == MIXED.describe()
    assert set(summary["gemm"]["layers"].values()) == {"bf16_linear", "bf16_silu_gate"}
    summary = json.loads((tmp_path / "in_place" / "artifacts" / "summary.json").read_text())
    assert set(summary["gemm"]["layers"].values()) == {"bf16_linear_rows", "bf16_silu_gate_rows"}
    np.testing.assert_array_equal(runs["b1"], runs["b7"])
    np.testing.assert_array_equal(runs["b7"], runs["in_place"])


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


@needs_bf16
def test_plain_greedy_steps_take_their_tokens_from_the_heads_own_argmax(tmp_path, monkeypatch):
    """A plain greedy decode step, and the prefill before it, take each row's token from the bfloat16 head's fused
    argmax (its logits never written): the same rows as the logits' own argmax. Log-probabilities, sampling, or a
    hook on the head or on the model (tensor parallel gathers its logits in one) keep the logits."""
    from modelzoo.cpu import gemm
    from modelzoo.generation import engine as engine_module
    from modelzoo.generation.engine import Request
    from modelzoo.generation.options import GenerationOptions, RequestVariety

    monkeypatch.setattr(gemm, "layout_gain", lambda *_: float("inf"))  # a packed head, whatever the timings say
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    _, model, engine = bfloat16_setup(checkpoint)
    head = model.lm_head
    assert isinstance(head, precision.BF16Linear)
    fused_calls = []
    monkeypatch.setattr(head, "greedy", lambda x: fused_calls.append(x.shape) or precision.BF16Linear.greedy(head, x))
    rng = np.random.default_rng(3)
    options = GenerationOptions(max_tokens=12, stop_sequences=())
    requests = [Request(i, rng.integers(3, VOCAB, size=int(n)), options) for i, n in enumerate(rng.integers(1, 20, 10))]
    prefill_choices, choose_tokens = [], engine_module.choose_tokens  # the prefill's calls: none where the head picks
    monkeypatch.setattr(engine_module, "choose_tokens", lambda *args: prefill_choices.append(1) or choose_tokens(*args))
    rows = {}
    for fused in (True, False):
        monkeypatch.setattr(type(head), "fuses_greedy", fused)
        assert engine.decode.head_picks is fused
        fused_calls.clear()
        prefill_choices.clear()
        rows[fused] = {c.index: c.tokens.tolist() for c in engine.generate(requests)}
        assert bool(fused_calls) is fused and bool(prefill_choices) is not fused
    assert rows[True] == rows[False] and all(len(tokens) == 12 for tokens in rows[True].values())
    monkeypatch.setattr(type(head), "fuses_greedy", True)
    for module in (head, model):
        handle = module.register_forward_hook(lambda *_: None)
        assert not engine.decode.head_picks
        handle.remove()
    assert engine.decode.head_picks
    for defaults in (GenerationOptions(logprobs=True), GenerationOptions(temperature=0.7, seed=1)):
        engine.adopt(defaults, RequestVariety())
        assert not engine.decode.head_picks


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
    gemms = [m for m in modules if isinstance(m, (precision.HalfLinear, precision.InPlaceHalfLinear))]
    assert len(gemms) == 4 * model.config.num_layers + 1
    assert all((m.packed if isinstance(m, precision.HalfLinear) else m.parts[0]).dtype == dtype for m in gemms)
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
    """half_linear's rows do not depend on the batch or on the weights' layout (packed, a tied embedding reading the
    packed head, or read in place from the checkpoint's map: half_linear_rows), and equal those of float32 arithmetic
    over the weights widened at load (the policy where the kernels are not built)."""
    from modelzoo.cpu import gemm

    config = tiny_llama_config() if family == "llama" else INT8_FAMILIES[family]()
    checkpoint = save_tiny_model(config, tmp_path / "model")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2, 15, 7, 1, 30)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 48, START))
    runs = {}
    for name, batch in (("b1", 1), ("b7", 7), ("in_place", 7), ("widened", 7)):
        packing_pays = name != "in_place"  # else every weight read where it lies
        monkeypatch.setattr(gemm, "layout_gain", lambda *_: float("inf") if packing_pays else float("-inf"))
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
    summary = json.loads((tmp_path / "in_place" / "artifacts" / "summary.json").read_text())
    assert set(summary["gemm"]["layers"].values()) == {"half_linear_rows"}
    np.testing.assert_array_equal(runs["b1"], runs["b7"])
    np.testing.assert_array_equal(runs["b7"], runs["in_place"])
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
