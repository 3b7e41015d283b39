"""BTLM (Cerebras BTLM-3B-8K), a remote-code family transformers has no class for.

Two oracles instead of transformers' BTLM:
  * with learned positions, GELU and every muP multiplier at 1, BTLM *is* GPT-2: a transformers GPT-2
    checkpoint relabelled as BTLM must match transformers' GPT-2 logits and greedy tokens;
  * the full architecture (ALiBi with the checkpoint's slopes, SwiGLU, muP embedding / attention /
    logit multipliers, ALiBi scaling) against `reference_logits`, a plain-torch forward written
    straight from the published modeling_btlm.py formulas, recomputing the whole sequence each step.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config

from harness import (expected_rows, family_prompts, hf_greedy, hf_last_logits, our_last_logits, prompt_rows,
                     run_job, save_tiny_model, stacked_predictions, write_h5, write_params)
from modelzoo.models.checkpoint import load_hf_config
from modelzoo.errors import UserError
from modelzoo.models.btlm import BTLMLMHeadModel
from precision_policies import needs_bf16

VOCAB, EMBD, LAYERS, HEADS, INNER = 80, 48, 2, 6, 64  # 6 heads: the non-power-of-two ALiBi slopes
MAX_SEQ_LEN, BATCH, MAX_TOKENS = 64, 3, 12


def paper_alibi_slopes(n: int) -> list[float]:
    """ALiBi slopes (Press et al.): 2^(-8 i / n) for a power of two, else fill from the next power's odd ones."""
    def power_of_two(m: int) -> list[float]:
        return [2 ** (-8 * (i + 1) / m) for i in range(m)]

    closest = 2 ** int(math.log2(n))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n - closest]


def write_checkpoint(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """A BTLM checkpoint folder as the hub has them: config.json (model_type btlm) + model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "btlm", "architectures": ["BTLMLMHeadModel"],
                                                    **config}))
    save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    return folder


def random_btlm_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights of a tiny ALiBi + SwiGLU BTLM, drawn wide so greedy choices are decisive (tied head)."""
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:  # Conv1D layout (in, out), std 1 / sqrt(in)
        return torch.randn(rows, cols, generator=gen) * rows ** -0.5

    def vec(n: int, center: float) -> torch.Tensor:
        return center + 0.1 * torch.randn(n, generator=gen)

    weights = {"transformer.wte.weight": torch.randn(VOCAB, EMBD, generator=gen),
               "transformer.relative_pe.slopes": torch.tensor(paper_alibi_slopes(HEADS))[:, None],
               "transformer.ln_f.weight": vec(EMBD, 1.0), "transformer.ln_f.bias": vec(EMBD, 0.0)}
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            weights[p + norm + ".weight"], weights[p + norm + ".bias"] = vec(EMBD, 1.0), vec(EMBD, 0.0)
        for name, (rows, cols) in {"attn.c_attn": (EMBD, 3 * EMBD), "attn.c_proj": (EMBD, EMBD),
                                   "mlp.c_fc": (EMBD, INNER), "mlp.c_fc2": (EMBD, INNER),
                                   "mlp.c_proj": (INNER, EMBD)}.items():
            weights[p + name + ".weight"], weights[p + name + ".bias"] = mat(rows, cols), vec(cols, 0.0)
    return weights


BTLM_CONFIG = dict(vocab_size=VOCAB, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS, n_inner=INNER, n_positions=128,
                   activation_function="swiglu", position_embedding_type="alibi", layer_norm_epsilon=1e-5,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                   mup_width_scale=0.25, mup_embeddings_scale=1.7, mup_output_alpha=1.6, mup_scale_qk_dot_by_d=True,
                   alibi_scaling=None, tie_word_embeddings=True, torch_dtype="float32")


def reference_logits(w: dict[str, torch.Tensor], config: dict, tokens: list[int]) -> torch.Tensor:
    """Every position's logits (T, vocab) for one sequence, from the published BTLM math, no cache."""
    seq, d = len(tokens), EMBD // HEADS
    h = w["transformer.wte.weight"][tokens] * config["mup_embeddings_scale"]  # (T, E)
    # ALiBi: -slope / scale * |j - i|; alibi_scaling divides the slopes by a factor, fixed or length / train_len.
    scaling = config["alibi_scaling"] or {}
    scale = scaling.get("factor") or max(1.0, seq / scaling.get("train_seq_len", seq))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    alibi = (w["transformer.relative_pe.slopes"] / -scale)[:, :, None] * (j - i).abs()  # (H, T, T)
    for layer in range(LAYERS):
        p = f"transformer.h.{layer}."
        a = F.layer_norm(h, (EMBD,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], 1e-5)
        q, k, v = (a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).split(EMBD, dim=-1)
        q, k, v = (t.view(seq, HEADS, d).transpose(0, 1) for t in (q, k, v))  # (H, T, d)
        scores = q @ k.transpose(-1, -2) / d ** (1.0 if config["mup_scale_qk_dot_by_d"] else 0.5)
        scores = torch.where(j <= i, scores, torch.finfo(scores.dtype).min) + alibi
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, EMBD)
        h = h + out @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = F.layer_norm(h, (EMBD,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], 1e-5)
        up = m @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        gate = m @ w[p + "mlp.c_fc2.weight"] + w[p + "mlp.c_fc2.bias"]
        h = h + (up * F.silu(gate)) @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    h = F.layer_norm(h, (EMBD,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], 1e-5)
    return h @ w["transformer.wte.weight"].T * (config["mup_output_alpha"] * config["mup_width_scale"])


