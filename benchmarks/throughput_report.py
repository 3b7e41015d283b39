"""What benchmarks/throughput.py reports: the machine's limits for the workload, the table with its ratio and
equality columns (printed, and written to results.csv and results.json), and the share of the roofline a target
takes."""
from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable

from benchmarks import machine
from benchmarks.engines import COLUMNS, Prepared

REFERENCE = ("transformers", "float32")  # the reference of the ratio and equality columns
PEER_COLUMNS = (("vllm", "ratio_vs_vllm"), ("llama.cpp", "ratio_vs_llamacpp"))  # the peers a row is compared with
Key = tuple[str, str]  # (engine, dtype)
Run = tuple[dict, list | None]  # one run's table row and its generated ids
Limits = Callable[[str, int], tuple[float | None, float | None]]  # (dtype, generated) -> (ceiling, roofline) tokens/s
DecodeLimit = Callable[[str, int], float | None]  # (dtype, generated) -> the decode's bound in seconds


def workload_of(prep: Prepared, decode_rows: int) -> Callable[[int], machine.Workload]:
    """generated tokens -> the workload of these prompts. A prefix every prompt shares (the chat
    template's system turn) is prefilled once by zoo-infer and by vLLM's prefix cache: counted once."""
    shared = len(os.path.commonprefix(prep.token_ids)) if len(prep.token_ids) > 1 else 0
    prompt_tokens = sum(map(len, prep.token_ids)) - shared * (len(prep.token_ids) - 1)
    return lambda generated: machine.Workload(prompt_tokens, len(prep.token_ids), generated, decode_rows, shared)


def print_machine(probe: machine.MachineProbe, workload: Callable[[int], machine.Workload], full: int,
                  dtypes: list[str]) -> None:
    """The probe's peaks, bandwidth and rates, and the limits in `dtypes` if every prompt generated `full` tokens in
    all: the GEMM ceiling and the roofline of the floating-point dtypes, the decode's bound of every dtype."""
    print(probe.describe())
    work = workload(full)
    print(f"if every prompt generated max_tokens: {work.flops(probe.shapes) / 1e12:.2f} TFLOP in the linear layers "
          f"({work.prompt_tokens} prompt tokens, the {work.shared_prefix}-token prefix all prompts share counted once, "
          f"{full} generated)")
    for dtype in dtypes:
        if dtype in probe.dtypes:
            ceiling, bound = probe.limits(dtype, work)
            print(f"  {dtype}: GEMM ceiling {ceiling:.0f} tokens/s (at the best rates above, nothing else), roofline "
                  + (f"{bound:.0f} tokens/s (prefill at the arithmetic peak, decode at its bound: no engine passes it)"
                     if bound else "not measured"))
        print(f"  {dtype} decode: {probe.decode_bound(dtype, work).describe()}")


def fill_comparisons(rows: list[dict], tokens: dict[tuple[str, str], list | None],
                     limits: Limits = lambda dtype, generated: (None, None),
                     decode_limit: DecodeLimit = lambda dtype, generated: None) -> None:
    """Adds the ratio and equality columns, against transformers' and vLLM's rows, the share of the GEMM ceiling
    and of the roofline (`limits(dtype, generated tokens)`: tokens/s) each row reaches, and, for a row that says how
    long its decode steps took, the share of the decode's bound (`decode_limit`: seconds) they reach."""
    by_key = {(row["engine"], row["dtype"]): row for row in rows}
    reference = by_key.get(REFERENCE)
    ref_rate = reference["tokens_per_s"] if reference else None
    ref_tokens = tokens.get(REFERENCE)
    for row in rows:
        rate = row["tokens_per_s"]
        if rate is None:
            continue
        if ref_rate:
            row["ratio_vs_hf_fp32"] = rate / ref_rate
        same = by_key.get(("transformers", row["dtype"]))
        if same and same["tokens_per_s"]:
            row["ratio_vs_hf_same_dtype"] = rate / same["tokens_per_s"]
        for peer, column in PEER_COLUMNS:
            same_peer = by_key.get((peer, row["dtype"]))
            if same_peer and same_peer["tokens_per_s"]:
                row[column] = rate / same_peer["tokens_per_s"]
        ceiling, bound = limits(row["dtype"], row["generated_tokens"])
        if ceiling:
            row["of_ceiling"] = rate / ceiling
        if bound:
            row["of_roofline"] = rate / bound
        decode_bound = decode_limit(row["dtype"], row["generated_tokens"])
        if decode_bound and row.get("decode_seconds"):
            row["decode_of_roofline"] = decode_bound / row["decode_seconds"]
        mine = tokens.get((row["engine"], row["dtype"]))
        if ref_tokens is not None and mine is not None:
            equal = sum(1 for a, b in zip(mine, ref_tokens) if a is not None and list(a) == list(b))
            row["equal_to_hf_fp32"] = equal / len(ref_tokens)


