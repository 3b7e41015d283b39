"""Bad data, checkpoints and devices: one line on stderr naming the file, row or weight; exit code 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from harness import prompt_rows, run_job, save_tiny_model, write_h5, write_params
from tiny_configs import narrow_llama_config

VOCAB = 64
START = VOCAB
WIDTH = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_model(narrow_llama_config(vocab_size=VOCAB), tmp_path_factory.mktemp("ckpt"))


def good_rows() -> np.ndarray:
    return prompt_rows([[5, 6, 7], [8, 9]], WIDTH, START)


def fails(tmp_path: Path, capsys, checkpoint: Path, data_dir: Path, **params) -> str:
    """Runs the job, asserts exit code 2, and returns the single stderr line."""
    path = write_params(tmp_path / "params.yaml", checkpoint, data_dir, batch_size=2, start_token=START,
                        max_tokens=2, **params)
    assert run_job(path, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_missing_data_dir(tmp_path, capsys, checkpoint):
    assert "does not exist or is not a folder" in fails(tmp_path, capsys, checkpoint, tmp_path / "nope")


def test_data_dir_without_h5(tmp_path, capsys, checkpoint):
    (tmp_path / "data").mkdir()
    assert "holds no .h5 file" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


def test_h5_without_data_dataset(tmp_path, capsys, checkpoint):
    (tmp_path / "data").mkdir()
    with h5py.File(tmp_path / "data" / "x.h5", "w") as handle:
        handle.create_dataset("tokens", data=good_rows())
    assert "has no dataset 'data' (found: tokens)" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


def test_non_integer_data(tmp_path, capsys, checkpoint):
    write_h5(tmp_path / "data", good_rows().astype(np.float32))
    assert "dataset 'data' must hold integers, found dtype float32" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


def test_wrong_rank(tmp_path, capsys, checkpoint):
    (tmp_path / "data").mkdir()
    with h5py.File(tmp_path / "data" / "x.h5", "w") as handle:
        handle.create_dataset("data", data=good_rows()[None])
    assert "must be 2-D (num_samples, max_seq_len), found shape (1, 2, 16)" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


def test_files_of_different_widths(tmp_path, capsys, checkpoint):
    write_h5(tmp_path / "data", good_rows(), name="a.h5")
    write_h5(tmp_path / "data", prompt_rows([[5]], WIDTH + 4, START), name="b.h5")
    assert "different max_seq_len (a.h5: 16, b.h5: 20)" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


@pytest.mark.parametrize("bad_id", [VOCAB + 5, -1])
def test_token_outside_vocabulary(tmp_path, capsys, checkpoint, bad_id):
    rows = prompt_rows([[5, 6, 7], [8, bad_id]], WIDTH, START)
    write_h5(tmp_path / "data", rows)
    err = fails(tmp_path, capsys, checkpoint, tmp_path / "data")
    assert f"sample 1: token id {bad_id} in its prompt is outside the model's vocabulary (0..63)" in err


def test_start_token_differs_from_the_data_tool(tmp_path, capsys, checkpoint):
    write_h5(tmp_path / "data", good_rows(), start_token=START + 1)
    err = fails(tmp_path, capsys, checkpoint, tmp_path / "data")
    assert "was tokenized with start_token 65 but params model.start_token is [64]" in err


def test_tokenizer_vocabulary_larger_than_model(tmp_path, capsys, checkpoint):
    write_h5(tmp_path / "data", good_rows(), vocab_size=50000, tokenizer="big-tokenizer")
    assert "vocabulary of 50000 tokens (big-tokenizer) but the model has 64" in fails(tmp_path, capsys, checkpoint, tmp_path / "data")


def test_missing_checkpoint_folder(tmp_path, capsys):
    write_h5(tmp_path / "data", good_rows())
    assert "checkpoint folder" in fails(tmp_path, capsys, tmp_path / "nope", tmp_path / "data")


def test_checkpoint_without_config(tmp_path, capsys, checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "config.json").unlink()
    write_h5(tmp_path / "data", good_rows())
    assert "has no config.json" in fails(tmp_path, capsys, broken, tmp_path / "data")


def test_corrupt_safetensors(tmp_path, capsys, checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    write_h5(tmp_path / "data", good_rows())
    assert f"cannot read weights from {broken / 'model.safetensors'}" in fails(tmp_path, capsys, broken, tmp_path / "data")


def test_weights_not_matching_config(tmp_path, capsys, checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 48
    (broken / "config.json").write_text(json.dumps(config))
    write_h5(tmp_path / "data", good_rows())
    err = fails(tmp_path, capsys, broken, tmp_path / "data")
    assert "weight model.layers.0.mlp.down_proj.weight has shape (32, 64) in the checkpoint but the config implies (32, 48)" in err


def test_missing_and_unexpected_weights_are_named(tmp_path, capsys, checkpoint):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    del weights["model.norm.weight"]
    del weights["model.layers.0.self_attn.k_proj.weight"]  # one part of a weight we fuse (qkv_proj)
    save_file(weights, broken / "model.safetensors")
    write_h5(tmp_path / "data", good_rows())
    err = fails(tmp_path, capsys, broken, tmp_path / "data")
    assert ("missing weights: model.layers.0.self_attn.k_proj.weight, model.norm.weight; "
            "unexpected weights: model.layers.0.mlp.extra.weight") in err


def test_unsupported_architecture(tmp_path, capsys, checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["LaMDAForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    write_h5(tmp_path / "data", good_rows())
    err = fails(tmp_path, capsys, broken, tmp_path / "data")
    assert "unsupported architecture LaMDAForCausalLM; supported: " in err and "LlamaForCausalLM" in err


def test_no_checkpoint_anywhere(tmp_path, capsys):
    write_h5(tmp_path / "data", good_rows())
    path = write_params(tmp_path / "params.yaml", tmp_path, tmp_path / "data", batch_size=2, start_token=START)
    text = path.read_text().replace(f"checkpoint_path: {tmp_path}", "checkpoint_path: null")
    path.write_text(text)
    assert run_job(path, tmp_path / "run") == 2
    assert "no checkpoint: set model.checkpoint_path in params or pass --checkpoint_path" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU is present")
def test_cuda_requested_without_gpu(tmp_path, capsys, checkpoint):
    write_h5(tmp_path / "data", good_rows())
    path = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=2, start_token=START)
    assert run_job(path, tmp_path / "run", "--device", "cuda") == 2
    assert "runconfig.device is cuda but no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("params, message", [
    ({"decode_step": "cuda_graph"}, "runconfig.decode_step cuda_graph needs a CUDA device; this job runs on cpu"),
    ({"decode_step": "compiled", "weight_dtype": "int8"}, "decode_step compiled does not take int8 weights on the CPU"),
    ({"decode_step": "compiled", "gemm_backend": "onednn"}, "gemm_backend onednn cannot be compiled"),
    ({"decode_step": "compiled", "model_keys": {"speculative": {"method": "prompt_lookup", "num_tokens": 2}}},
     "runconfig.decode_step compiled does not apply to speculative decoding"),
    ({"decode_step": "graphs"}, "decode_step"),
    ({"decode_step": "compiled", "tensor_parallel": 2},
     "runconfig.decode_step compiled does not take runconfig.tensor_parallel > 1"),
], ids=["cuda_graph_on_cpu", "compiled_int8", "compiled_onednn", "compiled_speculative", "unknown", "compiled_tp"])
def test_decode_step_the_job_cannot_take(tmp_path, capsys, checkpoint, params, message):
    """A decode step mode the job cannot run is one error line, and no predictions file is written."""
    write_h5(tmp_path / "data", good_rows())
    assert message in fails(tmp_path, capsys, checkpoint, tmp_path / "data", **params)
    predictions = tmp_path / "run" / "artifacts" / "predictions"
    assert not list(predictions.glob("*.npz")) if predictions.exists() else True
