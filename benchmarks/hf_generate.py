#!/usr/bin/env python
"""The transformers baseline of benchmarks/throughput.py: `generate()` over static batches.

Run as its own process by throughput.py (so its memory and start-up are its own):

    python benchmarks/hf_generate.py --model models/smollm2-135m-instruct \\
        --tokens_json out/tokens.json --dtype float32 --batch_size 32 --max_tokens 64 \\
        --out out/hf_float32.json

It reads the already tokenized prompts (`token_ids` of the JSON that throughput.py writes, the
same ids zoo-infer reads from its .h5), cuts them into consecutive batches of --batch_size in the
given order, left-pads each batch with an attention mask, and calls `model.generate()` greedily
with `max_new_tokens` and EOS as the stop token: the plain way to batch with transformers, with no
continuous batching (a batch lasts as long as its longest row).

What is timed: the generation loop only, from the first batch to the last (model loading,
imports and reading the input are excluded; the parent measures the whole process separately).
Each row's generated tokens are cut right after the first EOS (the EOS stays in, as zoo-infer's
stop sequences do); rows are counted the same way zoo-infer counts `generated_tokens`.
The output JSON has `tokens` (one list per prompt, in input order), `generated_tokens`,
`generation_seconds`, `load_seconds` and versions.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def cut_after_eos(tokens: list[int], eos_id: int) -> list[int]:
    """Returns tokens up to and including the first `eos_id` (all of them when there is none)."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser (see --help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--tokens_json", type=Path, required=True, help="JSON with `token_ids`: one list of ids per prompt")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and compute dtype (default: float32)")
    parser.add_argument("--batch_size", type=int, default=32, help="prompts per generate() call (default: 32)")
    parser.add_argument("--max_tokens", type=int, default=64, help="max_new_tokens (default: 64)")
    parser.add_argument("--eos_id", type=int, default=2, help="stop token id, also used as pad id (default: 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: every core available)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Loads the model, generates batch by batch, writes the tokens and the timing."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    # The same thread count zoo-infer uses by default (every core this process may run on).
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    token_ids: list[list[int]] = json.loads(args.tokens_json.read_text())["token_ids"]

    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    load_seconds = time.perf_counter() - load_start

    outputs: list[list[int]] = []
    start = time.perf_counter()  # --- timed: the generation loop only ---
    with torch.inference_mode():
        for first in range(0, len(token_ids), args.batch_size):
            batch = token_ids[first: first + args.batch_size]
            width = max(len(ids) for ids in batch)
            # Left padding: every row's last prompt token sits in the last column, so the new
            # tokens of all rows are appended in the same columns.
            input_ids = torch.full((len(batch), width), args.eos_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, ids in enumerate(batch):
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention_mask[row, width - len(ids):] = 1
            generated = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                max_new_tokens=args.max_tokens, eos_token_id=args.eos_id, pad_token_id=args.eos_id,
            )
            for row in generated[:, width:].tolist():
                outputs.append(cut_after_eos(row, args.eos_id))
    generation_seconds = time.perf_counter() - start  # --- end of timed part ---

    import transformers

    result = {
        "engine": "transformers",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "num_prompts": len(token_ids),
        "generated_tokens": sum(len(row) for row in outputs),
        "generation_seconds": generation_seconds,
        "load_seconds": load_seconds,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "tokens": outputs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))
    print(f"transformers {args.dtype}: {result['generated_tokens']} tokens in {generation_seconds:.2f} s "
          f"({result['generated_tokens'] / max(generation_seconds, 1e-9):.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
