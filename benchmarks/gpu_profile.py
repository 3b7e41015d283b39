#!/usr/bin/env python
"""Where a GPU job's time goes, kernel by kernel: prefill alone, then prefill and decode steps.

    python3 benchmarks/gpu_profile.py --model benchmarks/results/gpu/random_tinyllama --rows 256 \\
        --prompt_lengths 64,319 --dtype bfloat16

Loads the checkpoint once through the library (`ZooModel`: the job's engine, decode step and attention choice)
with every row in flight, runs `--rows` random prompts (seeded, `--prompt_lengths` least,most tokens) once to warm
up, then times and profiles (torch.profiler, CPU and CUDA) two generations: max_tokens 1 (prefill and each row's
first token only) and 1 + `--decode_steps`. Prints each one's seconds (prefill and decode apart, as the engine
counts them) and the operators and kernels by their own device time (CPU time where no GPU is present): what
`benchmarks/gpu_throughput.py`'s prefill and decode columns are made of.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint folder (gpu_throughput.py builds random ones)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt_lengths", default="64,319", help="least,most prompt tokens (default: 64,319)")
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--table_rows", type=int, default=22, help="operators listed per profile")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from modelzoo.api import ZooModel

    least, most = (int(n) for n in args.prompt_lengths.split(","))
    on_gpu = args.device.startswith("cuda")
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    model = ZooModel(args.model, dtype=args.dtype, device=args.device, max_seq_len=most + 1 + args.decode_steps,
                     rows_in_flight=args.rows)
    vocab = model.model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(least, most + 1, size=args.rows)]
    engine = model.runtime.engine
    print(f"loaded in {time.perf_counter() - start:.1f} s; attention: {engine.attention.describe()}; "
          f"{args.rows} prompts, {sum(map(len, prompts))} tokens", flush=True)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def generate(max_tokens: int) -> None:
        sync()
        start, prefill, steps = time.perf_counter(), engine.prefill_seconds, engine.decode_steps
        model.generate(prompts, model.default_options(max_tokens=max_tokens))
        sync()
        print(f"max_tokens {max_tokens}: {time.perf_counter() - start:.3f} s, prefill "
              f"{engine.prefill_seconds - prefill:.3f} s, {engine.decode_steps - steps} decode steps", flush=True)

    generate(1 + args.decode_steps)  # warm-up: buckets captured, backends loaded
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for max_tokens in (1, 1 + args.decode_steps):
        generate(max_tokens)
        with profile(activities=activities) as prof:
            generate(max_tokens)
        print(f"\n== profiled: max_tokens {max_tokens}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
                                        row_limit=args.table_rows, max_name_column_width=90))
    return 0


if __name__ == "__main__":
    sys.exit(main())
