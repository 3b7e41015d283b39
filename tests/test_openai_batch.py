"""Ids carried through, and OpenAI batch files in and out: create_inference_h5.py -> run_inference.py ->
decode_predictions.py on the default SmolLM2-135M-Instruct, each output line parsed back and checked field
by field against transformers' greedy continuation of the same prompt, cut where the request says."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import (hf_greedy, load_predictions, prompt_rows, run_job, save_tiny_model, write_h5,  # noqa: E402
                     write_params)
from tiny_configs import VOCAB, tiny_llama_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
EOS, START, MAX_SEQ_LEN, RUN_MAX_TOKENS = 2, 49152, 80, 16


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "smollm2", **body}}


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
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


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_run_params(path: Path, data_dir: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "model": {"checkpoint_path": str(MODEL), "dtype": "float32", "start_token": START, "stop_sequences": [[EOS]],
                  "max_tokens": RUN_MAX_TOKENS},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(data_dir), "batch_size": 2},
        "runconfig": {"device": "cpu"}}))
    return path


def run_and_decode(tmp_path: Path, **model_keys) -> dict[str, dict]:
    """The job on tmp_path/data under the test params with more `model_keys`, decoded as an OpenAI batch:
    custom_id -> output line."""
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    raw = yaml.safe_load(params.read_text())
    raw["model"].update(model_keys)
    params.write_text(yaml.safe_dump(raw))
    assert run_job(params, tmp_path / "run") == 0
    out = tmp_path / "responses.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    return {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}


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


# --- ids from prompt files ---------------------------------------------------------------------------

def test_csv_ids_reach_the_predictions_and_the_decoded_lines(tmp_path):
    source = tmp_path / "prompts.csv"
    source.write_text("id,prompt\nq-7,Name a color.\nq-3,Name a fruit.\nq-9,Name a tree.\n")
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--chat_template",
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data")]) == 0
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    assert run_job(params, tmp_path / "run", "--inference_steps", "1") == 0  # a partial run: 2 of 3
    files = load_predictions(tmp_path / "run")
    assert files[1]["sample_id"].tolist() == ["q-7", "q-3"]
    assert run_job(params, tmp_path / "run") == 0  # resumed: the last batch, one dummy row
    assert load_predictions(tmp_path / "run")[2]["sample_id"].tolist() == ["q-9", ""]
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["sample_index"], r["sample_id"]) for r in records] == [(0, "q-7"), (1, "q-3"), (2, "q-9")]


def test_jsonl_id_field(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"key": 11, "prompt": "a"}, {"key": "b7", "prompt": "b"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--id_field", "key",
                        "--max_seq_len", "16", "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert [s.decode() for s in h5["sample_id"][:]] == ["11", "b7"]


def test_files_without_ids_write_no_sample_id(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data")]) == 0
    with h5py.File(tmp_path / "data" / "data.h5") as h5:
        assert "sample_id" not in h5


@pytest.mark.parametrize("name, text, extra, message", [
    ("p.csv", "id,prompt\na,x\nb,y\na,z\nb,w\n", [], "ids must be unique; used more than once: 'a' (rows 1, 3), "
                                                     "'b' (rows 2, 4)"),
    ("p.jsonl", '{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n', [], "line 2 has no id field 'id'"),
    ("p.jsonl", '{"id": null, "prompt": "x"}\n', [], "id field 'id' must be a non-empty string or an integer"),
    ("p.csv", "prompt\nx\n", ["--id_field", "uid"], "no id column 'uid' (columns: 'prompt'"),
    ("p.txt", "x\n", ["--id_field", "uid"], "a .txt file has no fields, so no --id_field"),
])
def test_bad_ids_are_one_line_errors(tmp_path, capsys, name, text, extra, message):
    source = tmp_path / name
    source.write_text(text)
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_decode_openai_needs_a_batch_made_data(tmp_path, capsys):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    assert create.main(["--input", str(source), "--tokenizer", str(MODEL), "--max_seq_len", "16",
                        "--output_dir", str(tmp_path / "data")]) == 0
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    assert run_job(params, tmp_path / "run") == 0
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL),
                        "--format", "openai_batch"]) == 2
    assert "holds no OpenAI batch requests: make it with create_inference_h5.py --format openai_batch" in \
        capsys.readouterr().err


def test_sample_id_column_is_unicode_in_npz(batch_run):
    with np.load(next((batch_run["root"] / "run" / "artifacts" / "predictions").glob("*.npz"))) as npz:
        assert npz["sample_id"].dtype.kind == "U"  # readable with allow_pickle=False


def run_with_logprobs(tmp_path: Path, requests: list[dict], top_logprobs: int) -> dict[str, dict]:
    """`requests` through the three tools under params keeping logprobs and `top_logprobs`: custom_id -> line."""
    params = write_run_params(tmp_path / "params.yaml", tmp_path / "data")
    raw = yaml.safe_load(params.read_text())
    raw["model"].update(logprobs=True, top_logprobs=top_logprobs)
    params.write_text(yaml.safe_dump(raw))
    source = write_jsonl(tmp_path / "r.jsonl", requests)
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data"), "--params", str(params)]) == 0
    assert run_job(params, tmp_path / "run") == 0
    out = tmp_path / "responses.jsonl"
    assert decode.main(["--model_dir", str(tmp_path / "run"), "--tokenizer", str(MODEL), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    return {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}


def test_logprobs_reach_the_answers_that_ask(tmp_path):
    lines = run_with_logprobs(tmp_path, [
        request("chat", CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
                top_logprobs=2),
        request("text", COMPLETIONS, prompt="Once upon a time", max_tokens=5, logprobs=True, top_logprobs=3),
        request("none", COMPLETIONS, prompt="Hello", max_tokens=3),
        request("many", CHAT, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=4)], 3)
    files = load_predictions(tmp_path / "run")
    rows = {sid: (arrays, row) for arrays in files.values() for row, sid in enumerate(arrays["sample_id"].tolist())}

    def stored(custom_id: str) -> list[float]:
        arrays, row = rows[custom_id]
        begin = int(arrays["prompt_length"][row])
        return arrays["logprobs"][row, begin: begin + int(arrays["num_generated"][row])].tolist()

    chat = lines["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in chat] == stored("chat") and all(entry["logprob"] <= 0 for entry in chat)
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in chat)
    text = lines["text"]["response"]["body"]["choices"][0]["logprobs"]
    assert text["token_logprobs"] == stored("text") and len(text["tokens"]) == 5
    assert lines["none"]["response"]["body"]["choices"][0]["logprobs"] is None  # it did not ask
    # top_logprobs: the request's count of the run's likeliest tokens, descending; greedy: the first is the token.
    for entry, top_values in zip(chat, stored_top("chat", rows)):
        assert [top["logprob"] for top in entry["top_logprobs"]] == top_values[:2]
        assert entry["top_logprobs"][0]["token"] == entry["token"] and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    assert len(text["top_logprobs"]) == 5
    for top, value, top_values in zip(text["top_logprobs"], text["token_logprobs"], stored_top("text", rows)):
        assert 1 <= len(top) <= 3 and max(top.values()) == value == top_values[0]
    assert lines["many"]["error"] == {"code": "invalid_request", "message": "top_logprobs 4 is more than this run "
                                      "keeps: at most 3 (model.top_logprobs in the params)"}


def stored_top(custom_id: str, rows: dict) -> list[list[float]]:
    """The top log-probabilities of each generated position of a request's row, as the predictions file holds them."""
    arrays, row = rows[custom_id]
    begin = int(arrays["prompt_length"][row])
    return arrays["top_logprobs"][row, begin: begin + int(arrays["num_generated"][row])].tolist()


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


