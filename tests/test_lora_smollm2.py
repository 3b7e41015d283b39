"""LoRA adapters of SmolLM2 through OpenAI requests, the Python API and lm-eval; prompt files' adapter field."""
from __future__ import annotations

import json
import os

import h5py
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import SMOLLM2_DIR, hf_greedy, run_job, write_params  # noqa: E402
from lora_adapters import MAX_TOKENS, make_adapter  # noqa: E402


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
