#!/usr/bin/env python
"""What the resume check costs at start-up, side by side: zoo-infer's check (every entry of every
predictions file read, so zip's CRC covers every byte, and the file's inputs digest compared) against
the lighter check it replaced (three entries read: a flipped byte elsewhere went unnoticed).

    python benchmarks/resume_check.py --files 2000 --batch_size 32 --max_seq_len 512

Two cases: a folder of finished files (a resumed job), and an empty folder of --fresh_steps steps
(a job's first start: one listing instead of a lookup per step). Warm page cache; best of 3.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modelzoo.job.predictions import file_states, predictions_path, write_predictions  # noqa: E402

DIGEST = "0" * 64


def light_check(folder: Path, step: int, shape: tuple[int, int]) -> bool:
    """The check before: the file exists and three of its entries load with the right step and shape."""
    path = predictions_path(folder, step)
    if not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            return (int(npz["global_step"]) == step and npz["predictions"].shape == shape
                    and npz["predictions"].dtype == np.int32 and "stop_reason" in npz.files)
    except Exception:
        return False


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--fresh_steps", type=int, default=100_000)
    args = parser.parse_args(argv)
    shape = (args.batch_size, args.max_seq_len)
    arrays = {"predictions": np.zeros(shape, np.int32), "sample_index": np.arange(args.batch_size),
              "prompt_length": np.zeros(args.batch_size, np.int32), "num_generated": np.zeros(args.batch_size, np.int32),
              "stop_reason": np.array(["max_tokens"] * args.batch_size), "loop_dim": np.array(1)}
    with tempfile.TemporaryDirectory() as tmp:
        done, empty = Path(tmp) / "done", Path(tmp) / "empty"
        done.mkdir(), empty.mkdir()
        steps = list(range(1, args.files + 1))
        for step in steps:
            write_predictions(done, step, DIGEST, arrays)
        fresh = list(range(1, args.fresh_steps + 1))
        rows = [(f"resumed: {args.files} files of {shape[0]}x{shape[1]}",
                 best_of(lambda: [light_check(done, s, shape) for s in steps]),
                 best_of(lambda: file_states(done, steps, shape, DIGEST))),
                (f"first start: {args.fresh_steps} steps, no file yet",
                 best_of(lambda: [light_check(empty, s, shape) for s in fresh]),
                 best_of(lambda: file_states(empty, fresh, shape, DIGEST)))]
    print(f"{'case':<45} {'light check s':>14} {'zoo-infer s':>12} {'zoo/light':>10}")
    for case, light, zoo in rows:
        print(f"{case:<45} {light:>14.3f} {zoo:>12.3f} {zoo / light:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
