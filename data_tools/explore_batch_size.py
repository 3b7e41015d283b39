#!/usr/bin/env python
"""Automatic batch size exploration: a short run at each batch size, then a recommendation.

    python data_tools/explore_batch_size.py --params params/smollm2_135m.yaml --model_dir runs/explore \\
        --batch_sizes 8,16,32,64 --steps 2

In the spirit of the Cerebras Model Zoo's automatic batch exploration: for each batch size the
job's own params are copied with `inference_input.batch_size` set to that size, and
run_inference.py runs the first --steps batches (`--inference_steps`, `--overwrite`) as a separate
process into a fresh sub-folder <model_dir>/bs<N>/. From each run:

  - samples/s and generated tokens/s: artifacts/summary.json (`samples_done`, `generated_tokens`
    over `generation_seconds`, the generation loop only, without start-up and model load);
  - peak RSS: ru_maxrss of the finished process (os.wait4), the memory the size really needed;
  - process s: the whole process's wall time.

The recommended size is the one with the most generated tokens/s whose peak RSS stays under
--memory_fraction (default 0.8) of the memory available when the exploration starts
(MemAvailable, capped by a cgroup limit). A size that fails (out of memory, or any error) is
reported and the others go on. The table is printed and written with a plot to --out
(default <model_dir>/batch_exploration/): batch_sizes.csv and batch_sizes.png.

Each size processes steps x size samples, so larger sizes see more (and other) prompts; use a
prompt file with at least steps x the largest size samples (fewer is flagged in the table, the
last batch then being partly padding rows). Relative paths in the params are taken from the
current folder, as run_inference.py takes them.
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from data_tools.measure import run_measured
from modelzoo.cpu.memory import available_host_memory

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_INFERENCE = REPO_ROOT / "run_inference.py"
COLUMNS = ("batch_size", "status", "steps", "samples", "generated_tokens", "generation_seconds", "samples_per_s",
           "tokens_per_s", "process_seconds", "peak_rss_mib", "fits_memory", "recommended", "note")


def parse_sizes(text: str) -> list[int]:
    """'8,16,32' -> [8, 16, 32] (sorted, unique, each >= 1)."""
    try:
        sizes = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise SystemExit(f"error: --batch_sizes takes comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"error: --batch_sizes must be integers >= 1, got {text!r}")
    return sizes


def explore_one(params: dict[str, Any], size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Runs the first --steps batches at batch size `size`; returns the table row."""
    sub_dir = args.model_dir / f"bs{size}"
    sub_dir.mkdir(parents=True, exist_ok=True)
    sized = copy.deepcopy(params)
    sized.setdefault("inference_input", {})["batch_size"] = size
    params_path = sub_dir / f"params_bs{size}.yaml"
    params_path.write_text(yaml.safe_dump(sized, sort_keys=False))
    command = [sys.executable, str(RUN_INFERENCE), "--params", str(params_path), "--model_dir", str(sub_dir),
               "--inference_steps", str(args.steps), "--overwrite"]
    if args.checkpoint_path:
        command += ["--checkpoint_path", args.checkpoint_path]
    if args.device:
        command += ["--device", args.device]
    log_path = sub_dir / "explore.log"
    measured = run_measured(command, log_path, args.timeout)
    row: dict[str, Any] = {column: None for column in COLUMNS}
    row.update({"batch_size": size, "steps": args.steps, "process_seconds": round(measured.process_seconds, 2),
                "peak_rss_mib": round(measured.peak_rss_mib, 1), "fits_memory": False, "recommended": False,
                "note": ""})
    summary_path = sub_dir / "artifacts" / "summary.json"
    if measured.returncode != 0 or not summary_path.is_file():
        killed = measured.returncode < 0 or measured.returncode == 137
        row.update(status=f"failed (exit {measured.returncode})",
                   note=("killed (out of memory or --timeout?); " if killed else "") + f"see {log_path}")
        return row
    summary = json.loads(summary_path.read_text())
    samples = int(summary.get("samples_done", summary.get("samples", 0)))
    tokens = int(summary["generated_tokens"])
    seconds = float(summary["generation_seconds"])
    row.update(status="ok", samples=samples, generated_tokens=tokens, generation_seconds=round(seconds, 3),
               samples_per_s=round(samples / seconds, 3) if seconds else None,
               tokens_per_s=round(tokens / seconds, 2) if seconds else None)
    if samples < args.steps * size:
        row["note"] = f"the data held only {samples} of {args.steps * size} samples (padding rows in the last batch)"
    return row


def recommend(rows: list[dict[str, Any]], limit_mib: float) -> dict[str, Any] | None:
    """Marks the rows that fit in memory; returns (and marks) the fastest of them."""
    fitting = []
    for row in rows:
        row["fits_memory"] = row["status"] == "ok" and row["peak_rss_mib"] < limit_mib
        if row["fits_memory"] and row["tokens_per_s"] is not None:
            fitting.append(row)
    if not fitting:
        return None
    best = max(fitting, key=lambda row: (row["tokens_per_s"], -row["batch_size"]))
    best["recommended"] = True
    return best


