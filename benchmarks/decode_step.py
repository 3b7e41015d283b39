#!/usr/bin/env python
"""The decode step's modes side by side on this machine: eager (the CPU's C++ kernels and measured GEMMs)
against compiled (torch.compile, inductor, torch's GEMMs), and a first job on a fresh install against the
next one.

    python benchmarks/decode_step.py --model models/smollm2-135m-instruct --num_prompts 64 --max_tokens 64 \\
        --dtypes float32,bfloat16 --out benchmarks/results/decode_step

Every run is `run_inference.py` in a process of its own, one after another, on the same prompts: random token
ids (seeded) of 32 to 160 tokens, greedy, exactly --max_tokens new tokens each (no stop sequence), every row
in flight at once. The runs use a fresh clone of this checkout's HEAD, with empty kernel and cache folders
(ZOO_INFER_KERNEL_DIR, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR), as a fresh install would. Per dtype:
  - eager, first job: the C++ kernels build (the first dtype only) and the GEMMs are measured in this job;
  - eager, second job: the same install, now holding both;
  - compiled: runconfig.decode_step compiled (inductor compiles in the set-up).
Printed per run: set-up seconds (load, GEMM choice, kernel build, compilation, warm-up), generation seconds
and tokens/s as summary.json reports them, the process's wall time, tokens/s over the second eager job's, and
whether its predictions files equal the second eager job's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent


def write_prompts(folder: Path, num_prompts: int, max_tokens: int, vocab_size: int, start_token: int,
                  seed: int = 0) -> None:
    """data.h5 of random prompts of 32-160 tokens, each row long enough for max_tokens more."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 161, size=num_prompts)
    width = int(lengths.max()) + max_tokens + 1
    rows = np.full((num_prompts, width), start_token, dtype=np.int32)
    for row, length in enumerate(lengths):
        rows[row, :length] = rng.integers(0, vocab_size, size=length)
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / "data.h5", "w") as handle:
        handle.create_dataset("data", data=rows)


def run_job(out: Path, name: str, model: str, dtype: str, args: argparse.Namespace, install: Path,
            decode_step: str) -> dict:
    """One run_inference.py process; its summary.json plus the wall time."""
    params = {
        "model": {"checkpoint_path": model, "dtype": dtype, "start_token": args.start_token, "stop_sequences": [],
                  "max_tokens": args.max_tokens},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(out / "data"),
                            "batch_size": args.num_prompts},
        "runconfig": {"device": "cpu", "decode_step": decode_step,
                      **({"num_threads": args.threads} if args.threads else {})},
    }
    path = out / f"params_{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    model_dir = out / f"run_{name}"
    env = {**os.environ, "ZOO_INFER_KERNEL_DIR": str(install / "kernels"), "XDG_CACHE_HOME": str(install / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(install / "inductor")}
    start = time.perf_counter()
    subprocess.run([sys.executable, str(install / "zoo-infer" / "run_inference.py"), "--params", str(path),
                    "--model_dir", str(model_dir), "--overwrite"], check=True, env=env, cwd=install / "zoo-infer")
    summary = json.loads((model_dir / "artifacts" / "summary.json").read_text())
    summary["process_seconds"] = time.perf_counter() - start
    summary["model_dir"] = str(model_dir)
    return summary


def same_files(a: str, b: str) -> bool:
    """Whether two runs' predictions arrays are equal."""
    def arrays(model_dir: str) -> list[np.ndarray]:
        files = sorted((Path(model_dir) / "artifacts" / "predictions").glob("predictions_*.npz"))
        return [np.load(f)["predictions"] for f in files]
    return all(np.array_equal(x, y) for x, y in zip(arrays(a), arrays(b), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="eager_first,eager,compiled",
                        help="which runs, in order: eager_first, eager, compiled")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_step")
    args = parser.parse_args()
    config = json.loads((Path(args.model) / "config.json").read_text())
    args.start_token = int(config["vocab_size"])  # outside the vocabulary: never fed to the model
    args.out.mkdir(parents=True, exist_ok=True)
    write_prompts(args.out / "data", args.num_prompts, args.max_tokens, int(config["vocab_size"]), args.start_token)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-install-") as fresh:
        install = Path(fresh)
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(install / "zoo-infer")], check=True)
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                name = f"{mode}_{dtype}"
                summary = run_job(args.out, name, str(Path(args.model).resolve()), dtype, args, install,
                                  "compiled" if mode == "compiled" else "eager")
                rows.append({"run": name, "mode": mode, "dtype": dtype, **{k: summary[k] for k in (
                    "setup_seconds", "generation_seconds", "tokens_per_second", "generated_tokens",
                    "process_seconds", "model_dir")}})
    print(f"\n{args.num_prompts} prompts of 32-160 random tokens, {args.max_tokens} new tokens each, "
          f"{args.model}, {os.cpu_count()} CPUs\n")
    print("| run | set-up s | generation s | tokens/s | vs eager (second job) | process s | files = eager |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        base = next((r for r in rows if r["mode"] == "eager" and r["dtype"] == row["dtype"]), None)
        ratio = f"{row['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
        equal = same_files(row["model_dir"], base["model_dir"]) if base else "-"
        print(f"| {row['run']} | {row['setup_seconds']:.1f} | {row['generation_seconds']:.2f} | "
              f"{row['tokens_per_second']:.1f} | {ratio} | {row['process_seconds']:.1f} | {equal} |")
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
