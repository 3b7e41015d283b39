"""Random-weight checkpoints built from a config, for measuring larger models without a download.

`smollm2`: the default model's shape (SmolLM2-135M), random. `tinyllama`: the shape of TinyLlama-1.1B (22 layers,
hidden 2048, MLP 5632, 32 query and 4 kv heads; 1.2B parameters in all); `llama3b`: the shape of Llama-3.2-3B (28
layers, hidden 3072, MLP 8192, 24 query and 8 kv heads; 3.0B parameters, saved in bfloat16); `llama8b`: the shape of
Llama-3-8B (32 layers, hidden 4096, MLP 14336, 32 query and 8 kv heads, untied head; 7.4B parameters with this
vocabulary, 14.8 GB in bfloat16: it needs about 16 GB free to build). Each with the default
model's tokenizer and vocabulary (49152 entries), so the benchmark's prompts tokenize as for SmolLM2. Weights are
drawn as transformers initialises them (seeded), saved once as a normal Hugging Face folder, and reused.
"""
from __future__ import annotations

import shutil
from pathlib import Path

RANDOM_PREFIX = "random:"
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    "llama3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False),
}
# Shapes saved in bfloat16, as checkpoints of that size are published (the others in float32).
BFLOAT16_SHAPES = ("llama3b", "llama8b")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "generation_config.json")


def is_random(model: str) -> bool:
    return str(model).startswith(RANDOM_PREFIX)


def ensure_random_model(spec: str, tokenizer_dir: Path, out: Path) -> Path:
    """The checkpoint folder for `random:NAME` under `out` (built on first use)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    name = spec[len(RANDOM_PREFIX):]
    if name not in SHAPES:
        raise SystemExit(f"error: unknown random model {name!r}; known: {', '.join(RANDOM_PREFIX + n for n in SHAPES)}")
    folder = out / f"random_{name}"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SHAPES[name])
    torch.manual_seed(0)
    print(f"building {spec} ({name} shape, random weights) into {folder} (once, not timed)", flush=True)
    dtype = torch.bfloat16 if name in BFLOAT16_SHAPES else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a float32 copy of a 3B model would take 12 GB first
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.config.dtype = dtype
    model.save_pretrained(folder)
    del model
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, folder / file)
    return folder