def combine_rounds(rounds: list[list[Run]]) -> tuple[list[Run], dict[Key, list[float | None]]]:
    """One run per engine and dtype out of several rounds of the same runs: the round of median tokens/s (the
    lower middle one of an even count; a failed round counts only if every round failed), with every round's
    tokens/s in its `tokens_per_s_rounds` column; and those rates by (engine, dtype), in round order."""
    runs: dict[Key, list[Run]] = {}
    for round_runs in rounds:
        for row, generated in round_runs:
            runs.setdefault((row["engine"], row["dtype"]), []).append((row, generated))
    chosen: list[Run] = []
    rates: dict[Key, list[float | None]] = {}
    for key, key_runs in runs.items():
        rates[key] = [row["tokens_per_s"] for row, _ in key_runs]
        measured = sorted((run for run in key_runs if run[0]["tokens_per_s"]), key=lambda run: run[0]["tokens_per_s"])
        row, generated = measured[(len(measured) - 1) // 2] if measured else key_runs[0]
        row = {**row, "tokens_per_s_rounds": "/".join(fmt(rate, 1) for rate in rates[key])}
        chosen.append((row, generated))
    return chosen, rates


def round_ratios(rows: list[dict], rates: dict[Key, list[float | None]]) -> list[str]:
    """Each row's ratio to a peer of its dtype round by round (the rounds both ran in): the median of them replaces
    the row's ratio column (a ratio of runs side by side, not of medians taken apart); returns a line per pair."""
    lines = []
    for row in rows:
        key = (row["engine"], row["dtype"])
        for peer, column in PEER_COLUMNS:
            if row["engine"] == peer or (peer, row["dtype"]) not in rates:
                continue
            ratios = [mine / theirs for mine, theirs in zip(rates.get(key, []), rates[(peer, row["dtype"])])
                      if mine and theirs]
            if ratios:
                row[column] = statistics.median(ratios)
                lines.append(f"{row['engine']} {row['dtype']} over {peer} {row['dtype']}, round by round: "
                             f"{', '.join(f'{ratio:.2f}' for ratio in ratios)} (median {row[column]:.2f})")
    return lines


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: '-' for missing, fixed decimals for floats."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """The printed table (the CSV has the same rows with full precision)."""
    header = ("engine", "dtype", "gen tokens", "seconds", "tokens/s", "process s", "setup s", "peak RSS MiB",
              "RSS bound MiB", "vs HF fp32", "vs HF same dtype", "vs vLLM", "vs llama.cpp", "of ceiling", "of roofline",
              "decode of roofline", "equal to HF fp32", "status")
    cells = [header]
    for row in rows:
        status = row["status"] if not row["note"] else f"{row['status']}: {row['note']}"
        cells.append((row["engine"].replace(" ", "_"), row["dtype"], fmt(row["generated_tokens"]),
                      fmt(row["generation_seconds"]), fmt(row["tokens_per_s"], 1), fmt(row["process_seconds"], 1),
                      fmt(row["setup_seconds"], 1), fmt(row["peak_rss_mib"], 0), fmt(row["rss_bound_mib"], 0),
                      fmt(row["ratio_vs_hf_fp32"]), fmt(row["ratio_vs_hf_same_dtype"]), fmt(row["ratio_vs_vllm"]),
                      fmt(row["ratio_vs_llamacpp"]),
                      fmt(row["of_ceiling"]), fmt(row["of_roofline"]), fmt(row["decode_of_roofline"]),
                      fmt(row["equal_to_hf_fp32"], 3), status))
    widths = [max(len(line[i]) for line in cells) for i in range(len(header) - 1)]
    lines = []
    for index, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
        if index == 0:
            lines.append("  ".join("-" * width for width in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(lines)


def write_outputs(rows: list[dict], out: Path, config: dict) -> tuple[Path, Path]:
    """results.csv (the table) and results.json (the table and the run's settings)."""
    csv_path, json_path = out / "results.csv", out / "results.json"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    return csv_path, json_path


def print_target(rows: list[dict], factor: float = 1.5) -> None:
    """For each dtype vLLM ran: `factor` x vLLM's tokens/s, as a share of the roofline."""
    by_key = {(row["engine"], row["dtype"]): row for row in rows}
    for (engine, dtype), row in by_key.items():
        if engine != "vllm" or not row["tokens_per_s"] or not row["of_roofline"]:
            continue
        target = factor * row["tokens_per_s"]
        print(f"{factor:g}x vLLM {dtype}: {target:.1f} tokens/s = {factor * row['of_roofline']:.2f} of the roofline "
              f"({row['tokens_per_s'] / row['of_roofline']:.1f}); above 1.00, no engine can reach it here")
