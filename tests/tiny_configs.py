"""The tiny transformers configs the tests build random checkpoints from, one definition each."""
from __future__ import annotations

from transformers import (BloomConfig, FalconConfig, GPT2Config, GPTBigCodeConfig, GPTJConfig, GPTNeoXConfig,
                          LlamaConfig, MistralConfig, MptConfig, OPTConfig, Qwen2Config)

VOCAB = 96


def tiny_llama_config(**overrides) -> LlamaConfig:
    """Several layers, grouped-query attention (4 heads over 2 KV heads)."""
    values = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                  tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    values.update(overrides)
    return LlamaConfig(**values)


def narrow_llama_config(**overrides) -> LlamaConfig:
    """Two layers of two 16-wide heads (no grouping), 64 positions, a 64-token vocabulary."""
    values = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64)
    return tiny_llama_config(**{**values, **overrides})


LAYERS = 3


def bloom_config(**overrides) -> BloomConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, n_layer=LAYERS, n_head=4, architectures=["BloomForCausalLM"])
    return BloomConfig(**{**values, **overrides})


def mpt_config(attn_config: dict | None = None, **overrides) -> MptConfig:
    values = dict(vocab_size=VOCAB, d_model=64, n_layers=LAYERS, n_heads=4, max_seq_len=128,
                  attn_config=attn_config or {}, architectures=["MptForCausalLM"])
    return MptConfig(**{**values, **overrides})


def falcon_config(**overrides) -> FalconConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                  max_position_embeddings=128, architectures=["FalconForCausalLM"])
    return FalconConfig(**{**values, **overrides})


SMALL = dict(vocab_size=VOCAB, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=128)


def mistral_config() -> MistralConfig:
    """GQA (4 heads over 2 KV heads), a sliding window far shorter than the 40-token prompt."""
    return MistralConfig(**SMALL, hidden_size=64, intermediate_size=128, num_key_value_heads=2, sliding_window=8,
                         tie_word_embeddings=False, architectures=["MistralForCausalLM"])


def qwen2_config(**overrides) -> Qwen2Config:
    """GQA, q / k / v biases, tied embeddings."""
    values = dict(**SMALL, hidden_size=64, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True,
                  architectures=["Qwen2ForCausalLM"])
    values.update(overrides)
    return Qwen2Config(**values)


def neox_config(parallel: bool, **overrides) -> GPTNeoXConfig:
    """Partial rotary (a quarter of each 16-wide head), fused qkv with biases."""
    return GPTNeoXConfig(**SMALL, hidden_size=64, intermediate_size=128, rotary_pct=0.25,
                         use_parallel_residual=parallel, architectures=["GPTNeoXForCausalLM"], **overrides)


def gptj_config() -> GPTJConfig:
    """rotary_dim 8 of head_dim 16, gelu_new MLP."""
    return GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128, rotary_dim=8,
                      bos_token_id=0, eos_token_id=0, architectures=["GPTJForCausalLM"])


# GPT-2 style (tests/test_family_learned_positions.py): learned positions, a smaller vocabulary
LEARNED_VOCAB = 80
TINY = dict(vocab_size=LEARNED_VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=80)


# int8 (tests/test_int8.py, tests/test_int8_compute.py): one config per family, each with what its int8 swap must
# get right, and how far its logits may move (see test_int8.py's docstring).
INT8_LOGITS_REL_TOL = 0.08
INT8_FAMILIES = {
    # fused qkv_proj / gate_up_proj, GQA, lm_head tied to the embedding
    "llama_tied": lambda: tiny_llama_config(vocab_size=VOCAB, tie_word_embeddings=True),
    "mistral_untied": lambda: MistralConfig(**SMALL, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                            sliding_window=8, tie_word_embeddings=False,
                                            architectures=["MistralForCausalLM"]),
    "qwen2_qkv_bias": lambda: Qwen2Config(**SMALL, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                          tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    # Conv1D (in, out) weights, learned positions left in float, tied head
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=80,
                               architectures=["GPT2LMHeadModel"]),
    # project_in / project_out, embeddings narrower than hidden, positions table with offset 2
    "opt_projected": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       ffn_dim=96, max_position_embeddings=80, pad_token_id=1,
                                       do_layer_norm_before=False, word_embed_proj_dim=32, enable_bias=False,
                                       tie_word_embeddings=False, architectures=["OPTForCausalLM"]),
    "bloom": lambda: BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4,
                                 architectures=["BloomForCausalLM"]),
    "mpt": lambda: MptConfig(vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, max_seq_len=128, attn_config={},
                             architectures=["MptForCausalLM"]),
    # FalconLinear, an nn.Linear subclass; GQA groups, biases, untied
    "falcon_new_arch": lambda: FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                                            num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
                                            bias=True, tie_word_embeddings=False, max_position_embeddings=128,
                                            architectures=["FalconForCausalLM"]),
    # the head is `embed_out`
    "gpt_neox": lambda: GPTNeoXConfig(**SMALL, hidden_size=64, intermediate_size=128, rotary_pct=0.25,
                                      architectures=["GPTNeoXForCausalLM"]),
    # lm_head with a bias
    "gptj": lambda: GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128, rotary_dim=8,
                               bos_token_id=0, eos_token_id=0, architectures=["GPTJForCausalLM"]),
    "gpt_bigcode_mqa": lambda: GPTBigCodeConfig(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=80,
                                                n_inner=96, multi_query=True, bos_token_id=0, eos_token_id=0,
                                                architectures=["GPTBigCodeForCausalLM"]),
}
