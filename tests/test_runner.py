"""The run_inference.py contract (README: "What the job writes") on a tiny random Llama, against transformers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import (expected_rows, hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model,
                     stacked_predictions, truncate_at_stop, write_h5, write_params)
from modelzoo.models.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, Request
from modelzoo.generation.options import GenerationOptions
from tiny_configs import tiny_llama_config

VOCAB = 96
START = VOCAB  # outside the vocabulary, as recommended
MAX_SEQ_LEN = 40
BATCH = 3
PROMPT_LENGTHS = (3, 9, 1, 17, 5, 12, 2)  # 7 prompts: 3 steps of 3, the last with 2 dummy rows


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[list[int]]:
    """transformers greedy up to max_seq_len, no stop rule."""
    return [hf_greedy(tiny_llama, [p], MAX_SEQ_LEN - len(p))[0] for p in prompts]


def run(tmp_path: Path, checkpoint: Path, rows: np.ndarray, *flags: str, **params) -> Path:
    """Writes the data and params, runs the job, asserts success; returns the model_dir."""
    loop_dim = params.get("loop_dim", 1)
    data = tmp_path / "data"
    write_h5(data, rows, loop_dim=loop_dim)
    params.setdefault("batch_size", BATCH)
    params.setdefault("start_token", START)
    path = write_params(tmp_path / "params.yaml", checkpoint, data, **params)
    model_dir = tmp_path / "run"
    assert run_job(path, model_dir, *flags) == 0
    return model_dir


def with_dummies(rows: np.ndarray, batch: int, pad: int) -> np.ndarray:
    """Appends the dummy rows that fill the last batch."""
    missing = -len(rows) % batch
    return np.concatenate([rows, np.full((missing, rows.shape[1]), pad, dtype=np.int32)])


def test_predictions_match_transformers_and_file_format(tmp_path, tiny_llama, prompts, reference):
    model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START))
    files = sorted(p.name for p in (model_dir / "artifacts" / "predictions").iterdir())
    assert files == ["predictions_1.npz", "predictions_2.npz", "predictions_3.npz"]
    expected = with_dummies(expected_rows(prompts, reference, MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)
    steps = load_predictions(model_dir)
    for step, arrays in steps.items():
        assert arrays["global_step"].shape == () and int(arrays["global_step"]) == step
        assert arrays["predictions"].dtype == np.int32 and arrays["predictions"].shape == (BATCH, MAX_SEQ_LEN)
    np.testing.assert_array_equal(steps[3]["sample_index"], [6, -1, -1])
    assert list(steps[3]["stop_reason"]) == ["max_seq_len", "dummy", "dummy"]
    np.testing.assert_array_equal(steps[1]["num_generated"], [MAX_SEQ_LEN - n for n in PROMPT_LENGTHS[:3]])
    np.testing.assert_array_equal(steps[1]["prompt_length"], PROMPT_LENGTHS[:3])
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "complete"
    assert summary["samples_done"] == 7 and summary["batches_done"] == 3 and summary["batches_remaining"] == 0
    assert summary["generated_tokens"] == sum(MAX_SEQ_LEN - n for n in PROMPT_LENGTHS)
    assert summary["decode_step"]["mode"] == "eager" and summary["decode_step"]["length_buckets"] == [MAX_SEQ_LEN]
    from modelzoo.cpu.kernels import cpu_kernels  # the tiny Llama (head_dim 16, 2 query heads a kv head) takes the kernel
    assert summary["decode_step"]["attention"] == ("cpu_kernel" if cpu_kernels() else "sdpa_grouped_queries")
    assert summary["setup_seconds"] > 0 and summary["decode_step"]["warm_up_seconds"] == 0  # eager on the CPU: none
    parts = summary["setup_parts"]
    assert list(parts) == ["load", "gemm_layout", "kv_cache_and_decode_step"] and min(parts.values()) >= 0
    assert sum(parts.values()) <= summary["setup_seconds"] + 0.002  # each of the four rounded to the millisecond
    assert (model_dir / "artifacts" / "params_inference.yaml").is_file()


def test_compiled_decode_step_matches_transformers(tmp_path, tiny_llama, prompts, reference):
    """runconfig.decode_step compiled (torch.compile, fullgraph): the files equal transformers greedy too, and
    compilation is set-up, reported apart from generation."""
    model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START), decode_step="compiled")
    expected = with_dummies(expected_rows(prompts, reference, MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["decode_step"]["mode"] == "compiled"
    assert summary["decode_step"]["attention"] == "sdpa_grouped_queries"
    assert summary["setup_seconds"] > summary["decode_step"]["warm_up_seconds"] > 0


def test_stop_sequences_of_one_and_two_tokens_are_kept(tmp_path, tiny_llama, prompts, reference):
    one = [reference[1][4]]
    two = reference[3][6:8]
    stops = [one, two]
    model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START), stop_sequences=stops)
    cut = [truncate_at_stop(r, stops) for r in reference]
    assert len(cut[1]) == 5 and cut[1][-1] == one[0]  # the stop token itself is in the output
    assert cut[3][-2:] == two
    expected = with_dummies(expected_rows(prompts, cut, MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)
    steps = load_predictions(model_dir)
    reasons = np.concatenate([steps[s]["stop_reason"] for s in sorted(steps)])[:7]
    expected_reasons = ["stop_sequence" if any(short[-len(s):] == s for s in stops) else "max_seq_len" for short in cut]
    assert list(reasons) == expected_reasons
    assert expected_reasons.count("stop_sequence") >= 2


def test_max_tokens(tmp_path, tiny_llama, prompts, reference):
    model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START), max_tokens=4)
    expected = with_dummies(expected_rows(prompts, [r[:4] for r in reference], MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)
    assert list(load_predictions(model_dir)[1]["stop_reason"]) == ["max_tokens"] * 3


@pytest.mark.parametrize("cap, per_row, most", [(6, [3, 50, 7, 2, 9, 1, 4], 6), (None, [3, 50, 7, 2, 9, 1, 4], None),
                                                (6, None, 6)])
def test_the_jobs_work_counts_each_rows_new_tokens_at_most_max_tokens(tmp_path, tiny_llama, prompts, cap, per_row,
                                                                      most, monkeypatch):
    """The most decode steps a job's rows take (what a 16-bit GEMM layout is weighed against): max_tokens a row,
    rows' own max_tokens being capped by it; unknown (up to max_seq_len) where rows bring their own and no cap. Its
    prompt tokens are those of its rows, each prompt its own length (not every row the longest's)."""
    import h5py
    from modelzoo.runtime import Runtime

    works = []
    original = Runtime._job_work
    monkeypatch.setattr(Runtime, "_job_work", lambda self: works.append(original(self)) or works[-1])
    data = tmp_path / "data"
    path = write_h5(data, prompt_rows(prompts, MAX_SEQ_LEN, START))
    if per_row is not None:
        with h5py.File(path, "a") as handle:
            handle.create_dataset("max_tokens", data=np.array(per_row, dtype=np.int32))
    params = write_params(tmp_path / "params.yaml", tiny_llama, data, BATCH, START, max_tokens=cap, dtype="bfloat16",
                          rows_in_flight=BATCH)
    assert run_job(params, tmp_path / "run") == 0
    if not works:
        pytest.skip("no 16-bit GEMM layout to weigh here (the C++ kernels are not built)")
    steps = -(-len(prompts) // BATCH)  # batches of rows in flight
    new_tokens = most if most is not None else MAX_SEQ_LEN - min(PROMPT_LENGTHS)
    assert works[0].decode_steps == steps * new_tokens
    assert works[0].prompt_tokens == sum(PROMPT_LENGTHS)


def test_start_token_list_pads_with_first_id(tmp_path, tiny_llama, prompts, reference):
    rows = prompt_rows(prompts, MAX_SEQ_LEN, START)
    rows[1, PROMPT_LENGTHS[1]:] = START + 1  # this row marks its start with the second id of the list
    model_dir = run(tmp_path, tiny_llama, rows, start_token=[START + 1, START], max_tokens=5)
    expected = with_dummies(expected_rows(prompts, [r[:5] for r in reference], MAX_SEQ_LEN, START + 1),
                            BATCH, START + 1)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)


def test_rows_without_start_token_or_prompt_are_left_as_they_are(tmp_path, tiny_llama, prompts, reference, caplog):
    rows = prompt_rows(prompts[:2], MAX_SEQ_LEN, START)
    no_start = np.arange(MAX_SEQ_LEN, dtype=np.int32) % 50 + 3
    empty = np.full(MAX_SEQ_LEN, START, dtype=np.int32)
    rows = np.concatenate([rows[:1], no_start[None], empty[None], rows[1:]])
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        model_dir = run(tmp_path, tiny_llama, rows, batch_size=4, max_tokens=3)
    out = load_predictions(model_dir)[1]
    np.testing.assert_array_equal(out["predictions"][1], no_start)
    np.testing.assert_array_equal(out["predictions"][2], empty)
    assert list(out["stop_reason"]) == ["max_tokens", "no_start_token", "empty_prompt", "max_tokens"]
    np.testing.assert_array_equal(out["num_generated"], [3, 0, 0, 3])
    np.testing.assert_array_equal(out["predictions"][3], expected_rows([prompts[1]], [reference[1][:3]], MAX_SEQ_LEN, START)[0])
    assert "1 rows had no start token and 1 an empty prompt" in caplog.text
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    assert summary["rows_without_start_token"] == 1 and summary["rows_with_empty_prompt"] == 1


def test_token_check_returns_the_prompt_span(tmp_path, prompts):
    """The job's token check reads each to-do row once and returns its shortest and longest prompt and their tokens
    in all (rows without a start token or with an empty prompt left out; (0, 0, 0) where none has one): what a
    captured decode step sizes the buckets it captures ahead by, and the prompt work a GEMM layout is weighed
    against."""
    from modelzoo.job.data import GptHDF5MapDataProcessor

    no_start = np.arange(MAX_SEQ_LEN, dtype=np.int32) % 50 + 3
    empty = np.full(MAX_SEQ_LEN, START, dtype=np.int32)
    rows = np.concatenate([prompt_rows(prompts, MAX_SEQ_LEN, START), no_start[None], empty[None], no_start[None],
                           empty[None], no_start[None]])  # 12 rows: 4 steps of 3
    write_h5(tmp_path / "data", rows)
    data = GptHDF5MapDataProcessor(tmp_path / "data", BATCH, 1, START)
    starts = np.array([START])
    assert data.check_prompt_tokens([1, 2, 3, 4], VOCAB, starts) == (min(PROMPT_LENGTHS), max(PROMPT_LENGTHS),
                                                                      sum(PROMPT_LENGTHS))
    assert data.check_prompt_tokens([2], VOCAB, starts) == (5, 17, 17 + 5 + 12)
    assert data.check_prompt_tokens([3], VOCAB, starts) == (2, 2, 2)
    assert data.check_prompt_tokens([4], VOCAB, starts) == (0, 0, 0)
    data.close()


def test_loop_dim_0_reads_and_writes_transposed(tmp_path, tiny_llama, prompts, reference):
    model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START), loop_dim=0, max_tokens=6)
    steps = load_predictions(model_dir)
    assert steps[1]["predictions"].shape == (MAX_SEQ_LEN, BATCH)
    stacked = np.concatenate([steps[s]["predictions"].T for s in sorted(steps)])
    expected = with_dummies(expected_rows(prompts, [r[:6] for r in reference], MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked, expected)


def test_inference_steps_limits_and_clamps(tmp_path, tiny_llama, prompts, caplog):
    rows = prompt_rows(prompts, MAX_SEQ_LEN, START)
    model_dir = run(tmp_path / "a", tiny_llama, rows, "--inference_steps", "2", max_tokens=2)
    assert sorted(load_predictions(model_dir)) == [1, 2]
    with caplog.at_level(logging.WARNING, logger="zoo-infer"):
        model_dir = run(tmp_path / "b", tiny_llama, rows, max_tokens=2, inference_steps=10)
    assert sorted(load_predictions(model_dir)) == [1, 2, 3]
    assert "inference_steps 10 is more than the data holds; clamped to 3" in caplog.text


def test_compile_only_writes_no_predictions(tmp_path, tiny_llama, prompts, caplog):
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        model_dir = run(tmp_path, tiny_llama, prompt_rows(prompts, MAX_SEQ_LEN, START), "--compile_only")
    assert not (model_dir / "artifacts" / "predictions").exists()
    assert "compile_only: params, data and checkpoint are valid" in caplog.text
    assert "KV cache" in caplog.text


def test_checkpoint_path_flag_overrides_params(tmp_path, tiny_llama, prompts, reference):
    data = tmp_path / "data"
    write_h5(data, prompt_rows(prompts[:2], MAX_SEQ_LEN, START))
    params = write_params(tmp_path / "p.yaml", tmp_path / "no_such_checkpoint", data, batch_size=2,
                          start_token=START, max_tokens=3)
    assert run_job(params, tmp_path / "run", "--checkpoint_path", str(tiny_llama)) == 0
    expected = expected_rows(prompts[:2], [r[:3] for r in reference[:2]], MAX_SEQ_LEN, START)
    np.testing.assert_array_equal(stacked_predictions(tmp_path / "run"), expected)


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}, rope_theta=500000.0),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, num_key_value_heads=1),
], ids=["tied", "rope_llama3", "rope_linear_mqa"])
def test_llama_variants_match_transformers(tmp_path, prompts, overrides):
    checkpoint = save_tiny_model(tiny_llama_config(**overrides), tmp_path / "ckpt", seed=3)
    model_dir = run(tmp_path, checkpoint, prompt_rows(prompts, MAX_SEQ_LEN, START), max_tokens=12)
    reference = hf_greedy(checkpoint, prompts, 12)
    expected = with_dummies(expected_rows(prompts, reference, MAX_SEQ_LEN, START), BATCH, START)
    np.testing.assert_array_equal(stacked_predictions(model_dir), expected)


