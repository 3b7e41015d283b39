"""LoRA adapters in PEFT's format: one merged for the whole job, or one per row, each greedy row equal to
transformers + peft's unmerged PeftModel token for token (every family's tiny config, SmolLM2); rows of three
adapters and the bare base mixed in one batch give what each gives alone, at batch sizes 1, 7 and 32; bad adapters
are one-line errors before anything is written; a changed adapter refuses to resume."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import (SMOLLM2_DIR, finish, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model,  # noqa: E402
                     torchrun, write_h5, write_params)
from tiny_configs import INT8_FAMILIES, VOCAB, tiny_llama_config  # noqa: E402

from modelzoo.cpu.kernels import cpu_kernels  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels could not be built here")

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


def test_rows_mixing_adapters_without_the_kernel_get_what_each_gets_alone(three_adapters, monkeypatch):
    """The PyTorch path of per-row updates (every adapter's columns, masked: CUDA's, or a CPU without the C++
    kernels) gives the same rows as the kernel."""
    import modelzoo.models.lora

    monkeypatch.setattr(modelzoo.models.lora, "fused_kernels", lambda x: None)
    fields = ["attn", "", "mlp", "all", "base"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(fields))]
    got = run_rows(three_adapters["root"], "mixed-torch", three_adapters["base"], prompts, 4, three_adapters["keys"],
                   adapters=fields)
    for index, field in enumerate(fields):
        name = "" if field == "base" else field
        assert got[index] == (three_adapters["alone"][name][index % len(PROMPTS)][0], name), (index, field)


def _update_layout(in_features: int, pieces: list[tuple[int, int]], ranks: list[int], seed: int = 0):
    """A stacked LoRA layout for the kernel: adapter g has rank ranks[g] on every piece (output rows) of `pieces`.
    Returns a (C, Kp), b_t (C, N), segments (S, 5) and each column's adapter (C,)."""
    generator = torch.Generator().manual_seed(seed)
    width = pieces[-1][1]
    columns = sum(ranks) * len(pieces)
    a = torch.zeros(columns, -(-in_features // 16) * 16)
    a[:, :in_features] = torch.randn(columns, in_features, generator=generator)
    b_t = torch.zeros(columns, width)
    segments, owner, column = [], [], 0
    for adapter, rank in enumerate(ranks):
        for first, end in pieces:
            b_t[column: column + rank, first:end] = torch.randn(rank, end - first, generator=generator)
            segments.append((adapter, column, column + rank, first, end))
            owner += [adapter] * rank
            column += rank
    return a, b_t, torch.tensor(segments), torch.tensor(owner)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,pieces", [(64, [(0, 48)]), (37, [(0, 20), (20, 27), (27, 34)])])
def test_lora_update_kernel_adds_each_rows_own_adapter_whatever_the_batch(dtype, in_features, pieces):
    """out[m] += B_g A_g x[m] for row m's adapter g only (-1, or an adapter with no update here: unchanged), equal
    to float64 of the masked formula; a row's bits do not depend on the rows beside it."""
    a, b_t, segments, owner = _update_layout(in_features, pieces, ranks=[4, 1, 6])
    rows = 37
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    row_adapter = torch.tensor([(row * 7) % 5 - 1 for row in range(rows)])  # -1 .. 3; 3 has no update
    start = torch.randn(rows, pieces[-1][1], generator=generator).to(dtype)
    out = start.clone()
    cpu_kernels().lora_update_(out, x, row_adapter, a, b_t, segments)
    mask = (row_adapter[:, None] == owner).double()
    expected = start.double() + ((x.double() @ a[:, :in_features].double().T) * mask) @ b_t.double()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    untouched = row_adapter >= 3
    assert torch.equal(out[untouched | (row_adapter == -1)], start[untouched | (row_adapter == -1)])
    for begin, end in [(0, 1), (5, 12), (9, 37)]:
        part = start[begin:end].clone()
        cpu_kernels().lora_update_(part, x[begin:end].contiguous(), row_adapter[begin:end].contiguous(), a, b_t,
                                   segments)
        assert torch.equal(part, out[begin:end]), (begin, end)


@needs_kernels
@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(x=t["x"][:, :-8].contiguous()), "a must be contiguous float32"),
    (lambda t: t.update(x=t["x"][:, :-1]), "x must be a contiguous"),
    (lambda t: t.update(out=t["out"].double()), "out must be contiguous"),
    (lambda t: t.update(row_adapter=t["row_adapter"].int()), "row_adapter must be contiguous int64"),
    (lambda t: t.update(row_adapter=t["row_adapter"] - 2), "row_adapter holds -2"),
    (lambda t: t.update(b_t=t["b_t"][:, :-1].contiguous()), "b_t must be contiguous float32"),
    (lambda t: t.update(a=t["a"][:, :-16].contiguous()), "a must be contiguous float32"),
    (lambda t: t.update(segments=t["segments"][:, :4].contiguous()), "segments must be contiguous int64"),
    (lambda t: t["segments"].__setitem__((0, 4), 999), "segment 0 is out of range"),
    (lambda t: t["segments"].__setitem__((1, 0), -1), "segment 1 is out of range"),
])
def test_lora_update_kernel_rejects_bad_inputs(change, message):
    a, b_t, segments, _ = _update_layout(24, [(0, 16)], ranks=[2, 3])
    tensors = {"out": torch.zeros(4, 16), "x": torch.randn(4, 24), "row_adapter": torch.tensor([0, 1, -1, 0]),
               "a": a, "b_t": b_t, "segments": segments}
    change(tensors)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels().lora_update_(tensors["out"], tensors["x"], tensors["row_adapter"], tensors["a"], tensors["b_t"],
                                   tensors["segments"])


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model"])
def test_speculative_rows_mixing_adapters_get_what_each_gets_alone(three_adapters, method):
    """Verifying drafted tokens runs each row's own adapter (the draft model, the bare base, only proposes)."""
    speculative = {"method": method, "num_tokens": 3}
    if method == "draft_model":
        speculative["checkpoint_path"] = str(three_adapters["base"])
    fields = ["attn", "", "mlp", "all", "base"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(len(fields))]  # repeats: prompt lookup finds drafts
    alone = {name: run_rows(three_adapters["root"], f"spec-alone-{name or 'base'}", three_adapters["base"], prompts, 4,
                            {**three_adapters["keys"], "adapter": name} if name else {})
             for name in ("attn", "mlp", "all", "")}
    got = run_rows(three_adapters["root"], f"spec-{method}", three_adapters["base"], prompts, 4,
                   {**three_adapters["keys"], "speculative": speculative}, adapters=fields)
    summary = json.loads((three_adapters["root"] / f"spec-{method}" / "artifacts" / "summary.json").read_text())
    assert summary["accepted_tokens"] > 0  # drafts were verified, and some kept
    for index, field in enumerate(fields):
        name = "" if field == "base" else field
        assert got[index] == (alone[name][index][0], name), (index, field)


