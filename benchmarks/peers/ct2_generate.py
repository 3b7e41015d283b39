#!/usr/bin/env python
"""CTranslate2 peer of benchmarks/throughput.py: `Generator.generate_batch`, greedy.

    pip install ctranslate2
    ct2-transformers-converter --model models/smollm2-135m-instruct --output_dir out/ct2_model
    python benchmarks/peers/ct2_generate.py --model models/smollm2-135m-instruct \\
        --ct2_model out/ct2_model --tokens_json out/tokens.json --dtype float32 --out out/ct2.json

throughput.py runs the converter itself (once, untimed) when --ct2_model has no model.bin. The
model is converted with its checkpoint's float32 weights; --dtype picks CTranslate2's
`compute_type` at load time (float32, bfloat16, float16). A compute type this CPU build does not
support (see ctranslate2.get_supported_compute_types("cpu")) is reported as skipped.

Batching: generate_batch with max_batch_size=--batch_size, CTranslate2's own scheme (it sorts the
prompts by length and decodes them in chunks of that size). The prompt is fed at once
(include_prompt_in_result=False), greedy (sampling_topk=1), stopping on EOS (end_token=[eos],
return_end_token=True so the EOS is part of the result, as in zoo-infer). Timed: the
generate_batch call only.
"""
from __future__ import annotations

import sys
import time

from _common import base_parser, normalize, read_token_ids, threads, write_result, write_skipped


def main(argv: list[str] | None = None) -> int:
    """Loads the converted model, generates, writes the result JSON."""
    parser = base_parser(__doc__)
    parser.add_argument("--ct2_model", required=True, help="folder written by ct2-transformers-converter")
    args = parser.parse_args(argv)
    import ctranslate2
    from transformers import AutoTokenizer

    supported = ctranslate2.get_supported_compute_types("cpu")
    if args.dtype not in supported:
        write_skipped(args, f"CTranslate2 {ctranslate2.__version__} on this CPU has no {args.dtype} compute type "
                            f"(supported: {', '.join(sorted(supported))})")
        return 0
    token_ids = read_token_ids(args.tokens_json)
    # CTranslate2 takes token strings; the ids map back one to one through the vocabulary.
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start_tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in token_ids]
    load_start = time.perf_counter()
    generator = ctranslate2.Generator(args.ct2_model, device="cpu", compute_type=args.dtype,
                                      intra_threads=threads(args), inter_threads=1)
    load_seconds = time.perf_counter() - load_start

    start = time.perf_counter()  # --- timed: generation only ---
    results = generator.generate_batch(
        start_tokens, max_batch_size=args.batch_size, batch_type="examples", max_length=args.max_tokens,
        sampling_topk=1, beam_size=1, include_prompt_in_result=False, end_token=[args.eos_id],
        return_end_token=True,
    )
    seconds = time.perf_counter() - start  # --- end of timed part ---
    tokens = [normalize(result.sequences_ids[0], args.eos_id, stopped_at_eos=False) for result in results]
    write_result(args, "ctranslate2", tokens, seconds, load_seconds=load_seconds, threads=threads(args),
                 versions={"ctranslate2": ctranslate2.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