def test_engine_prefill_groups_do_not_change_tokens(tiny_llama, prompts):
    """A tiny prefill budget splits the prompts into more prefill forwards; the tokens stay the same."""
    model, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    forward, prefills = model.forward, []

    def recorded(tokens, positions, cache, slots, last=None, length=None):
        prefills[-1] += tokens.shape[1] > 1  # a forward over several positions: a prefill group
        return forward(tokens, positions, cache, slots, last, length)

    model.forward = recorded

    def tokens(budget: int) -> dict[int, list[int]]:
        prefills.append(0)
        engine = GenerationEngine(model, 4, MAX_SEQ_LEN, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=8),
                                  prefill_token_budget=budget)
        requests = [Request(i, np.array(p)) for i, p in enumerate(prompts)]
        return {c.index: c.tokens.tolist() for c in engine.generate(requests)}

    small, large = tokens(8), tokens(8192)
    assert small == large and len(small) == len(prompts)
    assert prefills[0] > prefills[1], prefills


def test_engine_last_steps_run_only_the_rows_left(tiny_llama, prompts):
    """With step_rows, steps with fewer active slots run the smallest of those row counts that holds them (active
    ones first, then idle ones as throwaway rows) and give the same tokens as full steps."""
    model, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    widths = []
    forward = model.forward

    def recorded(tokens, positions, cache, slots, last=None, length=None):
        if last is None:  # decode steps
            widths.append(tokens.shape[0])
        return forward(tokens, positions, cache, slots, last, length)

    model.forward = recorded

    def tokens(step_rows: tuple[int, ...]) -> dict[int, list[int]]:
        engine = GenerationEngine(model, 4, MAX_SEQ_LEN, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=8),
                                  step_rows=step_rows)
        requests = [Request(i, np.array(p)) for i, p in enumerate(prompts)]
        return {c.index: c.tokens.tolist() for c in engine.generate(requests)}

    full = tokens(())
    assert set(widths) == {4}
    widths.clear()
    assert tokens((3,)) == full and len(full) == len(prompts)  # 7 prompts in 4 slots: the last 3 together
    assert set(widths) == {3, 4} and widths[-1] == 3
    widths.clear()
    assert tokens((2, 3, 8)) == full  # 2 rows hold too few of the last 3, 8 is not below the 4 slots
    assert set(widths) == {3, 4} and widths[-1] == 3