def test_rows_mixing_adapters_in_the_compiled_decode_step(three_adapters):
    """decode_step compiled: the step reads each slot's adapter inside the graph (the updates' PyTorch path, as
    torch.compile cannot trace the C++ kernel) and gives what each adapter gives alone."""
    fields = ["attn", "", "mlp", "all", "base"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(fields))]
    from torch._dynamo.utils import counters

    counters.clear()
    got = run_rows(three_adapters["root"], "mixed-compiled", three_adapters["base"], prompts, 4, three_adapters["keys"],
                   adapters=fields, decode_step="compiled")
    summary = json.loads((three_adapters["root"] / "mixed-compiled" / "artifacts" / "summary.json").read_text())
    assert summary["decode_step"]["mode"] == "compiled" and len(summary["decode_step"]["length_buckets"]) == 1
    assert counters["stats"]["unique_graphs"] == 1  # one step shape: compiled once, whatever the rows' adapters
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


def score_rows(root: Path, name: str, checkpoint: Path, prompts: list[list[int]], model_keys: dict[str, Any],
               adapters: list[str] | None = None) -> dict[int, tuple[list[float], bool, str]]:
    """A scoring job: each prompt's last two tokens scored after the rest (its adapter field from `adapters`):
    sample_index -> (log-probabilities, is_greedy, adapter)."""
    data = root / f"{name}-data"
    write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    with h5py.File(data / "data.h5", "a") as h5:
        h5.create_dataset("continuation_length", data=np.full(len(prompts), 2, dtype=np.int32))
        if adapters is not None:
            h5.create_dataset("adapter", data=adapters, dtype=h5py.string_dtype())
    params = write_params(root / f"{name}.yaml", checkpoint, data, 3, START, max_tokens=MAX_TOKENS,
                          model_keys=model_keys)
    assert run_job(params, root / name) == 0
    rows = {}
    for arrays in load_predictions(root / name).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin, count = int(arrays["prompt_length"][row]), int(arrays["num_generated"][row])
                rows[index] = (arrays["logprobs"][row, begin: begin + count].tolist(), bool(arrays["is_greedy"][row]),
                               str(arrays["adapter"][row]) if "adapter" in arrays else "")
    return rows


