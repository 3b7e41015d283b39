"""BLOOM, MPT and Falcon (the ALiBi families, and Falcon's rotary variants) against transformers.

Each test saves a tiny random checkpoint and asserts the family contract of
`harness.assert_family_matches_transformers`: last-position logits within 1e-4 and greedy predictions
through run_inference.py token-exact with transformers `generate()` (fp32).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import assert_family_matches_transformers
from modelzoo.errors import UserError
from modelzoo.models.falcon import config_from_hf as falcon_config_from_hf
from modelzoo.models.positions import alibi_slopes
from modelzoo.models.mpt import config_from_hf as mpt_config_from_hf
from modelzoo.models.mpt import mpt_alibi_slopes
from tiny_configs import bloom_config, falcon_config, mpt_config

@pytest.mark.parametrize("overrides", [
    dict(n_head=4),  # power-of-two heads
    dict(hidden_size=72, n_head=6, apply_residual_connection_post_layernorm=True),  # the extra slopes
], ids=["heads4", "heads6_residual_post_ln"])
def test_bloom(tmp_path: Path, overrides: dict) -> None:
    assert_family_matches_transformers(bloom_config(**overrides), tmp_path)


@pytest.mark.parametrize("overrides", [
    dict(n_heads=4, attn_config={"softmax_scale": 0.2}, tie_word_embeddings=False),  # no clip_qkv
    dict(d_model=72, n_heads=6, attn_config={"clip_qkv": 0.5}),  # non-power-of-two heads, clipped qkv
], ids=["heads4_softmax_scale_untied", "heads6_clip_qkv"])
def test_mpt(tmp_path: Path, overrides: dict) -> None:
    assert_family_matches_transformers(mpt_config(**overrides), tmp_path)


@pytest.mark.parametrize("overrides", [
    dict(multi_query=True),  # Falcon-7B: rotary, one KV head, parallel attention
    # Falcon-40B: GQA groups of (queries, k, v), ln_attn / ln_mlp
    dict(new_decoder_architecture=True, num_attention_heads=8, num_kv_heads=2, bias=True, tie_word_embeddings=False),
    dict(new_decoder_architecture=True, num_attention_heads=8, num_kv_heads=2, num_ln_in_parallel_attn=1, alibi=True),
    # Falcon-RW: ALiBi, per-head (q, k, v), sequential attention then MLP
    dict(alibi=True, multi_query=False, parallel_attn=False, bias=True, hidden_size=72, num_attention_heads=6),
    dict(multi_query=False, parallel_attn=False),  # rotary with per-head (q, k, v), sequential
], ids=["multi_query", "new_arch_gqa_bias_untied", "new_arch_one_ln_alibi", "alibi_sequential_heads6",
        "sequential_mha_rotary"])
def test_falcon(tmp_path: Path, overrides: dict) -> None:
    assert_family_matches_transformers(falcon_config(**overrides), tmp_path)


@pytest.mark.parametrize("attn_config, overrides, option", [
    ({"qk_ln": True}, {}, "attn_config.qk_ln"),
    ({"attn_type": "multiquery_attention"}, {}, "attn_config.attn_type"),
    ({"alibi_bias_max": 16}, {}, "attn_config.alibi_bias_max"),
    ({"prefix_lm": True}, {}, "attn_config.prefix_lm"),
    ({}, {"no_bias": False}, "no_bias"),
    ({}, {"expansion_ratio": 2}, "expansion_ratio"),
], ids=["qk_ln", "attn_type", "alibi_bias_max", "prefix_lm", "no_bias", "expansion_ratio"])
def test_mpt_rejects_options_transformers_lacks(attn_config: dict, overrides: dict, option: str) -> None:
    with pytest.raises(UserError, match=option):
        mpt_config_from_hf(mpt_config(attn_config, **overrides))


@pytest.mark.parametrize("overrides, option", [
    (dict(new_decoder_architecture=True, parallel_attn=False), "parallel_attn"),
    (dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn"),
], ids=["new_arch_sequential", "two_norms_old_arch"])
def test_falcon_rejects_layouts_transformers_cannot_run(overrides: dict, option: str) -> None:
    with pytest.raises(UserError, match=option):
        falcon_config_from_hf(falcon_config(**overrides))


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 71, 112])
def test_alibi_slopes_are_bit_identical_to_transformers(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    assert torch.equal(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")))
    # MPT's bias at key offset -1 from the last key is exactly -slope.
    assert torch.equal(mpt_alibi_slopes(heads), -build_mpt_alibi_tensor(heads, 2)[:, 0, 0])
