"""zoo-infer as an lm-evaluation-harness model, offline: three local-JSON tasks (multiple choice, perplexity over
rolling windows, generate_until) on SmolLM2-135M-Instruct in float32, through `simple_evaluate` and through the
`zoo-lm-eval` command, against lm-eval's own `hf` backend: every loglikelihood within 1e-4 with the same
is_greedy, the same metrics, the same generated text; plus the Python API's scoring against transformers'
log-softmax and its bad inputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from harness import SMOLLM2_DIR  # noqa: E402

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval backend needs the `eval` extra (pip install lm_eval)")

WINDOW = 64  # max_length of both backends: the perplexity texts need several rolling windows
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is closest to the sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Which animal says moo?", ["cow", "cat", "dog", "duck"], 0),
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "In the beginning the universe was created. This has made a lot of people very angry and been widely "
    "regarded as a bad move. Many were increasingly of the opinion that they had all made a big mistake.",
    "Hello world.",
]
GEN = [("Q: What is the capital of Italy?\nA:", "Rome"), ("Q: What is 3 + 4?\nA:", "7"),
       ("Q: Name a primary color.\nA:", "red"), ("Q: What do bees make?\nA:", "honey")]


def write_tasks(folder: Path) -> Path:
    """The three tasks' YAML files and their JSON data in `folder` (absolute paths: lm-eval reads them from here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                             for q, c, a in QUESTIONS))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "zoo_mc.yaml").write_text(
        f"task: zoo_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "zoo_ppl.yaml").write_text(
        f"task: zoo_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "zoo_gen.yaml").write_text(
        f"task: zoo_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n")
    return folder


TASKS = ["zoo_mc", "zoo_ppl", "zoo_gen"]


def evaluate(model, folder: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(folder)),
                                   log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> dict:
    """The three tasks through simple_evaluate with zoo-infer and with lm-eval's hf backend."""
    from lm_eval.models.huggingface import HFLM

    from modelzoo.lm_eval_backend import ZooInferLM

    folder = write_tasks(tmp_path_factory.mktemp("tasks"))
    zoo = ZooInferLM(pretrained=str(SMOLLM2_DIR), dtype="float32", max_length=WINDOW, batch_size=7)
    hf = HFLM(pretrained=str(SMOLLM2_DIR), dtype="float32", max_length=WINDOW, batch_size=1, device="cpu")
    return {"folder": folder, "zoo": evaluate(zoo, folder), "hf": evaluate(hf, folder), "model": zoo}


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihoods_equal_lm_evals_hf_backend(evaluated):
    ours, theirs = responses(evaluated["zoo"], "zoo_mc"), responses(evaluated["hf"], "zoo_mc")
    assert len(ours) == len(QUESTIONS) and all(len(doc) == 4 for doc in ours)
    for doc_ours, doc_theirs in zip(ours, theirs):
        for (a,), (b,) in zip(doc_ours, doc_theirs):
            assert abs(float(a[0]) - float(b[0])) < 1e-4 and a[1] == b[1], (a, b)
    for metric in ("acc,none", "acc_norm,none"):
        assert evaluated["zoo"]["results"]["zoo_mc"][metric] == evaluated["hf"]["results"]["zoo_mc"][metric]


def test_rolling_loglikelihoods_equal_lm_evals_hf_backend(evaluated):
    ours, theirs = responses(evaluated["zoo"], "zoo_ppl"), responses(evaluated["hf"], "zoo_ppl")
    values = lambda doc: np.array(doc, dtype=np.float64).ravel()  # noqa: E731  [[total]] per document
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(values(a), values(b), rtol=1e-6, atol=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        ours_value = evaluated["zoo"]["results"]["zoo_ppl"][metric]
        assert ours_value == pytest.approx(evaluated["hf"]["results"]["zoo_ppl"][metric], rel=1e-5), metric


def test_generate_until_outputs_equal_lm_evals_hf_backend(evaluated):
    ours, theirs = responses(evaluated["zoo"], "zoo_gen"), responses(evaluated["hf"], "zoo_gen")
    texts = [text for doc in ours for text in np.array(doc, dtype=object).ravel()]  # [[text]] per document
    assert ours == theirs and len(texts) == len(GEN) and all(text.strip() for text in texts), (ours, theirs)
    assert evaluated["zoo"]["results"]["zoo_gen"]["exact_match,none"] == \
        evaluated["hf"]["results"]["zoo_gen"]["exact_match,none"]


def test_zoo_lm_eval_command_runs_the_tasks_and_its_cache_resumes(evaluated, tmp_path):
    script = Path(sys.executable).with_name("zoo-lm-eval")
    command = [str(script), "--model", "zoo-infer", "--model_args",
               f"pretrained={SMOLLM2_DIR},dtype=float32,max_length={WINDOW}", "--tasks", ",".join(TASKS),
               "--include_path", str(evaluated["folder"]), "--batch_size", "4", "--output_path",
               str(tmp_path / "out"), "--use_cache", str(tmp_path / "cache"), "--seed", "0"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for _ in range(2):  # the second run answers from the cache
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(sorted((tmp_path / "out").rglob("results_*.json"))[-1].read_text())["results"]
    for task, metric in (("zoo_mc", "acc,none"), ("zoo_gen", "exact_match,none"), ("zoo_ppl", "word_perplexity,none")):
        assert results[task][metric] == pytest.approx(evaluated["zoo"]["results"][task][metric], rel=1e-6), task
    assert list(tmp_path.glob("cache*"))  # lm-eval's sqlite cache, fed request by request


def test_scores_equal_transformers_log_softmax_and_do_not_depend_on_rows_in_flight(evaluated):
    from transformers import AutoModelForCausalLM

    from modelzoo.api import ZooModel

    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " Rome"), ("2 + 2 =", " 4"),
             ("Hello", " world, how are you today?")]
    one = ZooModel(SMOLLM2_DIR, dtype="float32", max_seq_len=WINDOW, rows_in_flight=1).score(pairs)
    seven = evaluated["model"].zoo.score(pairs)
    assert all(np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.greedy, b.greedy) for a, b in zip(one, seven))
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    for (context, continuation), score in zip(pairs, seven):
        head, tail = evaluated["model"].zoo.encode_pair(context, continuation)
        ids = torch.tensor(np.concatenate([head, tail]))[None]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0].float(), -1)
        at = torch.arange(len(head) - 1, ids.shape[1] - 1)
        np.testing.assert_allclose(score.logprobs, logprobs[at, ids[0, len(head):]].numpy(), rtol=0, atol=1e-4)
        assert np.array_equal(score.greedy, (logprobs[at].argmax(-1) == ids[0, len(head):]).numpy())