def test_scoring_rows_mixing_adapters_score_what_each_scores_alone(three_adapters):
    """Scoring data naming an adapter per row (the same context under two adapters is prefilled once for each):
    each row's log-probabilities those of a job with its adapter alone."""
    root, base, keys = three_adapters["root"], three_adapters["base"], three_adapters["keys"]
    prompts = [p for p in PROMPTS if len(p) >= 3]
    fields = ["attn", "", "mlp", "all"] * len(prompts)
    mixed_prompts = [prompts[i // 4] for i in range(len(fields))]  # each prompt under the four models in turn
    got = score_rows(root, "score-mixed", base, mixed_prompts, keys, adapters=fields)
    assert len(got) == len(fields)
    for name in ("attn", "mlp", "all", ""):
        alone = score_rows(root, f"score-alone-{name or 'base'}", base, prompts, {**keys, "adapter": name} if name else {})
        for index, field in enumerate(fields):
            if field == name:
                logprobs, greedy, adapter = got[index]
                expected = alone[index // 4]
                assert adapter == name and len(logprobs) == 2 and greedy == expected[1], (index, name)
                np.testing.assert_allclose(logprobs, expected[0], atol=1e-4, err_msg=f"row {index}, {name!r}")
    # the four models score differently
    assert len({json.dumps(np.round(got[i][0], 3).tolist()) for i in range(4)}) == 4


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


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory) -> dict:
    """Two random adapters of SmolLM2-135M-Instruct on all its projections."""
    root = tmp_path_factory.mktemp("smollm2-lora")
    return {"root": root, "a": make_adapter(SMOLLM2_DIR, root / "smol-a", r=8, alpha=16, seed=5),
            "b": make_adapter(SMOLLM2_DIR, root / "smol-b", ["q_proj", "k_proj", "o_proj", "down_proj"], r=4, seed=6)}


def test_openai_requests_pick_their_adapter_by_model(smollm2_adapters, tmp_path):
    """An OpenAI batch file whose requests name two adapters, the base (by nothing or by its folder's name) and an
    unknown model: each answer equals transformers + peft greedy, and names its model; the unknown is an error."""
    from transformers import AutoTokenizer

    from data_tools import create_inference_h5 as create
    from data_tools import decode_predictions as decode

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    models = ["smol-a", "smol-b", "", SMOLLM2_DIR.name, "smol-c", "smol-a"]
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
             "Hello", "Water boils at"]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                          "body": {"model": model, "prompt": text, "max_tokens": MAX_TOKENS}}) + "\n"
                              for i, (model, text) in enumerate(zip(models, texts))))
    params = write_params(tmp_path / "params.yaml", SMOLLM2_DIR, tmp_path / "data", 4, 49152,
                          stop_sequences=[[2]], max_tokens=MAX_TOKENS,
                          model_keys={"adapters": {"smol-a": str(smollm2_adapters["a"]),
                                                   "smol-b": str(smollm2_adapters["b"])}})
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(SMOLLM2_DIR),
                        "--max_seq_len", "48", "--output_dir", str(tmp_path / "data"), "--params", str(params)]) == 0
    assert run_job(params, tmp_path / "run") == 0
    out = tmp_path / "responses.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(SMOLLM2_DIR), "--format",
                        "openai_batch", "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    folders = {"smol-a": smollm2_adapters["a"], "smol-b": smollm2_adapters["b"]}
    for line, model, text in zip(lines, models, texts):
        if model == "smol-c":
            assert line["error"]["message"] == (f"model 'smol-c' is neither an adapter of this run (smol-a, smol-b) "
                                                f"nor its base model ({SMOLLM2_DIR})")
            continue
        ids = tokenizer(text)["input_ids"]
        expected = hf_greedy(SMOLLM2_DIR, [ids], MAX_TOKENS, [[2]], adapter=folders.get(model))[0]
        body = line["response"]["body"]
        assert body["model"] == model
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True), (model, text)
    assert lines[0]["response"]["body"]["choices"][0]["text"] != lines[1]["response"]["body"]["choices"][0]["text"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_adapter_field_reaches_the_rows(tmp_path, suffix):
    from data_tools import create_inference_h5 as create

    records = [{"prompt": "Hi", "adapter": "math"}, {"prompt": "Hello", "adapter": ""}, {"prompt": "Yo", "adapter": "code"}]
    source = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif suffix == ".csv":
        source.write_text("prompt,adapter\n" + "".join(f"{r['prompt']},{r['adapter']}\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": [r["prompt"] for r in records], "adapter": [r["adapter"] for r in records]}),
                       source)
    assert create.main(["--input", str(source), "--adapter_field", "adapter", "--tokenizer", str(SMOLLM2_DIR),
                        "--max_seq_len", "16", "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert [v.decode() for v in h5["adapter"][:]] == ["math", "", "code"]


def test_adapter_field_errors(tmp_path, capsys):
    from data_tools import create_inference_h5 as create

    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    assert create.main(["--input", str(source), "--adapter_field", "adapter", "--tokenizer", str(SMOLLM2_DIR),
                        "--max_seq_len", "16", "--output_dir", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err == (f"error: {source}: line 1 has no field 'adapter' (use --adapter_field to pick "
                                       "another)\n")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("mixed", [False, True], ids=["merged", "per-row"])
def test_adapters_under_tensor_parallel(three_adapters, tmp_path, mixed):
    """Each rank holds its slice of every update (rows of q/k/v/gate/up, columns of o/down, whose partial updates
    the layer's all-reduce completes): merged as it reads its slice of the weights, or per row. The tokens of one
    process."""
    fields = ["attn", "", "mlp", "all", "base", "all", "mlp"] if mixed else None
    data = tmp_path / "data"
    write_h5(data, prompt_rows(PROMPTS, MAX_SEQ_LEN, START))
    if fields is not None:
        with h5py.File(data / "data.h5", "a") as h5:
            h5.create_dataset("adapter", data=fields, dtype=h5py.string_dtype())
    keys = three_adapters["keys"] if mixed else {**three_adapters["keys"], "adapter": "all"}
    params = write_params(tmp_path / "tp2.yaml", three_adapters["base"], data, 3, START, max_tokens=MAX_TOKENS,
                          model_keys=keys, tensor_parallel=2)
    finish(torchrun(2, params, tmp_path / "run"))
    seen = 0
    for arrays in load_predictions(tmp_path / "run").values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                name = "all" if fields is None else ("" if fields[index] == "base" else fields[index])
                begin = int(arrays["prompt_length"][row])
                tokens = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
                assert (tokens, str(arrays["adapter"][row])) == three_adapters["alone"][name][index], index
                seen += 1
    assert seen == len(PROMPTS)


def test_bfloat16_rows_mixing_adapters_do_not_depend_on_the_batch(three_adapters):
    fields = ["attn", "", "mlp", "all"] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(fields))]
    runs = [run_rows(three_adapters["root"], f"bf16-{size}", three_adapters["base"], prompts, size,
                     three_adapters["keys"], adapters=fields, dtype="bfloat16") for size in (1, 5)]
    assert runs[0] == runs[1]
    alone = three_adapters["alone"]
    agree = sum(runs[0][i][0] == alone[fields[i]][i % len(PROMPTS)][0] for i in range(len(fields)))
    assert agree >= len(fields) // 2  # bfloat16 keeps most float32 answers of a decisive tiny model


def test_a_shared_prefix_is_prefilled_once_per_adapter(three_adapters, tmp_path):
    """Prompts sharing a 20-token prefix, rows of three adapters and the base: each adapter's prefix keys are its own."""
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, VOCAB, size=20).tolist()
    prompts = [prefix + rng.integers(0, VOCAB, size=n).tolist() for n in (4, 9, 1, 15, 6, 3, 11, 2)]
    fields = ["attn", "mlp", "all", "", "attn", "mlp", "all", ""]
    keys = three_adapters["keys"]
    got = run_rows(tmp_path, "mixed", three_adapters["base"], prompts, 8, keys, adapters=fields, max_seq_len=64)
    summary = json.loads((tmp_path / "mixed" / "artifacts" / "summary.json").read_text())
    assert summary["prefilled_tokens"] == sum(len(p) for p in prompts) - 4 * 20  # each prefix once, not twice
    for name in ("attn", "mlp", "all", ""):
        model_keys = {**keys, "adapter": name} if name else {}
        alone = run_rows(tmp_path, f"alone-{name or 'base'}", three_adapters["base"], prompts, 8, model_keys,
                         max_seq_len=64)
        for index, field in enumerate(fields):
            if field == name:
                assert got[index] == (alone[index][0], name), (index, name)


def test_python_api_and_lm_eval_backend_take_an_adapter(smollm2_adapters):
    """ZooModel(adapter=) generates what transformers + peft generates; lm-eval's zoo-infer backend with
    peft= scores each continuation as transformers + peft's log-softmax does."""
    from modelzoo.api import ZooModel
    from modelzoo.lm_eval_backend import ZooInferLM
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from modelzoo.errors import UserError

    folder = smollm2_adapters["a"]
    with pytest.raises(UserError, match=r"adapter 'missing' \(.*missing\): the folder does not exist"):
        ZooModel(SMOLLM2_DIR, dtype="float32", max_seq_len=64, adapter=folder.parent / "missing")
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 378, 7600, 30]]
    zoo = ZooModel(SMOLLM2_DIR, dtype="float32", max_seq_len=64, rows_in_flight=2, adapter=folder)
    got = [out.token_ids for out in zoo.generate(prompts, zoo.default_options(max_tokens=MAX_TOKENS))]
    assert got == hf_greedy(SMOLLM2_DIR, prompts, MAX_TOKENS, stop_sequences=[[2]], adapter=folder)
    assert got != hf_greedy(SMOLLM2_DIR, prompts, MAX_TOKENS, stop_sequences=[[2]])  # the adapter changes them

    lm = ZooInferLM(pretrained=str(SMOLLM2_DIR), dtype="float32", max_length=64, batch_size=2, peft=str(folder))
    pairs = [(prompts[0], [28, 1345]), (prompts[1], [216])]
    scores = lm._loglikelihood_tokens([((None, None), context, continuation) for context, continuation in pairs])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32),
                                      folder).eval()
    for (context, continuation), (total, _) in zip(pairs, scores):
        ids = torch.tensor([context + continuation])
        with torch.inference_mode():
            logprobs = model(ids).logits[0].log_softmax(-1)
        expected = sum(float(logprobs[len(context) - 1 + i, token]) for i, token in enumerate(continuation))
        assert total == pytest.approx(expected, abs=1e-4)
