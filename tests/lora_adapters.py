"""PEFT LoRA adapters of tiny checkpoints, the LoRA tests' prompts, and jobs over rows naming adapters."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import load_predictions, prompt_rows, run_job, write_h5, write_params  # noqa: E402
from tiny_configs import VOCAB  # noqa: E402

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
             max_seq_len: int = MAX_SEQ_LEN, start: int = START,
             **runconfig: Any) -> dict[int, tuple[list[int], str]]:
    """A job over `prompts` (each row's adapter field from `adapters`; `runconfig`: more runconfig keys):
    sample_index -> (generated tokens, adapter)."""
    data = root / f"{name}-data"
    write_h5(data, prompt_rows(prompts, max_seq_len, start))
    if adapters is not None:
        with h5py.File(data / "data.h5", "a") as h5:
            h5.create_dataset("adapter", data=adapters, dtype=h5py.string_dtype())
    params = write_params(root / f"{name}.yaml", checkpoint, data, batch_size, start, max_tokens=MAX_TOKENS,
                          dtype=dtype, model_keys=model_keys, **runconfig)
    assert run_job(params, root / name) == 0
    rows = {}
    for arrays in load_predictions(root / name).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin = int(arrays["prompt_length"][row])
                tokens = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
                rows[index] = (tokens, str(arrays["adapter"][row]) if "adapter" in arrays else "")
    return rows
