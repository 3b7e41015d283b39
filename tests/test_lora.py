"""LoRA adapters in PEFT's format: one merged for the whole job, or one per row, each greedy row equal to
transformers + peft's unmerged PeftModel token for token (every family's tiny config); rows of three adapters and the
bare base mixed in one batch give what each gives alone, at batch sizes 1, 7 and 32, and on the PyTorch path, under
speculative decoding, in the compiled decode step, scored, under tensor parallel, in bfloat16 and sharing a prefix."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import (finish, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model, torchrun,  # noqa: E402
                     write_h5, write_params)
from lora_adapters import MAX_SEQ_LEN, MAX_TOKENS, PROMPTS, START, make_adapter, run_rows  # noqa: E402
from tiny_configs import INT8_FAMILIES, VOCAB  # noqa: E402


@pytest.mark.parametrize("family", sorted(INT8_FAMILIES))  # one tiny config per family
def test_a_merged_adapter_equals_peft(family, tmp_path):
    base = save_tiny_model(INT8_FAMILIES[family](), tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter")
    got = run_rows(tmp_path, "job", base, PROMPTS, 3, {"adapters": {"tuned": str(adapter)}, "adapter": "tuned"})
    expected = hf_greedy(base, PROMPTS, MAX_TOKENS, adapter=adapter)
    assert [got[i][0] for i in range(len(PROMPTS))] == expected
    assert {a for _, a in got.values()} == {"tuned"}
    assert expected != hf_greedy(base, PROMPTS, MAX_TOKENS)  # the adapter changes the answers


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
