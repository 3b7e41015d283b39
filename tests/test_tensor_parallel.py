"""Tensor parallel == one process: `torchrun --nproc_per_node=2` with runconfig.tensor_parallel 2 writes
the same predictions files, byte for byte, as a single process (float32, greedy).

Byte-identical files, not just equal arrays: a file holds tokens and per-row counters only, and its
bytes do not depend on when or by whom it was written; the partial sums of the split layers add up
in another order, so logits differ in the last bits, but the tiny random models have decisive logits
(harness.save_tiny_model), so the tokens must not. Three torchrun launches cover: GQA with biases on
all four attention projections and the MLP (row-parallel biases), tensor x data parallel (4 ranks);
Qwen2's q/k/v biases, resuming a run a single process began; tied embeddings with an odd vocabulary
(uneven vocabulary split), stopped by SIGTERM, then finished by one process. The rest runs in this
process: the shards each rank loads (fake ranks: loading needs no process group) and bad inputs.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2Config, Qwen2Config

from harness import finish, prompt_rows, run_job, save_tiny_model, torchrun, write_h5, write_params
from tiny_configs import tiny_llama_config

VOCAB = 81  # odd: the vocabulary rows split 40 / 41
START = VOCAB
NUM_SAMPLES = 30
BATCH = 4
STEPS = 8
HEADS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 128}
CONFIGS = {
    "llama_bias": tiny_llama_config(vocab_size=VOCAB, attention_bias=True, mlp_bias=True, **HEADS),
    "qwen2": Qwen2Config(vocab_size=VOCAB, architectures=["Qwen2ForCausalLM"], **HEADS),
    "tied": tiny_llama_config(vocab_size=VOCAB, tie_word_embeddings=True, **{**HEADS, "num_key_value_heads": 4}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Checkpoints, prompts, and for each checkpoint the predictions of one single-process run."""
    root = tmp_path_factory.mktemp("tp")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, size=rng.integers(1, 20)).tolist() for _ in range(NUM_SAMPLES)]
    write_h5(root / "data", prompt_rows(prompts, 64, START))
    for name, config in CONFIGS.items():
        checkpoint = save_tiny_model(config, root / name)
        for tp in (1, 2):
            write_params(root / f"{name}_tp{tp}.yaml", checkpoint, root / "data", batch_size=BATCH, start_token=START,
                         max_tokens=20, log_steps=1, tensor_parallel=tp)
        assert run_job(root / f"{name}_tp1.yaml", root / f"{name}_single") == 0
    return root