@pytest.mark.parametrize("pair, message", [
    (([], [5]), "empty context"),
    (([5], []), "empty continuation"),
    ((list(range(40)), list(range(40))), "do not fit the window of 64"),
])
def test_bad_score_requests_are_named(evaluated, pair, message):
    with pytest.raises(ValueError, match=message):
        evaluated["model"].zoo.score_tokens([([1, 2], [3]), pair])


def test_a_continuation_longer_than_the_window_is_named(evaluated):
    with pytest.raises(ValueError, match=r"request 'q': its continuation of 65 tokens is longer than the model's "
                                         r"window of 64"):
        evaluated["model"]._loglikelihood_tokens([("q", [1], list(range(65)))])


def test_long_contexts_are_left_truncated_and_counted(evaluated):
    model = evaluated["model"]
    before = model.truncated_contexts
    long_context = list(range(100, 200))
    (value, _), = model._loglikelihood_tokens([(None, long_context, [7, 8])])
    (expected, _), = model._loglikelihood_tokens([(None, long_context[-(WINDOW - 1):], [7, 8])])
    assert value == expected and model.truncated_contexts == before + 1


def test_generate_until_runs_every_generation_kwargs_group_on_one_engine(evaluated, monkeypatch):
    """Requests whose generation kwargs differ (until, max_gen_toks) run together on one engine, each with its own
    options, and write what each one writes alone; an engine that took them once takes them again without a new
    build (a build is a new KV cache and a new warm-up)."""
    from types import SimpleNamespace

    from modelzoo.runtime import Runtime

    model = evaluated["model"]
    kwargs = [{"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
              {"until": [".", "\n\n"], "max_gen_toks": 5, "do_sample": False}]
    requests = [SimpleNamespace(args=(question, kwargs[i % 2])) for i, (question, _) in enumerate(GEN)]
    alone = [model.generate_until([request])[0] for request in requests]
    builds = []
    build = Runtime._build_engine
    monkeypatch.setattr(Runtime, "_build_engine", lambda self, *args: builds.append(args) or build(self, *args))
    assert model.generate_until(requests) == alone
    assert model.generate_until(requests[::-1]) == alone[::-1]
    assert builds == []
    assert alone[1] != alone[0] and len(model.tok_encode(alone[1])) <= 5  # the second kwargs' own limit held


def test_a_call_with_stop_strings_never_seen_keeps_the_engine(evaluated, monkeypatch):
    """A generate_until call whose `until` strings no earlier call used (a new task) runs on the same engine, its KV
    cache and warm-up kept (GenerationEngine.adopt), and cuts each text where plain greedy text reaches them."""
    from types import SimpleNamespace

    from modelzoo.runtime import Runtime

    model = evaluated["model"]
    engine, builds = model.zoo.runtime.engine, []
    build = Runtime._build_engine
    monkeypatch.setattr(Runtime, "_build_engine", lambda self, *args: builds.append(args) or build(self, *args))
    kwargs = {"until": [" the", "?"], "max_gen_toks": 10, "do_sample": False}
    texts = model.generate_until([SimpleNamespace(args=(question, kwargs)) for question, _ in GEN])
    assert builds == [] and model.zoo.runtime.engine is engine
    plain = model.zoo.generate([model.tok_encode(q) for q, _ in GEN], model.zoo.default_options(max_tokens=10))
    for text, whole in zip(texts, plain):
        cut = min((whole.text.find(s) for s in kwargs["until"] if s in whole.text), default=len(whole.text))
        assert text == whole.text[:cut]
