"""Rotary families against transformers: Mistral and Qwen2 (Llama aliases), GPT-NeoX, GPT-J.

Each test saves a tiny random checkpoint and checks last-position logits (1e-4) and greedy
predictions through run_inference.py (token-exact) against transformers, fp32.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPTNeoXConfig

from harness import (assert_family_matches_transformers, family_prompts, hf_last_logits, our_last_logits,
                     save_tiny_model)
from modelzoo.models.gpt_neox import config_from_hf as gpt_neox_config_from_hf
from modelzoo.models.llama import config_from_hf as llama_config_from_hf
from tiny_configs import SMALL, VOCAB, gptj_config, mistral_config, neox_config, qwen2_config

def test_mistral_sliding_window_matches_transformers(tmp_path):
    assert llama_config_from_hf(mistral_config()).sliding_windows == (8, 8, 8)
    assert_family_matches_transformers(mistral_config(), tmp_path)


def test_qwen2_biases_and_layer_sliding_window_match_transformers(tmp_path):
    # Layers >= max_window_layers slide (transformers' layer_types); the first stays full.
    config = qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert llama_config_from_hf(config).sliding_windows == (None, 8, 8)
    assert_family_matches_transformers(config, tmp_path)


def test_qwen2_window_ignored_without_use_sliding_window():
    ours = llama_config_from_hf(qwen2_config(sliding_window=8))
    assert ours.sliding_windows == () and ours.qkv_bias and not ours.attention_bias


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_gpt_neox_matches_transformers(tmp_path, parallel):
    assert_family_matches_transformers(neox_config(parallel), tmp_path)


def test_gpt_neox_reads_hub_rotary_fields():
    # Hub config.json spellings (rotary_pct, rotary_emb_base), moved into rope_parameters by transformers 5.
    ours = gpt_neox_config_from_hf(GPTNeoXConfig(**SMALL, hidden_size=64, intermediate_size=128, rotary_pct=0.5,
                                                 rotary_emb_base=500))
    assert (ours.rotary_dim, ours.rope.theta, ours.head_dim) == (8, 500.0, 16)


def test_gptj_matches_transformers(tmp_path):
    assert_family_matches_transformers(gptj_config(), tmp_path)


def test_pytorch_model_bin_checkpoint_loads(tmp_path):
    """A pytorch_model.bin folder (tied embed_out absent, a stale rotary inv_freq buffer present) loads
    and gives transformers' logits. transformers 5 always saves safetensors, so the .bin is written here."""
    checkpoint = save_tiny_model(neox_config(True, tie_word_embeddings=True), tmp_path / "safetensors")
    weights = load_file(checkpoint / "model.safetensors")
    assert "embed_out.weight" not in weights
    weights["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    legacy = tmp_path / "bin"
    legacy.mkdir()
    shutil.copy(checkpoint / "config.json", legacy / "config.json")
    torch.save(weights, legacy / "pytorch_model.bin")
    prompts = family_prompts(VOCAB)
    for ours, theirs in zip(our_last_logits(legacy, prompts), hf_last_logits(checkpoint, prompts)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