def format_table(rows: list[dict[str, Any]]) -> str:
    """The printed table."""
    header = ("batch size", "samples/s", "gen tokens/s", "peak RSS MiB", "process s", "fits", "status")
    cells = [header]
    for row in rows:
        status = row["status"] + ("  <- recommended" if row["recommended"] else "")
        if row["note"]:
            status += f"  ({row['note']})"
        cells.append((str(row["batch_size"]),
                      "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.2f}",
                      "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}",
                      f"{row['peak_rss_mib']:.0f}", f"{row['process_seconds']:.1f}",
                      "yes" if row["fits_memory"] else "no", status))
    widths = [max(len(line[i]) for line in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths) + "  ------")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], limit_mib: float, path: Path) -> bool:
    """Writes the PNG: tokens/s and samples/s (top), peak RSS (bottom) against batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a batch node
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib, or the `bench` extra); no plot written",
              file=sys.stderr)
        return False
    ok = [row for row in rows if row["status"] == "ok"]
    sizes = [row["batch_size"] for row in ok]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(sizes, [row["tokens_per_s"] for row in ok], "o-", label="generated tokens/s")
    top.set_ylabel("generated tokens/s")
    right = top.twinx()
    right.plot(sizes, [row["samples_per_s"] for row in ok], "s--", color="tab:orange", label="samples/s")
    right.set_ylabel("samples/s")
    best = next((row for row in rows if row["recommended"]), None)
    if best:
        top.axvline(best["batch_size"], color="tab:green", linestyle=":", label=f"recommended: {best['batch_size']}")
    handles, labels = top.get_legend_handles_labels()
    more_handles, more_labels = right.get_legend_handles_labels()
    top.legend(handles + more_handles, labels + more_labels, loc="upper left")
    top.set_title("batch size exploration (run_inference.py --inference_steps)")
    bottom.plot(sizes, [row["peak_rss_mib"] for row in ok], "o-", color="tab:red", label="peak RSS")
    max_rss = max((row["peak_rss_mib"] for row in ok), default=0.0)
    if limit_mib < 2 * max_rss:  # draw the limit only where it does not squash the curve flat
        bottom.axhline(limit_mib, color="black", linestyle="--", label=f"memory limit {limit_mib:.0f} MiB")
    else:
        bottom.set_title(f"memory limit {limit_mib:.0f} MiB (off the scale)", fontsize=9)
    bottom.set_ylabel("peak RSS (MiB)")
    # From zero: a few MiB of noise must not look like a trend.
    bottom.set_ylim(0, max(bottom.get_ylim()[1], 1.15 * max_rss))
    bottom.set_xlabel("batch size")
    if sizes and min(sizes) > 0 and max(sizes) / min(sizes) >= 4:
        bottom.set_xscale("log", base=2)
    bottom.set_xticks(sizes, [str(size) for size in sizes])
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser (see --help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, required=True, help="the job's params.yaml")
    parser.add_argument("--model_dir", type=Path, required=True, help="folder for the runs, one sub-folder bs<N> per size")
    parser.add_argument("--batch_sizes", default="8,16,32,64", help="comma-separated sizes (default: 8,16,32,64)")
    parser.add_argument("--steps", type=int, default=2, help="batches run at each size (default: 2)")
    parser.add_argument("--out", type=Path, default=None, help="where the CSV and PNG go "
                        "(default: <model_dir>/batch_exploration)")
    parser.add_argument("--memory_fraction", type=float, default=0.8, help="peak RSS must stay under this fraction "
                        "of the available memory (default: 0.8)")
    parser.add_argument("--checkpoint_path", default=None, help="passed on to run_inference.py")
    parser.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"), help="passed on to run_inference.py")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which one size's run is killed")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs every size, prints the table, writes the CSV and the plot; 0 when a size is recommended."""
    args = build_parser().parse_args(argv)
    sizes = parse_sizes(args.batch_sizes)
    if args.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    if not 0 < args.memory_fraction <= 1:
        raise SystemExit("error: --memory_fraction must be in (0, 1]")
    if not args.params.is_file():
        raise SystemExit(f"error: params file not found: {args.params}")
    params = yaml.safe_load(args.params.read_text())
    if not isinstance(params, dict):
        raise SystemExit(f"error: {args.params} is not a YAML mapping")
    out = args.out or args.model_dir / "batch_exploration"
    out.mkdir(parents=True, exist_ok=True)
    # Measured once, before any run, so every size is judged against the same budget.
    limit_mib = args.memory_fraction * available_host_memory() / 2**20
    print(f"batch sizes {sizes}, {args.steps} step(s) each; memory limit {limit_mib:.0f} MiB "
          f"({args.memory_fraction:.0%} of available)", flush=True)
    rows = []
    for size in sizes:
        row = explore_one(params, size, args)
        rows.append(row)
        rate = f"{row['tokens_per_s']:.1f} tokens/s" if row["tokens_per_s"] is not None else row["status"]
        print(f"  batch size {size}: {rate}, peak RSS {row['peak_rss_mib']:.0f} MiB", flush=True)
    best = recommend(rows, limit_mib)
    print()
    print(format_table(rows))
    csv_path, png_path = out / "batch_sizes.csv", out / "batch_sizes.png"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plotted = plot(rows, limit_mib, png_path)
    print()
    if best:
        print(f"recommended batch_size: {best['batch_size']} ({best['tokens_per_s']:.1f} generated tokens/s, "
              f"peak RSS {best['peak_rss_mib']:.0f} MiB of {limit_mib:.0f} MiB allowed)")
    else:
        print("no batch size ran within the memory limit; try smaller sizes")
    print(f"wrote {csv_path}" + (f" and {png_path}" if plotted else ""))
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
