"""What the peer scripts share: their command line, reading the prompts, writing the result.

Every engine script here (the transformers baseline hf_generate.py included) is run by
benchmarks/throughput.py as its own process, with the same options (--model, --tokens_json, --dtype,
--batch_size, --max_tokens, --eos_id, --threads, --out) plus its own. It writes one JSON file: `tokens` (one list of generated ids per
prompt, in input order, cut right after the first EOS, which stays in), `generated_tokens`,
`generation_seconds` (the generation call only: no imports, no model load) and `versions`; or
`{"skipped": reason}` when the engine cannot run this configuration here (for instance a dtype
the CPU build does not support).

With --teacher_forced FILE (JSON: `sequences`, each a prompt followed by a reference continuation, and
`starts`, where each continuation begins), a script that can also writes `teacher_forced_top1`: per
sequence, for each continuation token, whether the engine's most likely next token after the tokens before
it is that token (benchmarks/fidelity.py). Untimed, after the generation.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def base_parser(description: str, dtypes: tuple[str, ...] = DTYPES) -> argparse.ArgumentParser:
    """The options every peer script takes (`dtypes`: what its --dtype accepts)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--tokens_json", type=Path, required=True, help="JSON with `token_ids`: one list of ids per prompt")
    parser.add_argument("--dtype", choices=dtypes, default="float32", help="compute dtype (default: float32)")
    parser.add_argument("--batch_size", type=int, default=32, help="most sequences decoded together (default: 32)")
    parser.add_argument("--max_tokens", type=int, default=64, help="most generated tokens per prompt (default: 64)")
    parser.add_argument("--eos_id", type=int, default=2, help="stop token id (default: 2)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default 0: every core available)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--teacher_forced", type=Path, default=None,
                        help="JSON of `sequences` and `starts`: also report teacher-forced top-1 agreement")
    return parser


def read_teacher_forced(path: Path | None) -> list[tuple[list[int], int]]:
    """The (sequence, continuation start) pairs of --teacher_forced; none without it."""
    if path is None:
        return []
    spec = json.loads(path.read_text())
    return list(zip(spec["sequences"], spec["starts"]))


def threads(args: argparse.Namespace) -> int:
    """The thread count: --threads, else every core this process may run on (zoo-infer's default)."""
    return args.threads or len(os.sched_getaffinity(0))


def read_token_ids(path: Path) -> list[list[int]]:
    """The tokenized prompts that throughput.py wrote (the same ids zoo-infer reads)."""
    return json.loads(path.read_text())["token_ids"]


def normalize(tokens: list[int], eos_id: int, stopped_at_eos: bool) -> list[int]:
    """Cuts after the first EOS; appends the EOS when the engine stopped on it but left it out.

    Engines differ in whether the stop token is part of the returned ids; zoo-infer and the
    transformers baseline keep it, so every engine's lists are brought to that form.
    """
    tokens = list(tokens)
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1]
    if stopped_at_eos:
        tokens.append(eos_id)
    return tokens


def write_result(args: argparse.Namespace, engine: str, tokens: list[list[int]], seconds: float,
                 **extra: Any) -> None:
    """Writes the result JSON and prints a one-line summary."""
    generated = sum(len(row) for row in tokens)
    result = {"engine": engine, "dtype": args.dtype, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
              "num_prompts": len(tokens), "generated_tokens": generated, "generation_seconds": seconds,
              **extra, "tokens": tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))
    print(f"{engine} {args.dtype}: {generated} tokens in {seconds:.2f} s ({generated / max(seconds, 1e-9):.1f} tokens/s)")


def write_skipped(args: argparse.Namespace, reason: str) -> None:
    """Writes {"skipped": reason}: this engine cannot run this configuration here."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"skipped": reason}))
    print(f"skipped: {reason}")
