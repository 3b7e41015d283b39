#!/usr/bin/env python
"""Which rounding costs bfloat16 its float32 answers: the study behind modelzoo/cpu/precision.py's policy.

    .venv/bin/python benchmarks/precision_study.py --num_prompts 64 --max_tokens 64 [--chat_template]

zoo-infer's float32 path (token-exact with transformers float32) is run with one rounding to bfloat16 added at
a time, in this process, and each variant's greedy rows are compared with plain float32's:
  weights          the weights rounded to bfloat16 (all else float32: the policy on CPUs without native bfloat16)
  +gemm_inputs     and every linear layer's input rounded to bfloat16 (what a bfloat16 GEMM multiplies)
  +gemm_outputs    and every linear layer's output rounded to bfloat16 (what PyTorch's bfloat16 GEMMs return)
  +kv_bfloat16     weights, GEMM inputs, and keys and values stored in bfloat16 (PyTorch attention path)
  +kv_float16      the same with a float16 KV cache
  +gemm_inputs_but_<layer>  +gemm_inputs except the inputs of <layer> (qkv_proj, o_proj, gate_up_proj,
                   down_proj, lm_head), which stay float32: how much of the inputs' rounding that layer costs
  policy           the bfloat16 job as it runs (modelzoo/cpu/precision.py), where this CPU has AVX512-BF16
  policy_kv_bfloat16, policy_kv_float32  the policy with another KV cache storage
  all_bfloat16     everything in bfloat16 (PyTorch's arithmetic, the C++ kernels in bfloat16 storage)
Prints per variant: rows equal to float32; teacher-forced, over float32's own continuations, the mean absolute
difference of each continuation token's log-probability from float32's (a finer measure than rows, which turn on
a few near-ties) and the share of those tokens still the argmax; seconds of generation (indicative only: the
study's roundings are extra ops).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.prompts import load_prompts  # noqa: E402
from modelzoo import api, runtime  # noqa: E402
from modelzoo.cpu import precision  # noqa: E402
from modelzoo.cpu.gemm import MKLPackedLinear, OneDNNLinear, RowBlockLinear  # noqa: E402
from modelzoo.models.kv_cache import KVCache  # noqa: E402
from modelzoo.models import layers  # noqa: E402

GEMMS = (torch.nn.Linear, OneDNNLinear, MKLPackedLinear, RowBlockLinear)
LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
VARIANTS = ("weights", "+gemm_inputs", *(f"+gemm_inputs_but_{layer}" for layer in LAYERS), "+gemm_outputs",
            "+kv_bfloat16", "+kv_float16", "policy", "policy_kv_bfloat16", "policy_kv_float32", "all_bfloat16")


def rounded(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x rounded to `dtype`, back in x's dtype."""
    return lambda x: x.to(dtype).to(x.dtype)


@contextlib.contextmanager
def patched(target: object, name: str, value: object) -> Iterator[None]:
    """Sets target.name to value for the block."""
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


def build(variant: str, args: argparse.Namespace) -> api.ZooModel:
    """The model of one variant (module docstring)."""
    kwargs = dict(max_seq_len=args.max_seq_len, rows_in_flight=args.num_prompts)
    if variant == "all_bfloat16":
        with patched(precision, "bf16_kernel_available", lambda: False):
            return api.ZooModel(args.model, dtype="bfloat16", **kwargs)
    if variant == "policy":
        return api.ZooModel(args.model, dtype="bfloat16", **kwargs)
    if variant.startswith("policy_kv_"):
        storage = getattr(torch, variant.removeprefix("policy_kv_"))
        policy = runtime.precision_policy
        with patched(runtime, "precision_policy",
                     lambda *a, **k: dataclasses.replace(policy(*a, **k), kv_cache=storage)):
            return api.ZooModel(args.model, dtype="bfloat16", **kwargs)
    # float32 arithmetic on bfloat16-rounded weights: the policy of a CPU without native bfloat16
    with patched(precision, "native_multiplies", lambda dtype: dtype == torch.float32):
        model = api.ZooModel(args.model, dtype="bfloat16", **kwargs)
    bf16 = rounded(torch.bfloat16)
    if variant != "weights":
        kept = variant.removeprefix("+gemm_inputs_but_") if variant.startswith("+gemm_inputs_but_") else None
        for name, module in model.model.named_modules():
            if isinstance(module, GEMMS) and not (kept and name.split(".")[-1] == kept):
                module.register_forward_pre_hook(lambda _m, inputs: (bf16(inputs[0]),))
                if variant == "+gemm_outputs":
                    module.register_forward_hook(lambda _m, _inputs, out: bf16(out))
    return model


