#!/usr/bin/env python
"""zoo-infer against transformers `generate()` three ways, on one GPU, same prompts, side by side.

    python benchmarks/gpu_throughput.py --models random:smollm2,random:tinyllama --rows 32,256,1024 \\
        --dtypes bfloat16,float32 --max_tokens 128 --out benchmarks/results/gpu

For each model (random weights built once from a config by benchmarks/random_model.py, or a checkpoint
folder), each row count R and dtype: R random prompts of 64-319 tokens (seeded), --max_tokens new tokens each
with no stop token, every row in flight at once (zoo-infer's rows_in_flight = R; generate()'s batch = R). Engines,
each a process of its own, one after another:
  - zoo-infer: run_inference.py on the device (decode_step auto: captured CUDA graphs);
  - generate(), default: transformers as installed, PyTorch's default attention choice;
  - generate(), no_cudnn: cuDNN attention off (it builds an execution plan per key length);
  - generate(), static: `cache_implementation="static"`, compiled by transformers (one untimed batch first).
Printed per run: tokens/s (generation only, as each engine times it), the ratio to the best and to the
default generate(), the share of the decode-step roofline (weights + the mean filled KV cache read once a
step, over the device's copy bandwidth measured here: no engine decodes faster), the process's wall time split
into set-up (zoo-infer's load, GEMM choice, compilation, capture), generation and the rest (imports, data,
writing), the rows equal to the default generate()'s, and zoo-infer's own split of its generation from its
summary.json: prefill seconds, decode milliseconds per step (the rest, less graphs captured during generation, over
its steps), seconds capturing during generation, and the SDPA backends it pinned for prefill / decode.
`--zoo_runs 2` runs each zoo-infer job twice (the second's set-up reuses the compile cache); `--ways none` leaves
generate() out.

`--device cpu` with a small model runs the same comparison on the CPU (what tests/test_benchmarks.py does).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engines import PEERS_DIR, Prepared, add_run_options, run_child, run_zoo, start_run  # noqa: E402
from benchmarks.random_model import ensure_random_model, is_random  # noqa: E402
from data_tools.create_inference_h5 import build_rows, write_h5  # noqa: E402

WAYS = ("default", "no_cudnn", "static")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def random_prompts(out: Path, rows: int, vocab_size: int, lengths: tuple[int, int], max_tokens: int,
                   seed: int) -> Prepared:
    """`rows` prompts of random ids, of `lengths` (least, most) tokens, as data.h5 (zoo-infer) and tokens.json
    (generate()); no stop token."""
    rng = np.random.default_rng(seed)
    token_ids = [rng.integers(0, vocab_size, size=int(n)).tolist()
                 for n in rng.integers(lengths[0], lengths[1] + 1, size=rows)]
    start_token, max_seq_len = vocab_size, max(len(ids) for ids in token_ids) + max_tokens
    data, lengths, _ = build_rows(token_ids, max_seq_len, start_token)
    write_h5(out / "data", data, lengths, loop_dim=1, attrs={"vocab_size": vocab_size, "start_token": start_token,
                                                             "max_seq_len": max_seq_len, "loop_dim": 1})
    (out / "tokens.json").write_text(json.dumps({"token_ids": token_ids}))
    return Prepared(out / "data", out / "tokens.json", token_ids, start_token, -1, max_seq_len)


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the best of a few."""
    import torch

    size = (1 << 30) if device.startswith("cuda") else (256 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def roofline_tokens_per_s(config: dict, dtype: str, prep: Prepared, max_tokens: int, bandwidth: float) -> float:
    """Generated tokens/s if a decode step only read the weights and the rows' filled KV cache (at its mean
    length over the generation) once, at `bandwidth`."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads", heads), config.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * config[
        "intermediate_size"]
    # The vocabulary head is read whole every step (tied or not); the input embedding only at the rows' tokens.
    weights = (layers * per_layer + vocab * hidden) * DTYPE_BYTES[dtype]
    mean_length = float(np.mean([len(ids) for ids in prep.token_ids])) + max_tokens / 2
    kv = len(prep.token_ids) * mean_length * layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]
    return len(prep.token_ids) / ((weights + kv) / bandwidth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="random:smollm2,random:tinyllama")
    parser.add_argument("--rows", default="32,256,1024")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"generate() runs, of {', '.join(WAYS)}; none: only "
                        "zoo-infer")
    parser.add_argument("--zoo_runs", type=int, default=1,
                        help="zoo-infer jobs per case, one after another: the second shows a warm set-up (compile "
                             "cache reused)")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--prompt_lengths", default="64,319", help="least,most prompt tokens (default: 64,319)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"),
                        help="tokenizer folder the random models take (default: the default model's)")
    add_run_options(parser, "benchmarks/results/gpu")
    args = parser.parse_args(argv)
    lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    out, threads = start_run(args)
    bandwidth = copy_bandwidth(args.device)
    print(f"device {args.device}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows_out = []
    for model in args.models.split(","):
        checkpoint = ensure_random_model(model, Path(args.tokenizer), out) if is_random(model) else Path(model)
        config = json.loads((checkpoint / "config.json").read_text())
        args.model = str(checkpoint)
        for rows in map(int, args.rows.split(",")):
            run_dir = out / f"{checkpoint.name}_{rows}"
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            prep = random_prompts(run_dir, rows, int(config["vocab_size"]), lengths, args.max_tokens, args.seed)
            args.batch_size = rows
            for dtype in args.dtypes.split(","):
                results = {}
                for run in range(args.zoo_runs):
                    variant = "" if run == 0 else f"run{run + 1}"
                    zoo, zoo_tokens = run_zoo(args, prep, run_dir, dtype, threads, variant=variant, batch_size=rows,
                                              model_keys={"stop_sequences": []},
                                              runconfig_keys={"device": args.device})
                    zoo.update(zoo_time_split(run_dir / f"zoo_{dtype}{'_' + variant if variant else ''}"))
                    results["zoo-infer" + (f" job {run + 1}" if run else "")] = (zoo, zoo_tokens)
                ways = [] if args.ways == "none" else args.ways.split(",")
                for way in ways:
                    results[f"generate {way}"] = run_child(f"generate_{way}", PEERS_DIR / "hf_generate.py", args, prep,
                                                           run_dir, dtype, threads,
                                                           extra=["--device", args.device, "--way", way])
                    if way == "static":
                        say_static_compiled(run_dir / f"generate_{way}_{dtype}.json")
                roofline = roofline_tokens_per_s(config, dtype, prep, args.max_tokens, bandwidth)
                rates = {name: row["tokens_per_s"] for name, (row, _) in results.items() if row["tokens_per_s"]}
                best = max((rate for name, rate in rates.items() if name.startswith("generate")), default=None)
                default_tokens = results.get("generate default", (None, None))[1]
                for name, (row, tokens) in results.items():
                    rate = row["tokens_per_s"]
                    setup = row.get("setup_seconds") or 0.0
                    equal = None
                    if tokens is not None and default_tokens is not None:
                        equal = sum(a == b for a, b in zip(tokens, default_tokens))
                    rows_out.append({
                        "model": checkpoint.name, "rows": rows, "dtype": dtype, "engine": name, "status": row["status"],
                        "tokens_per_s": rate, "vs_best_generate": rate / best if rate and best else None,
                        "vs_default_generate": rate / rates["generate default"] if rate and rates.get(
                            "generate default") else None,
                        "of_roofline": rate / roofline if rate else None, "process_seconds": row["process_seconds"],
                        "setup_seconds": row.get("setup_seconds"), "generation_seconds": row["generation_seconds"],
                        "other_seconds": (row["process_seconds"] - setup - row["generation_seconds"]
                                          if rate else None),
                        "rows_equal_to_default_generate": equal,
                        **{key: row.get(key) for key in ZOO_SPLIT},
                    })
    print_table(rows_out)
    (out / "results.json").write_text(json.dumps(rows_out, indent=2) + "\n")
    print(f"\nwrote {out / 'results.json'}")
    return 0


def say_static_compiled(result: Path) -> None:
    """Prints whether generate()'s static cache compiled (the graphs its untimed first batch compiled)."""
    try:
        graphs = json.loads(result.read_text()).get("compiled_graphs")
    except (OSError, ValueError):
        return
    print(f"generate() static: {graphs} graphs compiled in its untimed first batch"
          + (" (it did not compile: its rate is eager's)" if graphs == 0 else ""))


ZOO_SPLIT = ("prefill_seconds", "decode_ms_per_step", "capture_seconds", "sdpa_backends")


def zoo_time_split(model_dir: Path) -> dict:
    """From a zoo-infer run's summary.json: set-up seconds, prefill seconds, decode milliseconds per step (the
    generation's time less prefill and graphs captured in flight, over its steps), capture seconds in flight, and the
    SDPA backends pinned."""
    path = model_dir / "artifacts" / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    step = summary.get("decode_step") or {}
    decode = (summary["generation_seconds"] - step.get("prefill_seconds", 0.0)
              - step.get("capture_seconds_in_flight", 0.0))
    steps = step.get("decode_steps") or 0
    backends = step.get("sdpa_backends") or {}
    return {"setup_seconds": summary["setup_seconds"], "prefill_seconds": step.get("prefill_seconds"),
            "decode_ms_per_step": 1000 * decode / steps if steps else None,
            "capture_seconds": step.get("capture_seconds_in_flight"),
            "sdpa_backends": "/".join(str(backends.get(form)) for form in ("prefill", "decode"))
            if any(backends.values()) else None}


def print_table(rows: list[dict]) -> None:
    """The results as a Markdown table."""
    def cell(value: object, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)

    print("\n| model | rows | dtype | engine | tokens/s | vs best generate() | vs default generate() | of roofline "
          "| process s | set-up s | generation s | other s | rows = default generate() | prefill s | decode ms/step "
          "| captured in flight s | SDPA prefill/decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = cell(r["tokens_per_s"], ".1f") if r["status"] == "ok" else r["status"]
        print(f"| {r['model']} | {r['rows']} | {r['dtype']} | {r['engine']} | {rate} | {cell(r['vs_best_generate'])} "
              f"| {cell(r['vs_default_generate'])} | {cell(r['of_roofline'])} | {cell(r['process_seconds'], '.1f')} "
              f"| {cell(r['setup_seconds'], '.1f')} | {cell(r['generation_seconds'], '.1f')} "
              f"| {cell(r['other_seconds'], '.1f')} | {cell(r['rows_equal_to_default_generate'])} "
              f"| {cell(r.get('prefill_seconds'))} | {cell(r.get('decode_ms_per_step'))} "
              f"| {cell(r.get('capture_seconds'))} | {cell(r.get('sdpa_backends'))} |")


if __name__ == "__main__":
    sys.exit(main())
