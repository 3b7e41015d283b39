"""Families with learned absolute positions (GPT-2, OPT, GPT-BigCode) against transformers.

Each case saves a tiny random checkpoint and checks, through run_inference.py, greedy predictions
token-exact with transformers generate() and last-position logits within 1e-4 (tests/harness.py).
"""
from __future__ import annotations

import pytest
from transformers import GPT2Config, GPTBigCodeConfig, OPTConfig

from harness import assert_family_matches_transformers
from tiny_configs import LEARNED_VOCAB as VOCAB
from tiny_configs import TINY

@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    dict(tie_word_embeddings=False, n_inner=72, activation_function="gelu", scale_attn_weights=False),
], ids=["tied_inverse_layer_scale", "untied_gelu_ninner_unscaled"])
def test_gpt2(tmp_path, overrides):
    config = GPT2Config(**TINY, architectures=["GPT2LMHeadModel"], **overrides)
    assert_family_matches_transformers(config, tmp_path)


@pytest.mark.parametrize("overrides", [
    dict(do_layer_norm_before=True),
    # OPT-350m: post-norm, word embeddings of another width (project_in / project_out); also no biases, untied.
    dict(do_layer_norm_before=False, word_embed_proj_dim=32, enable_bias=False, tie_word_embeddings=False),
], ids=["pre_norm", "post_norm_projected_untied"])
def test_opt(tmp_path, overrides):
    config = OPTConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                       max_position_embeddings=80, pad_token_id=1, architectures=["OPTForCausalLM"], **overrides)
    assert_family_matches_transformers(config, tmp_path)


@pytest.mark.parametrize("multi_query, act", [(True, "gelu_pytorch_tanh"), (False, "gelu_fast")],
                         ids=["mqa_starcoder", "mha_gelu_fast"])
def test_gpt_bigcode(tmp_path, multi_query, act):
    config = GPTBigCodeConfig(**TINY, n_inner=96, multi_query=multi_query, activation_function=act,
                              architectures=["GPTBigCodeForCausalLM"])
    assert_family_matches_transformers(config, tmp_path)


def test_learned_positions_limit(tmp_path, capsys):
    """A sequence longer than the position table is a one-line UserError, not an IndexError."""
    import numpy as np

    from harness import prompt_rows, run_job, save_tiny_model, write_h5, write_params

    checkpoint = save_tiny_model(GPT2Config(**{**TINY, "n_positions": 16}, architectures=["GPT2LMHeadModel"]),
                                 tmp_path / "checkpoint")
    write_h5(tmp_path / "data", prompt_rows([np.arange(3, 12).tolist()], 24, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=1, start_token=VOCAB)
    assert run_job(params, tmp_path / "run") != 0
    assert "past the 16 learned position embeddings" in capsys.readouterr().err