class Result(NamedTuple):
    """One variant's greedy rows and generation seconds, and teacher-forced over the reference rows, each token's
    log-probability and whether it was the argmax (all rows' tokens concatenated)."""

    rows: list[list[int]]
    seconds: float
    logprobs: np.ndarray
    greedy: np.ndarray


def generate(variant: str, args: argparse.Namespace, prompts: list[str],
             reference: list[list[int]] | None = None) -> Result:
    """One variant's greedy rows, generation seconds and teacher-forced scores of `reference` (default: its own
    rows)."""
    with contextlib.ExitStack() as stack:
        if variant in ("+kv_bfloat16", "+kv_float16"):
            storage = rounded(torch.bfloat16 if variant == "+kv_bfloat16" else torch.float16)
            update = KVCache.update
            stack.enter_context(patched(layers, "attention_kernel", lambda q, ctx: None))  # rounds k, v as stored
            stack.enter_context(patched(KVCache, "update", lambda self, layer, slots, positions, k, v: update(
                self, layer, slots, positions, storage(k), storage(v))))
        model = build(variant, args) if variant != "float32" else api.ZooModel(
            args.model, dtype="float32", max_seq_len=args.max_seq_len, rows_in_flight=args.num_prompts)
        start = time.perf_counter()
        out = model.generate(prompts, model.default_options(max_tokens=args.max_tokens),
                             chat_template=args.chat_template)
        seconds = time.perf_counter() - start
        rows = [list(o.token_ids) for o in out]
        pairs = [(model.encode(p, args.chat_template), r) for p, r in zip(prompts, reference or rows) if r]
        scores = model.score_tokens(pairs)
        return Result(rows, seconds, np.concatenate([s.logprobs for s in scores]),
                      np.concatenate([s.greedy for s in scores]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--chat_template", action="store_true", help="the prompts in the chat template (default: raw)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(v not in VARIANTS for v in variants):
        sys.exit(f"error: --variants takes {', '.join(VARIANTS)}")
    policies = [v for v in variants if v.startswith("policy")]
    if policies and not precision.bf16_kernel_available():
        print(f"{', '.join(policies)}: skipped (this CPU has no AVX512-BF16, or the C++ kernels are not built)")
        variants = [v for v in variants if v not in policies]
    prompts = load_prompts(args.num_prompts, seed=0)
    print(f"machine: {machine.cpu_description()}; {len(prompts)} HumanEval prompts, "
          f"{'chat template' if args.chat_template else 'raw'}, {args.max_tokens} tokens")
    exact = generate("float32", args, prompts)
    reference = exact.rows
    print("| variant | rows equal to float32 | mean abs log-prob difference | teacher-forced top-1 | seconds |\n"
          "|---|---|---|---|---|")
    for variant in ["float32", *variants]:
        result = exact if variant == "float32" else generate(variant, args, prompts, reference)
        equal = sum(a == b for a, b in zip(result.rows, reference))
        difference = np.abs(result.logprobs - exact.logprobs).mean()
        print(f"| {variant} | {equal} | {difference:.5f} | {100 * result.greedy.mean():.2f}% | {result.seconds:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
