#!/usr/bin/env python
"""Issues 47's and 50's bars, read from what benchmarks/device_checks.sh leaves in its folder: for each bar the
figure, the bar and whether it holds (PASS / FAIL, or MISSING where its run left no result), for the note that
closes or updates an issue.

    python benchmarks/device_bars.py gpu <folder>    # after `device_checks.sh gpu`: issue 47, on the GPU
    python benchmarks/device_bars.py amx <folder>    # after `device_checks.sh amx`: issue 50, on the 16-core host

--results PATH also writes the stage's runs' results.json files into one, keyed by run (what device_checks.sh brings
back). Exit status 0 when every bar holds, 1 otherwise (a missing result counts as not holding).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNS = {"gpu": ("setup512", "rows256", "rows1024", "float32"), "amx": ("job16", "tiny16", "tiny2")}  # by stage
MINIMAL_STEP_MS = 3.25  # ../shared/MEASURED.md: the minimal compiled-and-captured 1.1B decode step at 256 rows


@dataclass
class Bar:
    """One bar: `value` held against `limit`, from above (at_least) or from below."""

    what: str
    value: float | None
    limit: float
    at_least: bool = True

    def holds(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    def line(self) -> str:
        verdict = "MISSING" if self.value is None else "PASS" if self.holds() else "FAIL"
        figure = "-" if self.value is None else f"{self.value:.2f}"
        return f"{verdict:7}  {self.what}: {figure} (bar {'>=' if self.at_least else '<='} {self.limit:g})"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The result rows of a gpu_throughput.py (a list) or throughput.py ({'rows': [...]}) results.json; none if the
    run left no file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data["rows"] if isinstance(data, dict) else data


def find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The first row whose fields equal `match`, with a rate (status ok), else None."""
    for row in rows:
        if row.get("status") == "ok" and all(row.get(key) == value for key, value in match.items()):
            return row
    return None


def field(row: dict[str, Any] | None, key: str) -> float | None:
    """row[key] as a float; None where the row or its value is missing."""
    return None if row is None or row.get(key) is None else float(row[key])


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def gpu_bars(folder: Path) -> list[Bar]:
    """Issue 47's bars on the GPU (the 1.1B in bfloat16 unless said)."""
    setup = read_rows(folder / "setup512" / "results.json")
    rows256 = find(read_rows(folder / "rows256" / "results.json"), engine="zoo-infer", dtype="bfloat16")
    rows1024 = find(read_rows(folder / "rows1024" / "results.json"), engine="zoo-infer", dtype="bfloat16")
    float32 = find(read_rows(folder / "float32" / "results.json"), engine="zoo-infer", dtype="float32")
    return [
        Bar("tests/test_cuda.py: tests not passed (failed, errors, skipped)",
            tests_not_passed(folder / "test_cuda.log"), 0, at_least=False),
        Bar("float32 rows equal to the default generate()'s, of 64",
            field(float32, "rows_equal_to_default_generate"), 64),
        Bar("bfloat16, 256 rows: tokens/s over the best generate()'s", field(rows256, "vs_best_generate"), 3.0),
        Bar("bfloat16, 256 rows: tokens/s over the default generate()'s", field(rows256, "vs_default_generate"), 10.0),
        Bar("1024 rows' tokens/s over 256 rows'",
            ratio(field(rows1024, "tokens_per_s"), field(rows256, "tokens_per_s")), 1.2),
        Bar(f"decode step at 256 rows over the {MINIMAL_STEP_MS} ms minimal step",
            ratio(field(rows256, "decode_ms_per_step"), MINIMAL_STEP_MS), 1.15, at_least=False),
        Bar("set-up s of a 512 + 128 job, cold compile cache", field(find(setup, engine="zoo-infer"), "setup_seconds"),
            60, at_least=False),
        Bar("set-up s of the same job again, warm", field(find(setup, engine="zoo-infer job 2"), "setup_seconds"), 15,
            at_least=False),
    ]


def tests_not_passed(log: Path) -> float | None:
    """The tests of a pytest run's log that failed, raised an error or were skipped, from its closing counts ('3
    passed, 1 skipped in 2.0s'); None where the log has none (the run was stopped, or never started)."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", line))
        if counts and re.search(r" in [\d.]+s", line):
            return float(sum(n for word, n in counts.items() if word != "passed"))
    return None


def threads_of(folder: Path) -> str:
    """The thread count a throughput.py run used ('?' where it left no result)."""
    try:
        return str(json.loads((folder / "results.json").read_text())["config"]["threads"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def amx_bars(folder: Path) -> list[Bar]:
    """Issue 50's bars on the 16-core AMX host: bfloat16 against float32 at 16 threads (job16, tiny16), the 1.1B's
    scaling from 2 threads (tiny2) to 16, every run's peak RSS within its bound (weights + KV cache + 1 GiB)."""
    runs = {name: read_rows(folder / name / "results.json") for name in RUNS["amx"]}
    many, few = threads_of(folder / "tiny16"), threads_of(folder / "tiny2")
    bars = []
    for name, what in (("job16", "164-prompt job"), ("tiny16", "1.1B")):
        rates = {dtype: field(find(runs[name], engine="zoo-infer", dtype=dtype), "tokens_per_s")
                 for dtype in ("bfloat16", "float32")}
        bars.append(Bar(f"{what}, {threads_of(folder / name)} threads: bfloat16 tokens/s over float32's",
                        ratio(rates["bfloat16"], rates["float32"]), 1.3))
    for dtype in ("bfloat16", "float32"):
        bars.append(Bar(f"1.1B {dtype}: tokens/s at {many} threads over {few}",
                        ratio(field(find(runs["tiny16"], engine="zoo-infer", dtype=dtype), "tokens_per_s"),
                              field(find(runs["tiny2"], engine="zoo-infer", dtype=dtype), "tokens_per_s")), 5.0))
    for name, rows in runs.items():
        for row in rows:
            if row.get("engine") == "zoo-infer" and row.get("status") == "ok" and row.get("rss_bound_mib"):
                bars.append(Bar(f"{name} {row['dtype']}: peak RSS MiB (bound: weights + KV cache + 1 GiB)",
                                field(row, "peak_rss_mib"), float(row["rss_bound_mib"]), at_least=False))
    return bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("gpu", "amx"), help="which device_checks.sh stage's results to read")
    parser.add_argument("folder", type=Path, help="the folder that stage wrote")
    parser.add_argument("--results", type=Path, help="write the stage's runs' results here, keyed by run")
    args = parser.parse_args(argv)
    if args.results:
        found = {run: json.loads((args.folder / run / "results.json").read_text()) for run in RUNS[args.stage]
                 if (args.folder / run / "results.json").is_file()}
        args.results.write_text(json.dumps(found, indent=1) + "\n")
    bars = gpu_bars(args.folder) if args.stage == "gpu" else amx_bars(args.folder)
    print(f"issue {47 if args.stage == 'gpu' else 50}'s bars, from {args.folder}:")
    for bar in bars:
        print(bar.line())
    return 0 if all(bar.holds() for bar in bars) else 1


if __name__ == "__main__":
    sys.exit(main())
