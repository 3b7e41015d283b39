#!/usr/bin/env python
"""The transformers baseline of benchmarks/throughput.py: `generate()` over static batches.

Run as its own process by throughput.py (so its memory and start-up are its own):

    python benchmarks/peers/hf_generate.py --model models/smollm2-135m-instruct \\
        --tokens_json out/tokens.json --dtype float32 --batch_size 32 --max_tokens 64 \\
        --out out/hf_float32.json

It reads the already tokenized prompts (`token_ids` of the JSON that throughput.py writes, the
same ids zoo-infer reads from its .h5), cuts them into consecutive batches of --batch_size in the
given order, left-pads each batch with an attention mask, and calls `model.generate()` greedily
with `max_new_tokens` and EOS as the stop token: the plain way to batch with transformers, with no
continuous batching (a batch lasts as long as its longest row).

What is timed: the generation loop only, from the first batch to the last (model loading,
imports and reading the input are excluded; the parent measures the whole process separately).
On a GPU (--device cuda, benchmarks/gpu_throughput.py) --way picks one of three: `default`, `no_cudnn`
(cuDNN attention off: it builds a plan per key length) and `static` (a static cache, compiled by
transformers into CUDA graphs; one untimed batch first, so compilation is not timed, and the graphs it compiled
are counted: `compiled_graphs` in the output, 0 if transformers did not compile). A negative
--eos_id means no stop token: every row generates --max_tokens.
Each row's generated tokens are cut right after the first EOS (the EOS stays in, as zoo-infer's
stop sequences do); rows are counted the same way zoo-infer counts `generated_tokens`.
The output JSON has `tokens` (one list per prompt, in input order), `generated_tokens`,
`generation_seconds`, `load_seconds` and versions.
"""
from __future__ import annotations

import os
import sys
import time

from _common import base_parser, normalize, read_teacher_forced, read_token_ids, threads, write_result


def main(argv: list[str] | None = None) -> int:
    """Loads the model, generates batch by batch, writes the tokens and the timing."""
    parser = base_parser(__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--way", choices=("default", "no_cudnn", "static"), default="default",
                        help="how generate() runs (default: default)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads(args))
    token_ids = read_token_ids(args.tokens_json)

    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval().to(args.device)
    load_seconds = time.perf_counter() - load_start
    if args.way == "no_cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    pad_id = max(args.eos_id, 0)
    eos_id = args.eos_id if args.eos_id >= 0 else None
    options = {"cache_implementation": "static"} if args.way == "static" else {}

    def generate(batch: list[list[int]]) -> torch.Tensor:
        """Greedy continuations of one batch, left-padded: (rows, width + new tokens)."""
        width = max(len(ids) for ids in batch)
        # Left padding: every row's last prompt token sits in the last column, so the new
        # tokens of all rows are appended in the same columns.
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        return model.generate(input_ids=input_ids.to(args.device), attention_mask=attention_mask.to(args.device),
                              do_sample=False, max_new_tokens=args.max_tokens, eos_token_id=eos_id,
                              pad_token_id=pad_id, **options)

    compiled = {}
    if args.way == "static":  # compiles on its first call: not timed; whether it did is recorded
        from torch._dynamo.utils import counters

        first_start = time.perf_counter()
        with torch.inference_mode():
            generate(token_ids[: args.batch_size])
        compiled = {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
                    "first_batch_seconds": time.perf_counter() - first_start}
        print(f"static cache: {compiled['compiled_graphs']} graphs compiled by the untimed first batch "
              f"({compiled['first_batch_seconds']:.1f} s)")

    outputs: list[list[int]] = []
    start = time.perf_counter()  # --- timed: the generation loop only ---
    with torch.inference_mode():
        for first in range(0, len(token_ids), args.batch_size):
            batch = token_ids[first: first + args.batch_size]
            width = max(len(ids) for ids in batch)
            generated = generate(batch)
            outputs += [normalize(row, args.eos_id, stopped_at_eos=False) for row in generated[:, width:].tolist()]
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    generation_seconds = time.perf_counter() - start  # --- end of timed part ---

    forced = []
    with torch.inference_mode():  # teacher-forced top-1: one sequence at a time, no padding
        for sequence, begin in read_teacher_forced(args.teacher_forced):
            ids = torch.tensor([sequence], device=args.device)
            best = model(input_ids=ids).logits[0, begin - 1: -1].argmax(-1)  # the token predicted at each position
            forced.append((best == ids[0, begin:]).tolist())
    write_result(args, "transformers", outputs, generation_seconds, load_seconds=load_seconds, **compiled,
                 threads=torch.get_num_threads(), **({"teacher_forced_top1": forced} if forced else {}),
                 versions={"torch": torch.__version__, "transformers": transformers.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
