"""Checkpoint formats: sharded safetensors with an index, base-model weight names, dtype cast on load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from harness import our_last_logits, save_tiny_model
from modelzoo.errors import UserError
from modelzoo.models.checkpoint import load_model
from tiny_configs import narrow_llama_config

PROMPT = [[5, 9, 2, 31, 7]]


def test_sharded_safetensors_with_index(tmp_path):
    single = save_tiny_model(narrow_llama_config(), tmp_path / "single")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    weights = {path: load_model(path, torch.float32, torch.device("cpu"))[0].state_dict() for path in (sharded, single)}
    assert weights[sharded].keys() == weights[single].keys()
    assert all(torch.equal(weights[sharded][name], weights[single][name]) for name in weights[single])
    # The same weights at other addresses: a one-row product may sum in another order where they are aligned otherwise.
    torch.testing.assert_close(our_last_logits(sharded, PROMPT)[0], our_last_logits(single, PROMPT)[0],
                               rtol=0, atol=1e-5)


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


def _mapped_file_kib() -> int:
    """This process's resident pages of mapped files (RssFile in /proc/self/status), KiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile line in /proc/self/status")


def test_mapped_weights_are_released_once_converted(tmp_path):
    """read_safetensors maps the file: a weight the loader converts is read once and release_mapped drops its pages
    from this process (the file is never resident beside the converted copies), and a weight kept as it is still
    reads the file's values afterwards, writable without touching the file."""
    from modelzoo.models.checkpoint import read_safetensors
    from modelzoo.cpu.memory import release_mapped

    torch.manual_seed(0)
    tensors = {f"w{i}": torch.randn(4096, 1024) for i in range(4)}  # 16 MiB each
    save_file(tensors, tmp_path / "model.safetensors")
    tensors["w0"].to(torch.bfloat16)  # the conversion's own code pages mapped in before counting
    slack = 4 * 1024  # other files' pages this process touches meanwhile (its own code), far below a weight
    before = _mapped_file_kib()
    converted, grown = {}, []
    for name, tensor in read_safetensors(tmp_path / "model.safetensors"):
        if name == "w3":
            converted[name] = tensor  # kept as it is: a view of the map
        else:
            converted[name] = tensor.to(torch.bfloat16)  # a copy: the mapped pages are no longer needed
            release_mapped(tensor)
        grown.append(_mapped_file_kib() - before)
    assert max(grown) <= slack, grown  # nothing converted stays mapped in
    release_mapped(torch.zeros(1024, 1024))  # not a view of a map: nothing happens
    for name, tensor in tensors.items():
        expected = tensor if name == "w3" else tensor.to(torch.bfloat16)
        assert torch.equal(converted[name], expected), name
    release_mapped(converted["w3"])
    assert torch.equal(converted["w3"], tensors["w3"])  # read again from the file
    converted["w3"][0, 0] = 1.0  # copy-on-write: the kept weight is writable, the file unchanged
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w3"], tensors["w3"])


def _status_kib(field: str) -> int:
    """A KiB figure of /proc/self/status (VmRSS, VmHWM: the peak since the last reset)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} line in /proc/self/status")


def test_loading_a_converted_checkpoint_holds_it_once(tmp_path):
    """Loading a float32 checkpoint in bfloat16 converts every weight: the peak resident memory of the load grows by
    the bfloat16 weights and at most one float32 weight being converted, never by the file (RSS within the bound)."""
    config = narrow_llama_config(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8,
                                 vocab_size=4096, tie_word_embeddings=False)
    folder = save_tiny_model(config, tmp_path / "ckpt")
    file_kib = (folder / "model.safetensors").stat().st_size // 1024
    assert file_kib > 30 * 1024
    load_model(folder, torch.bfloat16, torch.device("cpu"))  # the conversion's code and allocator warmed up
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident size
    before = _status_kib("VmRSS")
    model, _ = load_model(folder, torch.bfloat16, torch.device("cpu"))
    largest_float32_kib = 4096 * 512 * 4 // 1024  # the embedding and the head
    grown = _status_kib("VmHWM") - before
    assert grown <= file_kib // 2 + largest_float32_kib + 4 * 1024, (grown, file_kib)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], reference.model.embed_tokens.weight)


def test_fused_weights_kept_as_their_parts(tmp_path):
    """keep_parts: q | k | v and gate | up (with Qwen2's q, k, v biases) load as JoinedLinear layers whose parts are
    the checkpoint's own weights, views of its memory map (no copy), that multiply as the concatenated layer does;
    the whole model's logits are the same bits."""
    from tiny_configs import INT8_FAMILIES

    from modelzoo.cpu.memory import _mapping_of
    from modelzoo.cpu.precision import JoinedLinear

    folder = save_tiny_model(INT8_FAMILIES["qwen2_qkv_bias"](), tmp_path / "qwen2")
    fused, _ = load_model(folder, torch.float32, torch.device("cpu"))
    apart, _ = load_model(folder, torch.float32, torch.device("cpu"), keep_parts=True)
    stored = load_file(folder / "model.safetensors")
    for name, pieces in (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))):
        layer = apart.get_submodule(f"model.layers.1.{name}")
        assert isinstance(layer, JoinedLinear) and layer.weight.device.type == "meta"
        assert all(_mapping_of(part) is not None for part in layer.parts)
        owner = name.split(".")[0]
        for part, piece in zip(layer.parts, pieces):
            assert torch.equal(part, stored[f"model.layers.1.{owner}.{piece}_proj.weight"])
        x = torch.randn(3, layer.in_features)
        assert torch.equal(layer(x), fused.get_submodule(f"model.layers.1.{name}")(x))
    assert apart.model.layers[0].self_attn.qkv_proj.bias is not None

    def logits(model: torch.nn.Module) -> torch.Tensor:
        from modelzoo.models.kv_cache import KVCache

        c = model.config
        cache = KVCache(c.num_layers, 1, c.num_kv_heads, 5, c.head_dim, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            return model(torch.tensor(PROMPT), torch.arange(5)[None], cache, None)[0]

    assert torch.equal(logits(apart), logits(fused))


def test_a_fused_weights_part_of_the_wrong_shape_is_named(tmp_path):
    folder = save_tiny_model(narrow_llama_config(num_hidden_layers=1), tmp_path / "llama")
    weights = load_file(folder / "model.safetensors")
    for name, tensor, message in (
            ("model.layers.0.self_attn.k_proj.weight", lambda w: w[:, :-1], "k_proj.weight"),
            ("model.layers.0.mlp.up_proj.weight", lambda w: w[:-16], "up_proj.weight have 112 rows")):
        broken = dict(weights, **{name: tensor(weights[name]).contiguous()})
        save_file(broken, folder / "model.safetensors")
        with pytest.raises(UserError, match=message):
            load_model(folder, torch.float32, torch.device("cpu"), keep_parts=True)
