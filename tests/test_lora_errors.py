"""Bad LoRA adapters and adapter names are one-line errors before anything is written; resuming after a change."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import load_predictions, prompt_rows, run_job, save_tiny_model, write_h5, write_params  # noqa: E402
from lora_adapters import MAX_SEQ_LEN, MAX_TOKENS, PROMPTS, START, make_adapter, run_rows  # noqa: E402
from tiny_configs import tiny_llama_config  # noqa: E402


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _rename_weights(folder: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file({key.replace(old, new): value for key, value in weights.items()},
              str(folder / "adapter_model.safetensors"))


def _other_base(folder: Path, root: Path) -> None:
    """An adapter of a wider Llama, in place of this one."""
    shutil.rmtree(folder)
    other = save_tiny_model(tiny_llama_config(hidden_size=96), root / "other-base")
    make_adapter(other, folder, ["q_proj", "v_proj"], r=4)
    _edit_config(folder, base_model_name_or_path="org/other-model")


SPOILS = {  # how an adapter folder goes bad -> the one-line error it gives
    "missing folder": (lambda f, r: shutil.rmtree(f), "the folder does not exist"),
    "no config": (lambda f, r: (f / "adapter_config.json").unlink(), "no adapter_config.json (a PEFT adapter folder "
                  "has one)"),
    "no weights": (lambda f, r: (f / "adapter_model.safetensors").unlink(),
                   "no adapter_model.safetensors or adapter_model.bin"),
    "prompt tuning": (lambda f, r: _edit_config(f, peft_type="PROMPT_TUNING"),
                      "peft_type 'PROMPT_TUNING' is not read: only LoRA adapters are"),
    "dora": (lambda f, r: _edit_config(f, use_dora=True),
             "DoRA (use_dora: true) is not read: only plain LoRA and rsLoRA are"),
    "modules to save": (lambda f, r: _edit_config(f, modules_to_save=["lm_head"]),
                        "modules_to_save ['lm_head'] (whole trained modules) are not read"),
    "rank": (lambda f, r: _edit_config(f, r=8), "model.layers.0.self_attn.q_proj: lora_A (4, 64) and lora_B (64, 4) do "
             "not have rank r = 8 (lora_A (r, in), lora_B (out, r))"),
    "unknown module": (lambda f, r: _rename_weights(f, "layers.1.self_attn.v_proj", "layers.1.self_attn.w_proj"),
                       "adapts model.layers.1.self_attn.w_proj, which LlamaForCausalLM does not have (or whose LoRA is "
                       "not read: embeddings, the LM head)"),
    "other base": (_other_base, "model.layers.0.self_attn.q_proj: lora_A (4, 96) and lora_B (96, 4) do not fit the "
                   "base's (64, 64) weight (made for org/other-model?)"),
}


@pytest.mark.parametrize("spoil", sorted(SPOILS))
def test_bad_adapters_are_one_line_errors_before_anything_is_written(three_adapters, tmp_path, capsys, spoil):
    folder = tmp_path / "adapter"
    shutil.copytree(three_adapters["adapters"]["attn"], folder)
    make_bad, message = SPOILS[spoil]
    make_bad(folder, tmp_path)
    capsys.readouterr()
    assert job_error(tmp_path, three_adapters["base"], {"adapters": {"tuned": str(folder)}, "adapter": "tuned"},
                     capsys) == f"error: adapter 'tuned' ({folder}): {message}"


def job_error(root: Path, base: Path, model_keys: dict[str, Any], capsys, adapters: list[str] | None = None,
              continuation_length: list[int] | None = None, **runconfig: Any) -> str:
    """Runs a job expected to fail (its rows' adapters, the lengths of their continuations to score, more runconfig
    keys): its one stderr line; nothing written to its model_dir."""
    data = root / "data"
    write_h5(data, prompt_rows(PROMPTS[:2], MAX_SEQ_LEN, START))
    with h5py.File(data / "data.h5", "a") as h5:
        if adapters is not None:
            h5.create_dataset("adapter", data=adapters, dtype=h5py.string_dtype())
        if continuation_length is not None:
            h5.create_dataset("continuation_length", data=np.array(continuation_length, dtype=np.int32))
    params = write_params(root / "params.yaml", base, data, 2, START, max_tokens=MAX_TOKENS, model_keys=model_keys,
                          **runconfig)
    assert run_job(params, root / "run") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert not (root / "run").exists() or not any((root / "run").rglob("*"))
    return err.strip()


def test_rows_naming_an_unlisted_adapter_are_an_error(three_adapters, tmp_path, capsys):
    err = job_error(tmp_path, three_adapters["base"], three_adapters["keys"], capsys, adapters=["attn", "math"])
    assert err == "error: rows name adapters the params do not list: ['math'] (model.adapters: all, attn, mlp)"
    err = job_error(tmp_path, three_adapters["base"], {}, capsys, adapters=["attn", ""])
    assert err == "error: rows name adapters ['attn'] but the params list none (model.adapters)"


def test_adapters_per_row_refuse_the_cuda_graph_step(three_adapters, tmp_path, capsys):
    err = job_error(tmp_path, three_adapters["base"], three_adapters["keys"], capsys, adapters=["attn", "mlp"],
                    decode_step="cuda_graph")
    assert err == ("error: runconfig.decode_step cuda_graph does not take LoRA adapters per row yet; use auto, eager "
                   "or compiled (or one adapter for the whole job, model.adapter, merged into the weights)")


def test_model_adapter_must_be_listed(three_adapters, tmp_path, capsys):
    err = job_error(tmp_path, three_adapters["base"], {**three_adapters["keys"], "adapter": "math"}, capsys)
    assert err == "error: model.adapter 'math' is not one of model.adapters (all, attn, mlp)"


def test_a_changed_adapter_refuses_to_resume_a_moved_one_resumes(three_adapters, tmp_path, capsys):
    root, base = three_adapters["root"], three_adapters["base"]
    fields = ["attn", "mlp", "", "all", "attn", "mlp"]
    prompts = PROMPTS[:6]
    data = tmp_path / "data"
    write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    with h5py.File(data / "data.h5", "a") as h5:
        h5.create_dataset("adapter", data=fields, dtype=h5py.string_dtype())
    moved = {name: tmp_path / f"moved-{name}" for name in three_adapters["adapters"]}
    for name, folder in three_adapters["adapters"].items():
        shutil.copytree(folder, moved[name])
    params = write_params(tmp_path / "params.yaml", base, data, 2, START, max_tokens=MAX_TOKENS,
                          model_keys={"adapters": {name: str(folder) for name, folder in moved.items()}})
    assert run_job(params, tmp_path / "run", "--inference_steps", "1") == 0
    shutil.copy(three_adapters["adapters"]["all"] / "adapter_model.safetensors", moved["attn"])  # another adapter
    _edit_config(moved["attn"], r=2, lora_alpha=4, use_rslora=True)
    capsys.readouterr()
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "holds predictions made from different inputs (changed: model.adapters.attn" in err, err
    shutil.rmtree(moved["attn"])
    shutil.copytree(three_adapters["adapters"]["attn"], moved["attn"])  # the same files again, copied anew
    assert run_job(params, tmp_path / "run") == 0
    got = run_rows(root, "resume-reference", base, prompts, 2, three_adapters["keys"], adapters=fields)
    files = load_predictions(tmp_path / "run")
    assert len(files) == 3
    for arrays in files.values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            begin = int(arrays["prompt_length"][row])
            tokens = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
            assert (tokens, str(arrays["adapter"][row])) == got[index]
