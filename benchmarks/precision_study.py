#!/usr/bin/env python
"""Which rounding costs bfloat16 its float32 answers: the study behind modelzoo/precision.py's policy.

    .venv/bin/python benchmarks/precision_study.py --num_prompts 64 --max_tokens 64 [--chat_template]

zoo-infer's float32 path (token-exact with transformers float32) is run with one rounding to bfloat16 added at
a time, in this process, and each variant's greedy rows are compared with plain float32's:
  weights          the weights rounded to bfloat16 (all else float32: the policy on CPUs without native bfloat16)
  +gemm_inputs     and every linear layer's input rounded to bfloat16 (what a bfloat16 GEMM multiplies)
  +gemm_outputs    and every linear layer's output rounded to bfloat16 (what PyTorch's bfloat16 GEMMs return)
  +kv_bfloat16     weights, GEMM inputs, and keys and values stored in bfloat16 (PyTorch attention path)
  +kv_float16      the same with a float16 KV cache
  policy           the bfloat16 job as it runs (modelzoo/precision.py), where this CPU has AVX512-BF16
  all_bfloat16     everything in bfloat16 (PyTorch's arithmetic, the C++ kernels in bfloat16 storage)
Prints rows equal to float32 and seconds per variant (timings are indicative only: the study's roundings are
extra ops).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.prompts import load_prompts  # noqa: E402
from modelzoo import api, precision  # noqa: E402
from modelzoo.gemm import MKLPackedLinear, OneDNNLinear, RowBlockLinear  # noqa: E402
from modelzoo.generation.kv_cache import KVCache  # noqa: E402
from modelzoo.models import layers  # noqa: E402

GEMMS = (torch.nn.Linear, OneDNNLinear, MKLPackedLinear, RowBlockLinear)
VARIANTS = ("weights", "+gemm_inputs", "+gemm_outputs", "+kv_bfloat16", "+kv_float16", "policy", "all_bfloat16")


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
    # float32 arithmetic on bfloat16-rounded weights: the policy of a CPU without native bfloat16
    with patched(precision, "native_multiplies", lambda dtype: dtype == torch.float32):
        model = api.ZooModel(args.model, dtype="bfloat16", **kwargs)
    bf16 = rounded(torch.bfloat16)
    if variant != "weights":
        for module in model.model.modules():
            if isinstance(module, GEMMS):
                module.register_forward_pre_hook(lambda _m, inputs: (bf16(inputs[0]),))
                if variant == "+gemm_outputs":
                    module.register_forward_hook(lambda _m, _inputs, out: bf16(out))
    return model


def generate(variant: str, args: argparse.Namespace, prompts: list[str]) -> tuple[list[list[int]], float]:
    """One variant's greedy rows and its generation seconds."""
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
        return [o.token_ids for o in out], time.perf_counter() - start


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
    if "policy" in variants and not precision.bf16_kernel_available():
        print("policy: skipped (this CPU has no AVX512-BF16, or the C++ kernels are not built)")
        variants.remove("policy")
    prompts = load_prompts(args.num_prompts, seed=0)
    print(f"machine: {machine.cpu_description()}; {len(prompts)} HumanEval prompts, "
          f"{'chat template' if args.chat_template else 'raw'}, {args.max_tokens} tokens")
    reference, seconds = generate("float32", args, prompts)
    print(f"| variant | rows equal to float32 | seconds |\n|---|---|---|\n| float32 | {len(prompts)} | {seconds:.1f} |")
    for variant in variants:
        rows, seconds = generate(variant, args, prompts)
        equal = sum(a == b for a, b in zip(rows, reference))
        print(f"| {variant} | {equal} | {seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
