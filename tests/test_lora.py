"""LoRA adapters in PEFT's format: one merged for the whole job, or one per row, each greedy row equal to
transformers + peft's unmerged PeftModel token for token (every family's tiny config, SmolLM2); rows of three
adapters and the bare base mixed in one batch give what each gives alone, at batch sizes 1, 7 and 32; bad adapters
are one-line errors before anything is written; a changed adapter refuses to resume."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import (SMOLLM2_DIR, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model,  # noqa: E402
                     write_h5, write_params)
from tiny_configs import INT8_FAMILIES, VOCAB, tiny_llama_config  # noqa: E402

START, MAX_SEQ_LEN, MAX_TOKENS = VOCAB, 40, 8
PROMPTS = [[5, 17, 33], [60, 2, 9, 81, 44, 12], [7], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80], [41, 3],
           [88, 8, 19, 27], [13, 55, 21, 34, 89]]


def make_adapter(base: Path, folder: Path, targets: Any = "all-linear", r: int = 4, alpha: float = 8.0,
                 seed: int = 1, **config: Any) -> Path:
    """A PEFT LoRA adapter of `base` with random non-zero A and B (std chosen so the update changes tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.6 * param.shape[-1] ** -0.5)
    peft_model.save_pretrained(folder)
    return folder


def run_rows(root: Path, name: str, checkpoint: Path, prompts: list[list[int]], batch_size: int,
             model_keys: dict[str, Any], adapters: list[str] | None = None, dtype: str = "float32",
             max_seq_len: int = MAX_SEQ_LEN, start: int = START) -> dict[int, tuple[list[int], str]]:
    """A job over `prompts` (each row's adapter field from `adapters`): sample_index -> (generated tokens, adapter)."""
    data = root / f"{name}-data"
    write_h5(data, prompt_rows(prompts, max_seq_len, start))
    if adapters is not None:
        with h5py.File(data / "data.h5", "a") as h5:
            h5.create_dataset("adapter", data=adapters, dtype=h5py.string_dtype())
    params = write_params(root / f"{name}.yaml", checkpoint, data, batch_size, start, max_tokens=MAX_TOKENS,
                          dtype=dtype, model_keys=model_keys)
    assert run_job(params, root / name) == 0
    rows = {}
    for arrays in load_predictions(root / name).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin = int(arrays["prompt_length"][row])
                tokens = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
                rows[index] = (tokens, str(arrays["adapter"][row]) if "adapter" in arrays else "")
    return rows


@pytest.mark.parametrize("family", sorted(INT8_FAMILIES))  # one tiny config per family
def test_a_merged_adapter_equals_peft(family, tmp_path):
    base = save_tiny_model(INT8_FAMILIES[family](), tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter")
    got = run_rows(tmp_path, "job", base, PROMPTS, 3, {"adapters": {"tuned": str(adapter)}, "adapter": "tuned"})
    expected = hf_greedy(base, PROMPTS, MAX_TOKENS, adapter=adapter)
    assert [got[i][0] for i in range(len(PROMPTS))] == expected
    assert {a for _, a in got.values()} == {"tuned"}
    assert expected != hf_greedy(base, PROMPTS, MAX_TOKENS)  # the adapter changes the answers


@pytest.fixture(scope="module")
def three_adapters(tmp_path_factory) -> dict:
    """A tiny Llama and three adapters: attention only (q, v), MLP only (rank 8), every projection with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    adapters = {"attn": make_adapter(base, root / "attn", ["q_proj", "v_proj"], r=4, seed=2),
                "mlp": make_adapter(base, root / "mlp", ["gate_proj", "up_proj", "down_proj"], r=8, seed=3),
                "all": make_adapter(base, root / "all", r=2, alpha=4, use_rslora=True, seed=4)}
    keys = {"adapters": {name: str(folder) for name, folder in adapters.items()}}
    alone = {name: run_rows(root, f"alone-{name}", base, PROMPTS, 3, {**keys, "adapter": name}) for name in adapters}
    alone[""] = run_rows(root, "alone-base", base, PROMPTS, 3, {})
    return {"root": root, "base": base, "adapters": adapters, "keys": keys, "alone": alone}


def test_each_adapter_alone_equals_peft(three_adapters):
    for name, folder in three_adapters["adapters"].items():
        got = three_adapters["alone"][name]
        assert [got[i][0] for i in range(len(PROMPTS))] == hf_greedy(three_adapters["base"], PROMPTS, MAX_TOKENS,
                                                                    adapter=folder), name
    answers = {name: [rows[i][0] for i in range(len(PROMPTS))] for name, rows in three_adapters["alone"].items()}
    assert len({json.dumps(a) for a in answers.values()}) == 4  # four different models


@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_rows_mixing_adapters_get_what_each_gets_alone(three_adapters, batch_size):
    """Three adapters and the bare base (named by the base's folder, or by nothing) in one batch, per row."""
    fields = ["attn", "", "mlp", "all", "base"] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(fields))]
    got = run_rows(three_adapters["root"], f"mixed-{batch_size}", three_adapters["base"], prompts, batch_size,
                   three_adapters["keys"], adapters=fields)
    for index, field in enumerate(fields):
        name = "" if field == "base" else field
        assert got[index] == (three_adapters["alone"][name][index % len(PROMPTS)][0], name), (index, field)


def test_rows_naming_none_take_model_adapter(three_adapters):
    fields = ["", "attn", "", "base"]
    got = run_rows(three_adapters["root"], "default", three_adapters["base"], PROMPTS[:4], 2,
                   {**three_adapters["keys"], "adapter": "mlp"}, adapters=fields)
    expected = ["mlp", "attn", "mlp", ""]
    for index, name in enumerate(expected):
        assert got[index] == (three_adapters["alone"][name][index][0], name)
