#!/usr/bin/env python
"""lm-evaluation-harness loglikelihood requests through zoo-infer against lm-eval's own `hf` backend, side by side.

    python benchmarks/lm_eval_scoring.py --questions 1000 --dtypes float32,bfloat16 --out benchmarks/results/lm_eval

A 4-choice task of --questions questions (a 3-shot arithmetic prompt, one question of it per document, its
4 answers as the choices: 4 loglikelihood requests per question, the shape of ARC, HellaSwag or MMLU requests),
built once and handed to each backend's `loglikelihood` as lm-eval hands it over. Each backend runs in a
process of its own, one after another: the model is loaded first (not timed), then every request is scored.
Printed per backend and dtype: requests/s, zoo-infer's over hf's, how many of the questions both answer the same
(the argmax of the 4 log-likelihoods) and the largest log-likelihood difference. --hf_batch_size sets the hf
backend's batch (default 32); zoo-infer takes its rows in flight as auto.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHOTS = ("Question: What is 12 + 7?\nAnswer: 19\n\nQuestion: What is 30 - 4?\nAnswer: 26\n\n"
         "Question: What is 6 * 3?\nAnswer: 18\n\n")


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


def child(args: argparse.Namespace) -> int:
    """One backend in this process: load, then time `loglikelihood` over every request; JSON to --result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from lm_eval.api.instance import Instance

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    if args.engine == "zoo-infer":
        from modelzoo.lm_eval_backend import ZooInferLM

        model = ZooInferLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length, batch_size="auto")
    else:
        from lm_eval.models.huggingface import HFLM

        model = HFLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length,
                     batch_size=args.hf_batch_size, device="cpu")
    requests = [Instance("loglikelihood", doc={}, arguments=(context, choice), idx=i)
                for context, choices in questions(args.questions, args.seed) for i, choice in enumerate(choices)]
    start = time.perf_counter()
    results = model.loglikelihood(requests, disable_tqdm=True)
    seconds = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({"seconds": seconds, "loglikelihoods": [float(v) for v, _ in results],
                                             "greedy": [bool(g) for _, g in results]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--hf_batch_size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval"))
    parser.add_argument("--engine", choices=("zoo-infer", "hf"), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        return child(args)
    from benchmarks.machine import cpu_description

    args.out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    requests = 4 * args.questions
    print(f"machine: {cpu_description()}, {threads} threads; {args.questions} questions x 4 choices = {requests} "
          f"loglikelihood requests, 3-shot context")
    print(f"\n{'dtype':<9} {'engine':<10} {'seconds':>8} {'requests/s':>11} {'vs hf':>6}  agreement with hf")
    for dtype in args.dtypes.split(","):
        runs = {}
        for engine in ("hf", "zoo-infer"):
            result = args.out / f"{engine}_{dtype}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--engine", engine, "--dtype", dtype,
                       "--model", args.model, "--questions", str(args.questions), "--max_length", str(args.max_length),
                       "--hf_batch_size", str(args.hf_batch_size), "--threads", str(threads), "--seed", str(args.seed),
                       "--result", str(result)]
            log = args.out / f"{engine}_{dtype}.log"
            with open(log, "w") as handle:
                done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                      env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            runs[engine] = json.loads(result.read_text()) if done.returncode == 0 else None
            if runs[engine] is None:
                print(f"{dtype:<9} {engine:<10} failed (exit {done.returncode}): see {log}")
        hf, zoo = runs["hf"], runs["zoo-infer"]
        for engine, run in runs.items():
            if run is None:
                continue
            rate = requests / run["seconds"]
            ratio = f"{rate / (requests / hf['seconds']):.2f}x" if hf else "-"
            agreement = ""
            if engine == "zoo-infer" and hf:
                pick = lambda r: [max(range(4), key=lambda i: r["loglikelihoods"][4 * q + i])  # noqa: E731
                                  for q in range(args.questions)]
                same = sum(a == b for a, b in zip(pick(run), pick(hf)))
                worst = max(abs(a - b) for a, b in zip(run["loglikelihoods"], hf["loglikelihoods"]))
                agreement = f"{same}/{args.questions} answers the same, largest loglikelihood difference {worst:.2e}"
            print(f"{dtype:<9} {engine:<10} {run['seconds']:>8.1f} {rate:>11.1f} {ratio:>6}  {agreement}")
    return 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