@pytest.mark.parametrize("layout, message", [
    ({"a.h5": {"sample_id": ["x", "y"]}, "b.h5": {}}, "has the per-row dataset 'sample_id' but"),
    ({"a.h5": {"sample_id": ["x"]}}, "dataset 'sample_id' has shape (1,), expected (2,)"),
    ({"a.h5": {"stop_sequences": ["[[1]]", "[1, 2]"]}}, "a stop_sequences entry is not a JSON list of token-id lists: "
                                                        "'[1, 2]'"),
])
def test_bad_per_row_datasets_are_one_line_errors(tmp_path, capsys, layout, message):
    for name, per_row in layout.items():
        path = write_h5(tmp_path / "data", prompt_rows([[5, 6], [7]], 16, VOCAB), name=name)
        with h5py.File(path, "a") as h5:
            for key, values in per_row.items():
                h5.create_dataset(key, data=values, dtype=h5py.string_dtype())
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "model")
    capsys.readouterr()  # the checkpoint writer's progress bar
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=2, start_token=VOCAB,
                          max_tokens=2)
    assert run_job(params, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_echo_scores_the_prompt(tmp_path):
    """`echo: true, max_tokens: 0` (how the completions API scores a text, and lm-eval's completions backends
    ask): the prompt's token log-probabilities, equal to transformers' log-softmax, the first token's None; beside
    a request that generates; bad echo requests are error records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    ids = tokenizer("def add(a, b):\n    return a + b")["input_ids"]
    lines = run_with_logprobs(tmp_path, [
        request("text", COMPLETIONS, prompt="The capital of France is Paris", echo=True, max_tokens=0, logprobs=1),
        request("gen", COMPLETIONS, prompt="Once upon a time", max_tokens=4),
        request("ids", COMPLETIONS, prompt=[ids], echo=True, max_tokens=0, logprobs=0),
        request("plain", COMPLETIONS, prompt="Hello there, friend", echo=True, max_tokens=0),
        request("echo-gen", COMPLETIONS, prompt="Hi", echo=True, max_tokens=5),
        request("echo-chat", CHAT, messages=[{"role": "user", "content": "Hi"}], echo=True, max_tokens=0),
        request("short", COMPLETIONS, prompt="Hi", echo=True, max_tokens=0),
        request("vocab", COMPLETIONS, prompt=[5, 49152], echo=True, max_tokens=0),
        request("zero", COMPLETIONS, prompt="Hi", max_tokens=0)], 2)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    for custom_id, prompt in (("text", "The capital of France is Paris"), ("ids", tokenizer.decode(ids)),
                              ("plain", "Hello there, friend")):
        body = lines[custom_id]["response"]["body"]
        choice, tokens = body["choices"][0], tokenizer(prompt)["input_ids"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 0, "total_tokens": len(tokens)}
        if custom_id == "plain":
            assert choice["logprobs"] is None  # it did not ask
            continue
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
        expected = reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
        got = choice["logprobs"]
        assert got["tokens"] == [tokenizer.decode([t]) for t in tokens] and got["token_logprobs"][0] is None
        np.testing.assert_allclose(got["token_logprobs"][1:], expected.numpy(), rtol=0, atol=1e-4)
        if custom_id == "ids":
            assert got["top_logprobs"] is None  # logprobs 0: the tokens' own only
            continue
        assert got["top_logprobs"][0] is None and all(len(top) == 1 for top in got["top_logprobs"][1:])
        greedy = reference[:-1].argmax(-1) == torch.tensor(tokens[1:])
        for top, value, token, is_greedy in zip(got["top_logprobs"][1:], got["token_logprobs"][1:], tokens[1:], greedy):
            assert (list(top) == [tokenizer.decode([token])] and top[tokenizer.decode([token])] == value) == bool(is_greedy)
    generated = lines["gen"]["response"]["body"]
    assert generated["usage"]["completion_tokens"] == 4
    assert generated["choices"][0]["text"] == tokenizer.decode(
        hf_greedy(MODEL, [tokenizer("Once upon a time")["input_ids"]], 4)[0])
    errors = {custom_id: lines[custom_id]["error"]["message"]
              for custom_id in ("echo-gen", "echo-chat", "short", "vocab", "zero")}
    assert errors == {
        "echo-gen": "echo is supported to score a prompt: with max_tokens 0 (got 5); the answer is the prompt's "
                    "token log-probabilities",
        "echo-chat": "echo must be true or false, and only on /v1/completions; got True",
        "short": "echo scores a prompt's tokens after its first: the prompt needs at least 2 tokens",
        "vocab": "prompt token id 49152 is outside the vocabulary of 49152 tokens",
        "zero": "max_tokens must be an integer >= 1 (0 only with echo: true), got 0"}


def test_without_params_the_data_tool_prints_the_logprobs_its_requests_need(tmp_path, capsys):
    """No --params: requests asking logprobs are kept, and the printed model: snippet holds the logprobs and the
    most top_logprobs any request asks; a run with that snippet answers each as asked. With params that keep no
    logprobs, such a request is an error record naming the key."""
    requests = [request("two", CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
                        top_logprobs=2),
                request("three", COMPLETIONS, prompt="Once upon a time", max_tokens=4, logprobs=3),
                request("plain", COMPLETIONS, prompt="Hello", max_tokens=4, logprobs=False)]
    source = write_jsonl(tmp_path / "r.jsonl", requests)
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data")]) == 0
    snippet = yaml.safe_load(capsys.readouterr().out.split("Add to the params YAML:\n")[1])
    assert snippet["model"]["logprobs"] is True and snippet["model"]["top_logprobs"] == 3
    lines = run_and_decode(tmp_path, logprobs=snippet["model"]["logprobs"],
                           top_logprobs=snippet["model"]["top_logprobs"])
    chat = lines["two"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chat) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in chat)
    text = lines["three"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(text["token_logprobs"]) == 4 and len(text["top_logprobs"]) == 4
    assert lines["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
    bare = write_run_params(tmp_path / "bare.yaml", tmp_path / "data2")
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(MODEL),
                        "--max_seq_len", "40", "--output_dir", str(tmp_path / "data2"), "--params", str(bare)]) == 0
    with h5py.File(tmp_path / "data2" / "data.h5") as h5:
        errors = {r["custom_id"]: r["error"] for r in map(json.loads, h5["requests"][:])}
    assert errors["two"] == "logprobs asks for more than this run keeps: model.logprobs: true in the params"
    assert errors["plain"] == ""