def reference_greedy(w: dict[str, torch.Tensor], config: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full recomputation (the dynamic ALiBi scale follows the growing length)."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < MAX_SEQ_LEN:
        tokens.append(int(reference_logits(w, config, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def run_predictions(tmp_path: Path, checkpoint: Path, prompts: list[list[int]]) -> np.ndarray:
    """run_inference.py on the prompts; the prediction rows (N, MAX_SEQ_LEN)."""
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=BATCH,
                          start_token=VOCAB, max_tokens=MAX_TOKENS)
    assert run_job(params, tmp_path / "run") == 0
    return stacked_predictions(tmp_path / "run")[: len(prompts)]


@pytest.mark.parametrize("overrides", [
    {},
    dict(alibi_scaling={"type": "linear", "factor": 2.0}, mup_scale_qk_dot_by_d=False),
    dict(alibi_scaling={"type": "linear", "train_seq_len": 8}),  # prompts and generations cross 8 tokens
], ids=["alibi_swiglu_mup", "alibi_factor", "alibi_dynamic"])
def test_btlm_matches_published_math(tmp_path, overrides):
    config = {**BTLM_CONFIG, **overrides}
    weights = random_btlm_weights()
    checkpoint = write_checkpoint(tmp_path / "checkpoint", config, weights)
    prompts = family_prompts(VOCAB)
    for prompt, ours in zip(prompts, our_last_logits(checkpoint, prompts)):
        torch.testing.assert_close(ours, reference_logits(weights, config, prompt)[-1], atol=1e-5, rtol=0)
    reference = [reference_greedy(weights, config, p, MAX_TOKENS) for p in prompts]
    np.testing.assert_array_equal(run_predictions(tmp_path, checkpoint, prompts),
                                  expected_rows(prompts, reference, MAX_SEQ_LEN, VOCAB))


def test_btlm_without_alibi_and_mup_is_gpt2(tmp_path):
    """A transformers GPT-2 checkpoint relabelled as BTLM (learned positions, multipliers 1) matches GPT-2."""
    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS, n_positions=80,
                      architectures=["GPT2LMHeadModel"])
    gpt2_dir = save_tiny_model(gpt2, tmp_path / "gpt2")
    btlm_dir = tmp_path / "btlm"
    btlm_dir.mkdir()
    (btlm_dir / "model.safetensors").write_bytes((gpt2_dir / "model.safetensors").read_bytes())
    fields = {key: value for key, value in gpt2.to_dict().items()
              if key in ("vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "activation_function",
                         "layer_norm_epsilon", "scale_attn_weights", "tie_word_embeddings")}
    (btlm_dir / "config.json").write_text(json.dumps({
        **fields, "model_type": "btlm", "architectures": ["BTLMLMHeadModel"], "position_embedding_type": "learned",
        "mup_width_scale": 1.0, "mup_embeddings_scale": 1.0, "mup_output_alpha": 1.0, "mup_scale_qk_dot_by_d": False}))
    prompts = family_prompts(VOCAB)
    for ours, theirs in zip(our_last_logits(btlm_dir, prompts), hf_last_logits(gpt2_dir, prompts)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    reference = hf_greedy(gpt2_dir, prompts, MAX_TOKENS)
    np.testing.assert_array_equal(run_predictions(tmp_path, btlm_dir, prompts),
                                  expected_rows(prompts, reference, MAX_SEQ_LEN, VOCAB))


def test_btlm_config_fields(tmp_path):
    """The pre-rename muP field names read the same; unsupported options are one-line UserErrors."""
    new = write_checkpoint(tmp_path / "new", BTLM_CONFIG, {})
    renamed = {key: value for key, value in BTLM_CONFIG.items() if not key.startswith("mup_")}
    old = write_checkpoint(tmp_path / "old", {**renamed, "embeddings_scale": 1.7, "scale_qk_dot_by_d": True,
                                              "output_logits_scale": 1.6 * 0.25, "width_scale": 0.25}, {})
    config = BTLMLMHeadModel.config_from_hf(load_hf_config(new))
    assert config == BTLMLMHeadModel.config_from_hf(load_hf_config(old))
    assert (config.embeddings_scale, config.output_logits_scale, config.attn_scale_power) == (1.7, 0.4, 1.0)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (HEADS, EMBD // HEADS, INNER)
    for bad in (dict(position_embedding_type="rotary"), dict(alibi_scaling={"type": "dynamic", "factor": 2.0}),
                dict(reorder_and_upcast_attn=True)):
        bad_checkpoint = write_checkpoint(tmp_path / "bad", {**BTLM_CONFIG, **bad}, {})
        with pytest.raises(UserError):
            BTLMLMHeadModel.config_from_hf(load_hf_config(bad_checkpoint))


@needs_bf16
def test_btlm_bfloat16_job_decodes_greedily_through_its_scaled_logits(tmp_path):
    """Its head's logits are scaled afterwards (muP), so its bfloat16 head, which could pick greedy tokens itself,
    does not: the decode step reads the scaled logits, and the job runs to its end."""
    from modelzoo.runtime import Runtime, RuntimePlan
    from modelzoo.runtime_spec import RuntimeSpec

    checkpoint = write_checkpoint(tmp_path / "checkpoint", BTLM_CONFIG, random_btlm_weights())
    runtime = Runtime(RuntimePlan.of(RuntimeSpec(str(checkpoint), dtype="bfloat16", device="cpu", max_seq_len=64,
                                                 rows_in_flight=BATCH)), rows_to_do=BATCH)
    assert getattr(runtime.model.lm_head, "fuses_greedy", False)  # a bfloat16 head that could
    assert not runtime.model.fuses_greedy_head() and not runtime.engine.decode.head_picks
    prompts = family_prompts(VOCAB)
    write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=BATCH,
                          start_token=VOCAB, max_tokens=MAX_TOKENS, dtype="bfloat16")
    assert run_job(params, tmp_path / "run") == 0
    rows = stacked_predictions(tmp_path / "run")[: len(prompts)]
    assert ((rows != VOCAB).sum(axis=1) > np.array([len(p) for p in prompts])).all()  # every row generated
