"""OpenAI batch files in and out: create_inference_h5.py -> run_inference.py -> decode_predictions.py on the
default SmolLM2-135M-Instruct, each output line parsed back and checked field by field against transformers' greedy
continuation of the same prompt, cut where the request says."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import hf_greedy, load_predictions, run_job  # noqa: E402
from openai_requests import (CHAT, COMPLETIONS, EOS, MAX_SEQ_LEN, MODEL, request, run_and_decode,  # noqa: E402
                             write_jsonl, write_run_params)

REQUESTS = [
    request("capital", CHAT, messages=[{"role": "system", "content": "Answer in one sentence."},
                                       {"role": "user", "content": "What is the capital of France?"}], max_tokens=30),
    request("colors", COMPLETIONS, prompt="The three primary colors are", max_tokens=12, stop=[","]),
    request("hot", CHAT, messages=[{"role": "user", "content": "Hi"}], temperature=0.9, seed=5),  # sampled
    request("count", CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "Count to five."}]}],
            max_completion_tokens=6, temperature=0, n=1),
    request("tools", CHAT, messages=[{"role": "user", "content": "Weather?"}], tools=[{"type": "function"}]),
    request("odd-stop", COMPLETIONS, prompt="Hello", stop=["\ud800"]),  # a lone surrogate
    request("free", COMPLETIONS, prompt="def fibonacci(n):"),
]


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory) -> dict:
    """The OpenAI batch file through the three tools; what each printed and wrote."""
    root = tmp_path_factory.mktemp("openai")
    source = write_jsonl(root / "requests.jsonl", REQUESTS)
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", str(MAX_SEQ_LEN), "--output_dir", str(root / "data")]) == 0
    params = write_run_params(root / "params.yaml", root / "data")
    assert run_job(params, root / "run") == 0
    out = root / "responses.jsonl"
    assert decode.main(["--model_dir", str(root / "run"), "--tokenizer", str(MODEL), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    return {"root": root, "lines": [json.loads(line) for line in out.read_text().splitlines()]}


def test_the_data_holds_the_runnable_requests_and_every_request(batch_run):
    with h5py.File(batch_run["root"] / "data" / "data.h5") as h5:
        assert [s.decode() for s in h5["sample_id"][:]] == ["capital", "colors", "hot", "count", "free"]
        assert h5["max_tokens"][:].tolist() == [30, 12, 0, 6, 0]
        assert [json.loads(s) for s in h5["stop_sequences"][:]][1:] == [[[28]], [], [], []]  # "," is token 28
        # Each request's own sampling options; NaN / -1: the params'; none has its own top_p.
        np.testing.assert_array_equal(h5["temperature"][:], np.float32([np.nan, np.nan, 0.9, 0.0, np.nan]))
        assert "top_p" not in h5
        assert h5["seed"][:].tolist() == [-1, -1, 5, -1, -1]
        table = [json.loads(s) for s in h5["requests"][:]]
    assert [(r["custom_id"], r["row"], r["kind"]) for r in table] == [
        ("capital", 0, "chat"), ("colors", 1, "completion"), ("hot", 2, "chat"), ("count", 3, "chat"),
        ("tools", -1, "chat"), ("odd-stop", -1, "completion"), ("free", 4, "completion")]


def test_predictions_carry_the_ids(batch_run):
    files = load_predictions(batch_run["root"] / "run")
    assert files[1]["sample_id"].tolist() == ["capital", "colors"]
    assert files[2]["sample_id"].tolist() == ["hot", "count"]
    assert files[3]["sample_id"].tolist() == ["free", ""]


def expected_continuation(prompt_ids: list[int], limit: int, stops: list[list[int]]) -> tuple[list[int], str]:
    """transformers' greedy tokens for a prompt, cut after the first stop sequence (kept) or at `limit`; the
    OpenAI finish_reason (a stop sequence on the last allowed token is a stop, as the runner ranks it)."""
    tokens = hf_greedy(MODEL, [prompt_ids], limit, stops)[0]
    return tokens, "stop" if any(tokens[-len(s):] == s for s in stops) else "length"


def test_each_response_is_the_reference_continuation(batch_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    by_id = {line["custom_id"]: line for line in batch_run["lines"]}
    def chat(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    cases = {  # custom_id: (prompt ids, the row's limit: min(request, model.max_tokens), its stops besides EOS)
        "capital": (chat(REQUESTS[0]["body"]["messages"]), 16, []),
        "colors": (tokenizer("The three primary colors are")["input_ids"], 12, [[28]]),
        "count": (chat([{"role": "user", "content": "Count to five."}]), 6, []),
        "free": (tokenizer("def fibonacci(n):")["input_ids"], 16, []),
    }
    for custom_id, (prompt_ids, limit, stops) in cases.items():
        tokens, finish = expected_continuation(prompt_ids, limit, [[EOS], *stops])
        line = by_id[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        choice = body["choices"][0]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if finish == "stop" and stops and text.endswith(","):
            text = text[:-1]  # the stop string is left out, as OpenAI does
        assert choice["finish_reason"] == finish, custom_id
        assert (choice["message"]["content"] if "message" in choice else choice["text"]) == text, custom_id
        assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                                 "total_tokens": len(prompt_ids) + len(tokens)}, custom_id
        assert body["object"] == ("chat.completion" if "message" in choice else "text_completion")
        assert body["model"] == "smollm2"


def test_responses_follow_the_input_order_with_error_records(batch_run):
    lines = batch_run["lines"]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in REQUESTS]
    assert [line["id"] for line in lines] == [f"batch_req_{i}" for i in range(1, 8)]
    errors = {line["custom_id"]: line["error"] for line in lines if line["error"]}
    assert errors == {
        "tools": {"code": "invalid_request", "message": "tools is not supported by zoo-infer"},
        "odd-stop": {"code": "invalid_request",
                     "message": "stop string '\\ud800' does not map to token ids of this tokenizer"},
    }
    assert all(line["response"] is None for line in lines if line["error"])


def test_a_sampled_request_is_the_row_of_a_job_sampling_alike(batch_run, tmp_path):
    """The request with its own temperature and seed, among greedy ones, answers what it answers when the
    params give every row that temperature and seed (same place in the file: same random streams)."""
    plain = [dict(r, body={k: v for k, v in r["body"].items() if k not in ("temperature", "seed")})
             if r["custom_id"] == "hot" else r for r in REQUESTS]
    source = write_jsonl(tmp_path / "requests.jsonl", plain)
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", str(MAX_SEQ_LEN), "--output_dir", str(tmp_path / "data")]) == 0
    job_wide = run_and_decode(tmp_path, temperature=0.9, seed=5)
    own = {line["custom_id"]: line for line in batch_run["lines"]}
    hot = own["hot"]["response"]["body"]["choices"][0]
    assert hot == job_wide["hot"]["response"]["body"]["choices"][0]
    assert hot["message"]["content"]  # something was generated (the greedy rows beside it: the test above)


@pytest.mark.parametrize("option, value, message", [
    ("temperature", -1, "temperature must be a number >= 0.0, got -1"),
    ("top_p", 0, "top_p must be a number > 0.0 and <= 1.0, got 0"),
    ("seed", 1.5, "seed must be an integer >= 0, got 1.5"),
    ("seed", "7", "seed must be an integer >= 0, got '7'"),
])
def test_bad_sampling_options_are_error_records(tmp_path, option, value, message):
    source = write_jsonl(tmp_path / "r.jsonl", [REQUESTS[0], request("bad", CHAT, messages=[
        {"role": "user", "content": "Hi"}], **{option: value})])
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert [s.decode() for s in h5["sample_id"][:]] == ["capital"]
        assert json.loads(h5["requests"][1])["error"] == message


@pytest.mark.parametrize("lines, message", [
    ([REQUESTS[0], REQUESTS[0]], "custom_id 'capital' is used on lines 1 and 2; each request needs its own"),
    (["not json"], "line 1 is not valid JSON"),
    ([{"method": "POST"}], "line 1 is not a batch request: it needs a non-empty string custom_id"),
    ([REQUESTS[4]], "no request can run here: tools: tools is not supported by zoo-infer"),
])
def test_bad_batch_files_are_one_line_errors(tmp_path, capsys, lines, message):
    source = tmp_path / "r.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_sample_id_column_is_unicode_in_npz(batch_run):
    with np.load(next((batch_run["root"] / "run" / "artifacts" / "predictions").glob("*.npz"))) as npz:
        assert npz["sample_id"].dtype.kind == "U"  # readable with allow_pickle=False


def test_shards_give_the_unsharded_answers(batch_run):
    """Two job-array shards over the same data: each file keeps its rows' ids, and the decoded answers
    equal the single process's, line for line."""
    root = batch_run["root"]
    for index in ("0", "1"):
        assert run_job(root / "params.yaml", root / "sharded", "--num_shards", "2", "--shard_index", index) == 0
    files = load_predictions(root / "sharded")
    assert [files[step]["sample_id"].tolist() for step in (1, 2, 3)] == [["capital", "colors"], ["hot", "count"],
                                                                         ["free", ""]]
    out = root / "sharded.jsonl"
    assert decode.main(["--model_dir", str(root / "sharded"), "--tokenizer", str(MODEL), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    def without_time(line: dict) -> dict:  # `created` is when the run's files were written
        if line["response"]:
            line = json.loads(json.dumps(line))
            line["response"]["body"].pop("created")
        return line

    assert [without_time(json.loads(line)) for line in out.read_text().splitlines()] == \
        [without_time(line) for line in batch_run["lines"]]
