"""Half-precision weights on CPUs without native half-precision matrix multiplies: float32 arithmetic."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import prompt_rows, run_job, save_tiny_model, stacked_predictions, write_h5, write_params
from modelzoo import precision
from tiny_configs import VOCAB, tiny_llama_config

START = VOCAB  # outside the vocabulary, as recommended


@pytest.mark.parametrize("flags, dtype, device, expected", [
    (set(), torch.bfloat16, "cpu", torch.float32),
    ({"avx512_bf16"}, torch.bfloat16, "cpu", torch.bfloat16),
    ({"amx_bf16"}, torch.bfloat16, "cpu", torch.bfloat16),
    ({"avx512_bf16"}, torch.float16, "cpu", torch.float32),
    ({"avx512_fp16"}, torch.float16, "cpu", torch.float16),
    (set(), torch.float32, "cpu", torch.float32),
    (set(), torch.bfloat16, "cuda", torch.bfloat16),
])
def test_arithmetic_dtype(monkeypatch, flags, dtype, device, expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    assert precision.arithmetic_dtype(dtype, torch.device(device)) == expected


def test_bf16_job_without_native_bf16_is_float32_arithmetic_on_rounded_weights(tmp_path, monkeypatch):
    """The bf16 job equals a float32 job on a copy of the checkpoint whose weights were rounded to bf16."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset())
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    (rounded / "config.json").write_text((checkpoint / "config.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).to(torch.float32) for k, v in weights.items()}, str(rounded / "model.safetensors"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2, 15)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 40, START))
    runs = {}
    for name, folder, dtype in (("bf16", checkpoint, "bfloat16"), ("rounded", rounded, "float32"),
                                ("fp32", checkpoint, "float32")):
        params = write_params(tmp_path / f"{name}.yaml", folder, tmp_path / "data", 2, START, dtype=dtype)
        assert run_job(params, tmp_path / name) == 0
        runs[name] = stacked_predictions(tmp_path / name)
    np.testing.assert_array_equal(runs["bf16"], runs["rounded"])
    summary = json.loads((tmp_path / "bf16" / "artifacts" / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16 weights, float32 arithmetic"
    assert not np.array_equal(runs["bf16"], runs["fp32"]), "rounding must matter, or the test shows nothing"
