"""Log-probabilities in OpenAI batch answers: logprobs and top_logprobs as each request asks, echo scoring a
prompt, and the params snippet the data tool prints for them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import hf_greedy, load_predictions, run_job  # noqa: E402
from openai_requests import (CHAT, COMPLETIONS, MODEL, request, run_and_decode, write_jsonl,  # noqa: E402
                             write_run_params)


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