def test_out_of_memory_is_one_line_and_a_rerun_resumes(tmp_path, tiny_llama, prompts, reference, monkeypatch,
                                                       capsys):
    """Memory running out mid-job (a GPU another process fills) ends the job with one error line naming the
    setting to lower; the files written before are complete, and a rerun resumes to the full result."""
    rows = prompt_rows(prompts, MAX_SEQ_LEN, START)
    write_h5(tmp_path / "data", rows)
    params = write_params(tmp_path / "params.yaml", tiny_llama, tmp_path / "data", batch_size=BATCH,
                          start_token=START, rows_in_flight=BATCH)
    decode, calls = GenerationEngine._decode_step, []

    def failing(engine: GenerationEngine) -> None:
        calls.append(1)
        if len(calls) == 60:  # after the first batch's rows are done and written
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        decode(engine)

    monkeypatch.setattr(GenerationEngine, "_decode_step", failing)
    assert run_job(params, tmp_path / "run") == 2
    [line] = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error: ")]
    assert line == ("error: out of memory on cpu while generating (CUDA out of memory. Tried to allocate 2.00 GiB); "
                    "lower runconfig.rows_in_flight (this run: 3) or the data's max_seq_len, then rerun: it resumes "
                    "after the files already written")
    expected = with_dummies(expected_rows(prompts, reference, MAX_SEQ_LEN, START), BATCH, START)
    written = load_predictions(tmp_path / "run")
    assert 1 <= len(written) < 3
    for step, arrays in written.items():
        np.testing.assert_array_equal(arrays["predictions"], expected[(step - 1) * BATCH: step * BATCH])
    summary = json.loads((tmp_path / "run" / "artifacts" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["batches_done"] == len(written)
    monkeypatch.setattr(GenerationEngine, "_decode_step", decode)
    assert run_job(params, tmp_path / "run") == 0
    np.testing.assert_array_equal(stacked_predictions(tmp_path / "run"), expected)
