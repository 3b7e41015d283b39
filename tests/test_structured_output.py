"""Structured output and per-request options through the three tools on SmolLM2-135M-Instruct: an OpenAI batch file
mixing chat and completion requests, per-request temperature / seed, n 1-4, json_schema, json_object, logprobs with
top_logprobs, stops and limits; every answer validated with the `openai` package's own types, every JSON answer
against its schema; greedy rows under a schema equal to transformers' generate() driven by xgrammar's logits
processor; sampled rows the same at every batch size; bad formats are error records or one-line errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import jsonschema
import numpy as np
import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data_tools import create_inference_h5 as create  # noqa: E402
from data_tools import decode_predictions as decode  # noqa: E402
from harness import SMOLLM2_DIR, load_predictions, prompt_rows, run_job, write_h5, write_params  # noqa: E402
from modelzoo.generation.formats import FormatError, canonical_format, schema_format  # noqa: E402
from modelzoo.generation.structured import FormatCompiler, apply_token_bitmask  # noqa: E402

EOS, START, MAX_SEQ_LEN = 2, 49152, 160
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["colors"]}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "smollm2", **body}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def schema_format_body(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


REQUESTS = [
    request("person", CHAT, messages=user("Describe Alice, aged 30, as JSON."), max_tokens=40,
            response_format=schema_format_body(PERSON)),
    request("person-sampled", CHAT, messages=user("Invent a person as JSON."), max_tokens=40, temperature=0.9,
            seed=7, n=4, response_format=schema_format_body(PERSON)),
    request("colors", COMPLETIONS, prompt="The primary colors as JSON:", max_tokens=40, logprobs=3,
            response_format=schema_format_body(COLORS)),
    request("object", CHAT, messages=user("Give me a JSON object with one key."), max_tokens=40,
            response_format={"type": "json_object"}, logprobs=True, top_logprobs=2),
    request("cut-short", CHAT, messages=user("Describe Bob as JSON."), max_tokens=4,
            response_format=schema_format_body(PERSON)),
    request("free", CHAT, messages=user("Say hello."), max_tokens=12, temperature=0.7, seed=3, n=2, stop=["!"]),
    request("plain", COMPLETIONS, prompt="def add(a, b):", max_tokens=10, response_format={"type": "text"}),
    request("bad-type", CHAT, messages=user("x"), response_format={"type": "yaml"}),
    request("bad-schema", CHAT, messages=user("x"), response_format=schema_format_body({"type": "objekt"})),
    request("no-schema", CHAT, messages=user("x"), response_format={"type": "json_schema", "json_schema": {}}),
    request("too-many", CHAT, messages=user("x"), n=129),
]
SCHEMAS = {"person": PERSON, "person-sampled": PERSON, "colors": COLORS, "cut-short": PERSON}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_params(path: Path, data_dir: Path, batch_size: int, **runconfig) -> Path:
    return write_params(path, SMOLLM2_DIR, data_dir, batch_size=batch_size, start_token=START, stop_sequences=[[EOS]],
                        max_tokens=48, model_keys={"logprobs": True, "top_logprobs": 3}, **runconfig)


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    """REQUESTS through the three tools at batch_size 7 (and the predictions at 1 and 32 rows in flight)."""
    root = tmp_path_factory.mktemp("structured")
    source = write_jsonl(root / "requests.jsonl", REQUESTS)
    params = run_params(root / "params.yaml", root / "data", 7)
    assert create.main(["--input", str(source), "--format", "openai_batch", "--tokenizer", str(SMOLLM2_DIR),
                        "--max_seq_len", str(MAX_SEQ_LEN), "--output_dir", str(root / "data"),
                        "--params", str(params)]) == 0
    assert run_job(params, root / "run") == 0
    out = root / "responses.jsonl"
    assert decode.main(["--model_dir", str(root / "run"), "--tokenizer", str(SMOLLM2_DIR), "--format", "openai_batch",
                        "--output", str(out)]) == 0
    return {"root": root, "lines": {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}}


def test_every_answer_validates_with_the_openai_types(batch):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    answered = [line for line in batch["lines"].values() if line["error"] is None]
    assert {line["custom_id"] for line in answered} == {"person", "person-sampled", "colors", "object", "cut-short",
                                                         "free", "plain"}
    for line in answered:
        body = line["response"]["body"]
        kind = ChatCompletion if body["object"] == "chat.completion" else Completion
        parsed = kind.model_validate(body)
        assert parsed.model_dump(exclude_unset=True)["choices"][0]["index"] == 0


def test_n_gives_n_choices_each_with_its_finish_reason(batch):
    sampled = batch["lines"]["person-sampled"]["response"]["body"]
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2, 3]
    contents = [c["message"]["content"] for c in sampled["choices"]]
    assert len(set(contents)) >= 2  # four draws at temperature 0.9
    free = batch["lines"]["free"]["response"]["body"]
    assert len(free["choices"]) == 2 and all(c["finish_reason"] in ("stop", "length") for c in free["choices"])
    tokens = [len(c["message"]["content"]) for c in free["choices"]]
    assert free["usage"]["completion_tokens"] >= len(tokens)  # every sample's tokens counted, the prompt once
    assert free["usage"]["total_tokens"] == free["usage"]["prompt_tokens"] + free["usage"]["completion_tokens"]


def test_json_answers_follow_their_schema_unless_cut_by_the_length(batch):
    for custom_id, schema in SCHEMAS.items():
        for choice in batch["lines"][custom_id]["response"]["body"]["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            if choice["finish_reason"] == "length":
                assert custom_id == "cut-short", text
                continue
            jsonschema.validate(json.loads(text), schema)
    cut = batch["lines"]["cut-short"]["response"]["body"]["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("{")
    answer = batch["lines"]["object"]["response"]["body"]["choices"][0]  # any JSON object, if it ends in time
    text = answer["message"]["content"]
    assert isinstance(json.loads(text), dict) if answer["finish_reason"] == "stop" else text.startswith("{")


def test_logprobs_and_top_logprobs_reach_the_json_answers(batch):
    choice = batch["lines"]["object"]["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert content and all(len(item["top_logprobs"]) == 2 for item in content)
    assert all(item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"] for item in content)
    colors = batch["lines"]["colors"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(colors["tokens"]) == len(colors["token_logprobs"]) == len(colors["top_logprobs"])


@pytest.mark.parametrize("custom_id, message", [
    ("bad-type", "response_format type 'yaml' is not supported"),
    ("bad-schema", "the JSON schema cannot be compiled: Unsupported type \"objekt\""),
    ("no-schema", "response_format json_schema needs json_schema.schema"),
    ("too-many", "n must be an integer from 1 to 128, got 129"),
])
def test_bad_formats_are_error_records(batch, custom_id, message):
    line = batch["lines"][custom_id]
    assert line["response"] is None and message in line["error"]["message"], line


def test_the_data_holds_each_rows_format(batch):
    with h5py.File(batch["root"] / "data" / "data.h5") as h5:
        formats = [v.decode() for v in h5["response_format"][:]]
        samples = h5["sample"][:].tolist()
    assert samples == [0, 0, 1, 2, 3, 0, 0, 0, 0, 1, 0]
    assert formats[0] == formats[1] == formats[4] == formats[7] == schema_format(PERSON)
    assert formats[5] == schema_format(COLORS) and formats[6] == '{"type": "json_object"}'
    assert formats[8] == formats[9] == formats[10] == ""


def row_tokens(model_dir: Path) -> dict[int, list[int]]:
    out = {}
    for arrays in load_predictions(model_dir).values():
        for row, index in enumerate(arrays["sample_index"].tolist()):
            if index >= 0:
                begin = int(arrays["prompt_length"][row])
                out[index] = arrays["predictions"][row, begin: begin + int(arrays["num_generated"][row])].tolist()
    return out


def test_rows_are_the_same_at_every_batch_size_and_rows_in_flight_and_after_a_resume(batch):
    root = batch["root"]
    reference = row_tokens(root / "run")
    for name, size, rows in [("b1", 1, 1), ("b32", 32, 32), ("b3_r5", 3, 5)]:
        params = run_params(root / f"{name}.yaml", root / "data", size, rows_in_flight=rows)
        assert run_job(params, root / name) == 0
        assert row_tokens(root / name) == reference, name
    params = run_params(root / "resumed.yaml", root / "data", 3)
    assert run_job(params, root / "resumed", "--inference_steps", "2") == 0  # stops after two of four steps
    assert len(row_tokens(root / "resumed")) == 6
    assert run_job(params, root / "resumed") == 0
    assert row_tokens(root / "resumed") == reference


def test_greedy_rows_under_a_schema_equal_transformers_with_xgrammar(batch):
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    compiler = FormatCompiler(tokenizer, model.config.vocab_size, [EOS])
    reference = row_tokens(batch["root"] / "run")
    with h5py.File(batch["root"] / "data" / "data.h5") as h5:
        data, lengths = h5["data"][:], h5["prompt_lengths"][:]
        formats = [v.decode() for v in h5["response_format"][:]]
    checked = 0
    for row in (0, 5, 6, 7):  # person, colors, object (greedy, under a schema or json_object), cut-short
        prompt = torch.tensor(data[row, : lengths[row]][None].astype(np.int64))
        processor = xgr.contrib.hf.LogitsProcessor(compiler.compile(formats[row]))
        limit = 4 if row == 7 else 40
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=limit,
                                 eos_token_id=EOS, pad_token_id=EOS, logits_processor=[processor])
        assert reference[row] == out[0, prompt.shape[1]:].tolist(), row
        checked += 1
    assert checked == 4


def test_apply_token_bitmask_is_xgrammars():
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, 100, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), expected)


@pytest.mark.parametrize("value, message", [
    ({"type": "text"}, None),
    ({"type": "json_object", "extra": 1}, None),
    ("json", "response_format must be an object with a type"),
    ({"type": "json_schema", "json_schema": {"schema": "x"}}, "needs json_schema.schema"),
])
def test_canonical_format(value, message):
    if message is None:
        assert canonical_format(value) in (None, '{"type": "json_object"}')
    else:
        with pytest.raises(FormatError, match=message):
            canonical_format(value)


# ---- job-wide model.json_schema ---------------------------------------------------------------------------------

def schema_job(tmp_path: Path, schema, stop_sequences=((EOS,),), **model_keys) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    prompts = [tokenizer.apply_chat_template(user(text), add_generation_prompt=True, tokenize=True, return_dict=False)
               for text in ("Describe Alice, aged 30, as JSON.", "Invent a person.")]
    write_h5(tmp_path / "data", prompt_rows(prompts, 96, START))
    params = write_params(tmp_path / "params.yaml", SMOLLM2_DIR, tmp_path / "data", batch_size=2, start_token=START,
                          stop_sequences=[list(s) for s in stop_sequences], max_tokens=40,
                          model_keys={"json_schema": schema, **model_keys})
    return params, tmp_path / "run"


def test_model_json_schema_holds_for_every_row(tmp_path):
    params, run = schema_job(tmp_path, PERSON)
    assert run_job(params, run) == 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    for tokens in row_tokens(run).values():
        assert tokens[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), PERSON)
    manifest = json.loads((run / "artifacts" / "manifest.json").read_text())
    assert manifest["model"]["json_schema"] == PERSON


@pytest.mark.parametrize("schema, stops, keys, message", [
    ("object", ((EOS,),), {}, "model.json_schema must be a JSON schema written as a mapping"),
    ({"type": "objekt"}, ((EOS,),), {}, 'the JSON schema cannot be compiled: Unsupported type "objekt"'),
    (PERSON, ((EOS, 5),), {}, "need a one-token stop sequence"),
    (PERSON, ((EOS,),), {"speculative": {"method": "prompt_lookup"}},
     "model.json_schema cannot be combined with model.speculative"),
])
def test_bad_job_schemas_are_one_line_errors(tmp_path, capsys, schema, stops, keys, message):
    params, run = schema_job(tmp_path, schema, stops, **keys)
    assert run_job(params, run) != 0
    err = capsys.readouterr().err
    assert message in err, err
    assert not list((run / "artifacts" / "predictions").glob("*.npz")) if run.exists() else True
