"""Checkpoint formats: sharded safetensors with an index, base-model weight names, dtype cast on load."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from harness import our_last_logits, save_tiny_model
from modelzoo.checkpoint import load_model
from tiny_configs import narrow_llama_config

PROMPT = [[5, 9, 2, 31, 7]]


def test_sharded_safetensors_with_index(tmp_path):
    single = save_tiny_model(narrow_llama_config(), tmp_path / "single")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    torch.testing.assert_close(our_last_logits(sharded, PROMPT)[0], our_last_logits(single, PROMPT)[0], rtol=0, atol=0)


def test_base_model_weight_names_without_prefix(tmp_path):
    """Hub GPT-2 checkpoints name weights `h.0.attn...`, not `transformer.h.0.attn...`."""
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, architectures=["GPT2LMHeadModel"])
    full = save_tiny_model(config, tmp_path / "full")
    bare = tmp_path / "bare"
    shutil.copytree(full, bare)
    weights = load_file(bare / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, bare / "model.safetensors")
    assert "h.0.attn.c_attn.weight" in load_file(bare / "model.safetensors")
    torch.testing.assert_close(our_last_logits(bare, PROMPT)[0], our_last_logits(full, PROMPT)[0], rtol=0, atol=0)


def test_dtype_is_cast_on_load(tmp_path):
    config = narrow_llama_config(num_hidden_layers=1, tie_word_embeddings=True)
    checkpoint = save_tiny_model(config, tmp_path / "ckpt")
    model, _ = load_model(checkpoint, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, not two copies
