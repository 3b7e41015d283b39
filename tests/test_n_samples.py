"""n samples of one prompt: n consecutive rows of the data (`sample` 0..n-1), the prompt prefilled once, each row
drawing its own tokens, exactly those of a job where the n rows were separate prompts, at any batch size."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import SMOLLM2_DIR, load_predictions, run_job, save_tiny_model, write_params  # noqa: E402
from modelzoo.models.checkpoint import load_model  # noqa: E402
from modelzoo.generation.engine import GenerationEngine, Request  # noqa: E402
from modelzoo.generation.options import GenerationOptions
from tiny_configs import VOCAB, tiny_llama_config  # noqa: E402

EOS, START = 2, 49152


def engine_run(model, prompts: list[list[int]], num_slots: int, options: GenerationOptions
               ) -> tuple[GenerationEngine, dict[int, list[int]]]:
    engine = GenerationEngine(model, num_slots, 64, torch.device("cpu"), torch.float32, options)
    out = {c.index: c.tokens.tolist() for c in engine.generate(Request(i, np.array(p)) for i, p in enumerate(prompts))}
    return engine, out


@pytest.mark.parametrize("options", [GenerationOptions(max_tokens=12),
                                     GenerationOptions(max_tokens=12, temperature=1.0, seed=4)],
                         ids=["greedy", "sampled"])
def test_a_repeated_prompt_is_prefilled_once_and_each_row_is_its_own(tmp_path, options):
    config = tiny_llama_config(num_hidden_layers=2)
    model, _ = load_model(save_tiny_model(config, tmp_path / "llama"), torch.float32, torch.device("cpu"))
    rng = np.random.default_rng(3)
    repeated, other = rng.integers(0, VOCAB, 11).tolist(), rng.integers(0, VOCAB, 7).tolist()
    prompts = [repeated] * 4 + [other] + [repeated]
    together, out = engine_run(model, prompts, num_slots=6, options=options)
    assert together.prefilled_tokens == len(repeated) + len(other)  # one prefill of each distinct prompt
    alone, reference = engine_run(model, prompts, num_slots=1, options=options)
    assert alone.prefilled_tokens == sum(map(len, prompts))
    assert out == reference
    if options.greedy:
        assert out[0] == out[1] == out[2] == out[3] == out[5]
    else:
        assert len({tuple(out[i]) for i in (0, 1, 2, 3, 5)}) >= 3  # five draws of 12 tokens at temperature 1


PROMPTS = ["Write a haiku about the sea.", "Name a prime number.", "Say hello in French."]


def make_data(root: Path, name: str, lines: list[dict], *flags: str) -> Path:
    source = root / f"{name}.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert create.main(["--input", str(source), "--tokenizer", str(SMOLLM2_DIR), "--max_seq_len", "72",
                        "--chat_template", "--output_dir", str(root / name), *flags]) == 0
    return root / name


@pytest.fixture(scope="module")
def n_runs(tmp_path_factory) -> dict:
    """PROMPTS with --n 3 run at several batch sizes and rows in flight, and the same rows written as nine separate
    prompts; sampled at temperature 0.8."""
    root = tmp_path_factory.mktemp("n_samples")
    samples = make_data(root, "samples", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)], "--n", "3")
    separate = make_data(root, "separate", [{"id": f"q{i}-{k}", "prompt": p} for i, p in enumerate(PROMPTS)
                                            for k in range(3)])
    runs = {}
    for name, data, batch_size, rows in [("n_b1", samples, 1, 1), ("n_b7", samples, 7, 7), ("n_b4_r9", samples, 4, 9),
                                         ("separate", separate, 4, "auto")]:
        params = write_params(root / f"{name}.yaml", SMOLLM2_DIR, data, batch_size=batch_size, start_token=START,
                              stop_sequences=[[EOS]], max_tokens=12, rows_in_flight=rows,
                              model_keys={"temperature": 0.8, "seed": 11})
        assert run_job(params, root / name) == 0
        runs[name] = root / name
    return {"root": root, "runs": runs, "samples": samples}


def rows_by_index(model_dir: Path) -> dict[int, tuple[list[int], int]]:
    """sample_index -> (generated tokens, sample) of a run."""
    out = {}
    for arrays in load_predictions(model_dir).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin = int(arrays["prompt_length"][row])
                tokens = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
                out[index] = (tokens, int(arrays["sample"][row]) if "sample" in arrays else -1)
    return out


def test_the_data_holds_n_numbered_rows_per_prompt(n_runs):
    with h5py.File(n_runs["samples"] / "data.h5") as h5:
        assert h5["sample"][:].tolist() == [0, 1, 2] * 3
        assert [v.decode() for v in h5["sample_id"][:]] == ["q0"] * 3 + ["q1"] * 3 + ["q2"] * 3
        data = h5["data"][:]
    assert (data[0] == data[1]).all() and (data[1] == data[2]).all() and not (data[2] == data[3]).all()


def test_samples_are_the_separate_prompts_rows_at_every_batch_size(n_runs):
    runs = {name: rows_by_index(path) for name, path in n_runs["runs"].items()}
    reference = runs["n_b7"]
    assert [reference[i][1] for i in range(9)] == [0, 1, 2] * 3
    for name, rows in runs.items():
        assert [rows[i][0] for i in range(9)] == [reference[i][0] for i in range(9)], name
    for prompt in range(3):  # three draws of 12 tokens: not all the same
        assert len({tuple(reference[3 * prompt + k][0]) for k in range(3)}) >= 2


def test_decoded_lines_carry_the_sample(n_runs, tmp_path):
    out = tmp_path / "decoded.jsonl"
    assert decode.main(["--model_dir", str(n_runs["runs"]["n_b7"]), "--tokenizer", str(SMOLLM2_DIR),
                        "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["sample_id"], line["sample"]) for line in lines] == [(f"q{i}", k) for i in range(3) for k in range(3)]


@pytest.mark.parametrize("flags, message", [
    (["--n", "0"], "--n must be between 1 and 128, got 0"),
    (["--n", "129"], "--n must be between 1 and 128, got 129"),
    (["--n", "2", "--format", "openai_batch"], "--n is for prompt files"),
])
def test_bad_n_is_a_one_line_error(tmp_path, capsys, flags, message):
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    assert create.main(["--input", str(source), "--tokenizer", str(SMOLLM2_DIR), "--max_seq_len", "32",
                        "--output_dir", str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_manifests_of_jobs_without_the_new_options_stay_as_older_versions_wrote_them(n_runs):
    """Keys newer than some runs on disk stay out of the manifest where they change nothing, so those runs resume."""
    manifest = json.loads((n_runs["runs"]["n_b7"] / "artifacts" / "manifest.json").read_text())
    assert not {"json_schema", "min_p", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "n",
                "response_format"} & set(manifest["model"])
    assert manifest["model"]["temperature"] == 0.8 and manifest["model"]["seed"] == 11


def test_the_python_api_gives_n_samples_as_the_job_writes_them(n_runs):
    """ZooModel.generate with n: n completions per prompt in a row, each the job's row for that sample."""
    from modelzoo.api import ZooModel

    zoo = ZooModel(SMOLLM2_DIR, dtype="float32", max_seq_len=72, rows_in_flight=4)
    options = GenerationOptions(max_tokens=12, stop_sequences=((EOS,),), temperature=0.8, seed=11, n=3)
    answers = zoo.generate(PROMPTS, options, chat_template=True)
    reference = rows_by_index(n_runs["runs"]["n_b7"])
    assert [answer.token_ids for answer in answers] == [reference[i][0] for i in range(9)]
    single = zoo.generate(PROMPTS[:1], [options.overridden(n=1)], chat_template=True)
    assert [answer.token_ids for answer in single] == [reference[0][0]]