def files(model_dir: Path) -> dict[str, bytes]:
    folder = model_dir / "artifacts" / "predictions"
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def test_tensor_times_data_parallel_equals_one_process(root):
    """4 ranks: two tensor-parallel groups of 2, each owning every other step; biases everywhere."""
    output = finish(torchrun(4, root / "llama_bias_tp2.yaml", root / "llama_tp2x2"))
    assert files(root / "llama_tp2x2") == files(root / "llama_bias_single")
    summary = json.loads((root / "llama_tp2x2" / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["shards_reporting"] == "2/2"
    assert summary["samples_done"] == NUM_SAMPLES and summary["batches_done"] == STEPS
    # only rank 0 of each group speaks: two "loaded" lines, two shard summaries
    assert output.count("tensor parallel 2: each rank holds 2 of 4 query heads, 1 of 2 kv heads, 64 of 128 MLP") == 2
    assert sorted(p.name for p in (root / "llama_tp2x2" / "artifacts").glob("summary_shard*")) == [
        "summary_shard0.json", "summary_shard1.json"]


def test_resume_of_a_single_process_run(root, tmp_path):
    """Qwen2 (q/k/v biases): one process writes 3 steps, tensor parallel does the other 5."""
    model_dir = tmp_path / "qwen2"
    assert run_job(root / "qwen2_tp1.yaml", model_dir, "--inference_steps", "3") == 0
    output = finish(torchrun(2, root / "qwen2_tp2.yaml", model_dir))
    assert "resuming: 3 of this shard's 8 steps are already on disk and skipped" in output
    assert files(model_dir) == files(root / "qwen2_single")


def test_sigterm_stops_every_rank_and_resumes(root, tmp_path):
    """Tied embeddings, uneven vocabulary split: SIGTERM to torchrun mid-run leaves only complete files."""
    model_dir = tmp_path / "tied"
    process = torchrun(2, root / "tied_tp2.yaml", model_dir)
    deadline = time.monotonic() + 240
    while len(files(model_dir)) < 2 and process.poll() is None:
        assert time.monotonic() < deadline, "no predictions in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output
    # torchrun forwards SIGTERM rank by rank: a rank that already stopped with the other (they agree on a stop
    # every step) may be gone before its own signal arrives, so it need not say it received one.
    assert 1 <= output.count("received SIGTERM: stopping") <= 2, output
    written = files(model_dir)
    assert 2 <= len(written) < STEPS
    assert {name: files(root / "tied_single")[name] for name in written} == written
    assert not list((model_dir / "artifacts" / "predictions").glob(".*.tmp"))
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "interrupted by SIGTERM" and summary["batches_done"] == len(written)
    assert run_job(root / "tied_tp1.yaml", model_dir) == 0  # one process may finish what two began
    assert files(model_dir) == files(root / "tied_single")


def shard_models(checkpoint: Path) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The whole model, and what ranks 0 and 1 of 2 load (loading needs no process group)."""
    from modelzoo.models.checkpoint import load_model
    from modelzoo.models.tensor_parallel import TensorParallelGroup, shard_plan

    cpu = torch.device("cpu")
    full = load_model(checkpoint, torch.float32, cpu)[0]
    plans = [shard_plan(checkpoint, TensorParallelGroup(rank, 2)) for rank in (0, 1)]
    return full, [load_model(checkpoint, torch.float32, cpu, plan)[0] for plan in plans]


def nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values())


@pytest.mark.parametrize("name", ["llama_bias", "qwen2", "tied"])
def test_each_rank_loads_half_and_the_halves_make_the_whole(root, name):
    full, ranks = shard_models(root / name)
    c, parts = full.config, [m.state_dict() for m in ranks]
    widths = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
    for key, whole in full.state_dict().items():
        if key.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # each rank: its q | its k | its v
            pieces = [p[key].split([w // 2 for w in widths]) for p in parts]
            joined = torch.cat([torch.cat([piece[i] for piece in pieces]) for i in range(3)])
        elif "gate_up_proj" in key:  # its gate | its up
            pieces = [p[key].chunk(2) for p in parts]
            joined = torch.cat([torch.cat([piece[i] for piece in pieces]) for i in range(2)])
        elif key.endswith(("o_proj.weight", "down_proj.weight")):  # input columns
            joined = torch.cat([p[key] for p in parts], dim=1)
        elif key.endswith(("o_proj.bias", "down_proj.bias")):  # rank 0 adds it, once
            assert key not in parts[1]
            joined = parts[0][key]
        elif key.endswith(("embed_tokens.weight", "lm_head.weight")):  # vocabulary rows 0..39, 40..80
            assert [p[key].shape[0] for p in parts] == [40, 41]
            joined = torch.cat([p[key] for p in parts])
        else:  # norms: replicated
            assert all(torch.equal(p[key], whole) for p in parts)
            continue
        assert torch.equal(joined, whole), key
    norms = sum(t.numel() * t.element_size() for key, t in full.state_dict().items() if "norm" in key)
    assert nbytes(ranks[0]) + nbytes(ranks[1]) == nbytes(full) + norms  # nothing held twice but the norms
    for model in ranks:
        assert abs(nbytes(model) / nbytes(full) - 0.5) < 0.01  # e.g. llama_bias: 171264 of 341760 bytes
        assert model.config.num_kv_heads == c.num_kv_heads // 2  # the KV cache holds this rank's heads only
    if name == "tied":
        assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in ranks)


def test_bin_checkpoints_load_the_same_shards(root, tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_bytes((root / "qwen2" / "config.json").read_bytes())
    from safetensors.torch import load_file

    torch.save(load_file(root / "qwen2" / "model.safetensors"), folder / "pytorch_model.bin")
    for from_safetensors, from_bin in zip(shard_models(root / "qwen2")[1], shard_models(folder)[1]):
        a, b = from_safetensors.state_dict(), from_bin.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ranks_form_groups_of_n_consecutive_ranks():
    from modelzoo.job.distributed import tensor_parallel_shard

    shards = [tensor_parallel_shard(rank, 4, 4, 2) for rank in range(4)]
    assert [(s.index, s.count, s.tp_rank, s.writes) for s in shards] == [
        (0, 2, 0, True), (0, 2, 1, False), (1, 2, 0, True), (1, 2, 1, False)]
    # one torchrun of 2 ranks per job of an array of 3: job 2 owns data shard 2 of 3
    assert [(s.index, s.count) for s in (tensor_parallel_shard(r, 2, 2, 2, 3, 2) for r in (0, 1))] == [(2, 3)] * 2


def fails(tmp_path: Path, capsys, checkpoint: Path, root: Path, tensor_parallel: int = 2) -> str:
    params = write_params(tmp_path / "params.yaml", checkpoint, root / "data", batch_size=BATCH, start_token=START,
                          tensor_parallel=tensor_parallel)
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_heads_that_do_not_divide(root, tmp_path, capsys):
    config = tiny_llama_config(vocab_size=VOCAB, **{**HEADS, "hidden_size": 48, "num_attention_heads": 6,
                                                   "num_key_value_heads": 3})
    config.save_pretrained(tmp_path / "ckpt")
    err = fails(tmp_path, capsys, tmp_path / "ckpt", root)
    assert ("runconfig.tensor_parallel 2 must divide the model's num_attention_heads, num_key_value_heads and "
            "intermediate_size; it has num_attention_heads=6, num_key_value_heads=3, intermediate_size=128 "
            "(num_key_value_heads=3: not divisible by 2)") in err


def test_unsupported_family(root, tmp_path, capsys):
    GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "ckpt")
    err = fails(tmp_path, capsys, tmp_path / "ckpt", root)
    assert ("runconfig.tensor_parallel supports LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM; "
            "got GPT2LMHeadModel") in err


def test_tensor_parallel_without_torchrun(root, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    err = fails(tmp_path, capsys, root / "qwen2", root)
    assert "runconfig.tensor_parallel 2 needs one process per rank: launch with torchrun --nproc_per_node=2" in err


def test_world_size_not_a_multiple(root, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # checked before any process group is opened
    err = fails(tmp_path, capsys, root / "qwen2", root)
    assert "WORLD_SIZE 3 is not a multiple of runconfig.tensor_parallel 2" in err
