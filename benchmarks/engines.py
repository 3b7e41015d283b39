"""The engines benchmarks/throughput.py runs side by side, each as a measured child process: zoo-infer
(run_inference.py), transformers and the peers (vLLM, CTranslate2, llama.cpp: benchmarks/peers/),
with the untimed preparation a peer needs and the reasons one cannot run here."""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from data_tools import measure

REPO_ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(__file__).resolve().parent / "peers"
PEERS = ("vllm", "ctranslate2", "llamacpp")
GGUF_OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}  # int8: llama.cpp's Q8_0
COLUMNS = ("engine", "dtype", "status", "generated_tokens", "generation_seconds", "tokens_per_s", "decode_seconds",
           "process_seconds", "setup_seconds", "peak_rss_mib", "rss_bound_mib", "ratio_vs_hf_fp32",
           "ratio_vs_hf_same_dtype", "ratio_vs_vllm", "ratio_vs_llamacpp", "of_ceiling", "of_roofline",
           "decode_of_roofline", "equal_to_hf_fp32", "tokens_per_s_rounds", "note")

run_measured = functools.partial(measure.run_measured, cwd=REPO_ROOT)  # every engine runs from the repo root


@dataclass
class Prepared:
    """The tokenized prompt set, as files every engine reads."""

    data_dir: Path
    tokens_json: Path
    token_ids: list[list[int]]
    start_token: int
    eos_id: int
    max_seq_len: int


# --------------------------------------------------------------------------------------------
# The engines
# --------------------------------------------------------------------------------------------


def add_run_options(parser: argparse.ArgumentParser, out: str) -> None:
    """--out (default `out`), --seed, --threads and --timeout, as every side-by-side script takes them."""
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=None)


def start_run(args: argparse.Namespace) -> tuple[Path, int]:
    """The output folder (created) and the thread count (--threads, else every core available); no hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out, args.threads or len(os.sched_getaffinity(0))


def result_row(engine: str, dtype: str, **values: Any) -> dict[str, Any]:
    """A table row with every column present."""
    row: dict[str, Any] = {column: None for column in COLUMNS}
    row.update({"engine": engine, "dtype": dtype, "status": "ok", "note": ""})
    row.update(values)
    return row


def zoo_generated(model_dir: Path, num_prompts: int) -> list[list[int] | None]:
    """Each sample's generated ids, read back from the run's predictions files."""
    out: list[list[int] | None] = [None] * num_prompts
    for path in sorted((model_dir / "artifacts" / "predictions").glob("predictions_*.npz")):
        with np.load(path, allow_pickle=False) as npz:
            preds = npz["predictions"] if int(npz["loop_dim"]) == 1 else npz["predictions"].T
            for row, index in enumerate(npz["sample_index"].tolist()):
                if 0 <= index < num_prompts:
                    begin = int(npz["prompt_length"][row])
                    out[index] = preds[row, begin: begin + int(npz["num_generated"][row])].tolist()
    return out


def run_zoo(args: argparse.Namespace, prep: Prepared, out: Path, dtype: str, threads: int, variant: str = "",
            model_keys: dict[str, Any] | None = None, batch_size: int | None = None,
            runconfig_keys: dict[str, Any] | None = None, repo: Path = REPO_ROOT) -> tuple[dict, list | None]:
    """zoo-infer's run_inference.py in `dtype` (plus `model_keys` and `runconfig_keys`, named `variant`), from the
    checkout `repo` (default: this one); tokens/s from its summary.json. Its rows in flight are the batch size, as
    the peers' sequences decoded together are."""
    params = {
        "model": {"checkpoint_path": str(Path(args.model).resolve()), "dtype": dtype,
                  "start_token": prep.start_token, "stop_sequences": [[prep.eos_id]],
                  "max_tokens": args.max_tokens, "loop_dim": 1, **(model_keys or {})},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(prep.data_dir.resolve()),
                            "batch_size": batch_size or args.batch_size},
        "runconfig": {"device": "cpu", "num_threads": threads, "log_steps": 10,
                      "rows_in_flight": batch_size or args.batch_size, **(runconfig_keys or {})},
    }
    name = f"{dtype}{'_' + variant if variant else ''}"
    params_path = out / f"params_{name}.yaml"
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    model_dir = out / f"zoo_{name}"
    command = [sys.executable, str(repo / "run_inference.py"), "--params", str(params_path),
               "--model_dir", str(model_dir), "--overwrite"]
    log_path = out / "logs" / f"zoo-infer_{name}.log"
    note = ""
    if (runconfig_keys or {}).get("weight_cache"):  # filled by an untimed set-up first: the timed run maps it
        fill = [*command[:-3], "--model_dir", str(out / f"zoo_{name}_cache_fill"), "--overwrite", "--compile_only"]
        fill_log = out / "logs" / f"zoo-infer_{name}_cache_fill.log"
        run_measured(fill, fill_log, args.timeout)
        said = re.findall(r"(weight cache: (?:wrote|not written|could not write|mapped)[^;\n]*)", fill_log.read_text())
        note = "before, --compile_only: " + (said[-1] if said else f"no weight cache line, see {fill_log}")
    measured = run_measured(command, log_path, args.timeout)
    summary_path = model_dir / "artifacts" / "summary.json"
    if measured.returncode != 0 or not summary_path.is_file():
        return result_row("zoo-infer", dtype, status=f"failed (exit {measured.returncode})", note=f"see {log_path}",
                          process_seconds=measured.process_seconds, peak_rss_mib=measured.peak_rss_mib), None
    summary = json.loads(summary_path.read_text())
    tokens = zoo_generated(model_dir, len(prep.token_ids))
    generated, seconds = int(summary["generated_tokens"]), float(summary["generation_seconds"])
    prefill = (summary.get("decode_step") or {}).get("prefill_seconds")  # the rest of the generation: decode steps
    counted = sum(len(t) for t in tokens if t is not None)
    if counted != generated:
        mismatch = f"predictions hold {counted} generated tokens, summary.json says {generated}"
        note = f"{note}; {mismatch}" if note else mismatch
    return result_row("zoo-infer", dtype, generated_tokens=generated, generation_seconds=seconds,
                      tokens_per_s=generated / seconds if seconds else None,
                      decode_seconds=seconds - prefill if prefill is not None else None,
                      process_seconds=measured.process_seconds, setup_seconds=summary.get("setup_seconds"),
                      peak_rss_mib=measured.peak_rss_mib, note=note), tokens


def zoo_teacher_forced(model: str, dtype: str, pairs: list[tuple[list[int], list[int]]], max_seq_len: int,
                       threads: int) -> list[list[bool]]:
    """zoo-infer's teacher-forced top-1 flags for each (prompt, continuation), through its Python API (call it in a
    process of its own: it loads the model)."""
    from modelzoo.api import ZooModel

    zoo = ZooModel(model, dtype=dtype, max_seq_len=max_seq_len, rows_in_flight=64, num_threads=threads)
    return [score.greedy.tolist() for score in zoo.score_tokens(pairs)]


def run_child(engine: str, script: Path, args: argparse.Namespace, prep: Prepared, out: Path, dtype: str,
              threads: int, extra: list[str] = (), python: str | None = None) -> tuple[dict, list | None]:
    """transformers or a peer: a child script that writes its tokens and timing to a JSON.

    `python` is the interpreter that runs the script (default: this one).
    """
    result_path = out / f"{engine}_{dtype}.json"
    result_path.unlink(missing_ok=True)
    command = [python or sys.executable, str(script), "--model", str(Path(args.model).resolve()),
               "--tokens_json", str(prep.tokens_json), "--dtype", dtype, "--batch_size", str(args.batch_size),
               "--max_tokens", str(args.max_tokens), "--eos_id", str(prep.eos_id), "--threads", str(threads),
               "--out", str(result_path), *extra]
    log_path = out / "logs" / f"{engine}_{dtype}.log"
    measured = run_measured(command, log_path, args.timeout)
    result = read_result(result_path)
    if result is None:
        return result_row(engine, dtype, status=f"failed (exit {measured.returncode})", note=f"see {log_path}",
                          process_seconds=measured.process_seconds, peak_rss_mib=measured.peak_rss_mib), None
    if "skipped" in result:
        return result_row(engine, dtype, status="skipped", note=result["skipped"]), None
    # A child writes its result last; one that crashed after that (vLLM can abort in its shutdown) still measured it.
    notes = [f"exited {measured.returncode} after writing its result, see {log_path}"] if measured.returncode else []
    if result.get("kernels"):  # vLLM's kernel libraries: its AVX2 or AVX-512 builds
        notes.append(f"kernels {' '.join(result['kernels'])}")
    note = "; ".join(notes)
    generated, seconds = int(result["generated_tokens"]), float(result["generation_seconds"])
    return result_row(engine, dtype, generated_tokens=generated, generation_seconds=seconds,
                      tokens_per_s=generated / seconds if seconds else None, note=note,
                      setup_seconds=result.get("load_seconds"),  # its model load (vLLM's includes its compile)
                      process_seconds=measured.process_seconds, peak_rss_mib=measured.peak_rss_mib), result["tokens"]


def read_result(path: Path) -> dict | None:
    """A child's result JSON, or None where it wrote none or an incomplete one."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if "skipped" in result or {"tokens", "generated_tokens", "generation_seconds"} <= set(result) else None


# --------------------------------------------------------------------------------------------
# Peers: which are available, and what they need prepared (untimed)
# --------------------------------------------------------------------------------------------


def python_imports(python: str, module: str, timeout_s: float = 300) -> str | None:
    """Why `python -c 'import module'` fails (its last error line), or None when it works."""
    try:
        proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, check=False,
                              timeout=timeout_s, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python} ({exc})"
    if proc.returncode == 0:
        return None
    lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def peer_unavailable(name: str, vllm_python: str | None = None) -> str | None:
    """Why peer `name` cannot run here, or None when it can. vLLM is looked for with `vllm_python`
    (default: this interpreter): `import vllm` must work there."""
    if name == "vllm":
        python = vllm_python or sys.executable
        if python == sys.executable and importlib.util.find_spec("vllm") is None:
            return "vllm is not installed (see benchmarks/peers/README.md, or pass --vllm_python)"
        problem = python_imports(python, "vllm")
        return None if problem is None else (f"`import vllm` fails with {python}: {problem} "
                                             "(see benchmarks/peers/README.md)")
    if name == "ctranslate2":
        if importlib.util.find_spec("ctranslate2") is None:
            return "ctranslate2 is not installed (pip install ctranslate2)"
        return None if ct2_converter() else "ct2-transformers-converter not found next to python or on PATH"
    if name == "llamacpp":
        return None if shutil.which("llama-server") else "llama-server is not on PATH (see benchmarks/peers/README.md)"
    return f"unknown peer {name!r} (known: {', '.join(PEERS)})"


def ct2_converter() -> str | None:
    """The ct2-transformers-converter executable: next to this Python first, then on PATH."""
    beside = Path(sys.executable).parent / "ct2-transformers-converter"
    return str(beside) if beside.is_file() else shutil.which("ct2-transformers-converter")


def ensure_ct2_model(args: argparse.Namespace, out: Path) -> tuple[Path | None, str]:
    """Converts the checkpoint for CTranslate2 once (untimed); returns (folder, problem)."""
    folder = out / "ct2_model"
    if (folder / "model.bin").is_file():
        return folder, ""
    log_path = out / "logs" / "ct2_convert.log"
    print(f"converting {args.model} for CTranslate2 into {folder} (once, not timed)")
    measured = run_measured([ct2_converter() or "ct2-transformers-converter", "--model", str(Path(args.model).resolve()),
                             "--output_dir", str(folder), "--force"], log_path)
    if measured.returncode != 0:
        return None, f"ct2-transformers-converter failed (exit {measured.returncode}), see {log_path}"
    return folder, ""


def check_gguf_options(items: list[str]) -> None:
    """Exits with an error unless every --gguf item is DTYPE=PATH with DTYPE a full dtype name (float32, bfloat16,
    float16, int8 for a Q8_0 file): any other name would never match a dtype, and the GGUF would be converted again
    instead."""
    for item in items:
        if "=" not in item or item.split("=", 1)[0] not in GGUF_OUTTYPE:
            sys.exit(f"error: --gguf takes DTYPE=PATH with DTYPE in {', '.join(GGUF_OUTTYPE)}; got {item!r}")


def find_gguf(args: argparse.Namespace, out: Path, dtype: str) -> tuple[Path | None, str]:
    """The GGUF for llama.cpp in `dtype`: --gguf DTYPE=PATH, else <out>/gguf/model-<type>.gguf,
    else made there (untimed) with llama.cpp's convert_hf_to_gguf.py from --llama_cpp_dir."""
    given = dict(item.split("=", 1) for item in args.gguf)
    if dtype in given:
        return Path(given[dtype]), ""
    target = out / "gguf" / f"model-{GGUF_OUTTYPE[dtype]}.gguf"
    if target.is_file():
        return target, ""
    script = Path(args.llama_cpp_dir) / "convert_hf_to_gguf.py" if args.llama_cpp_dir else None
    if script is None or not script.is_file():
        return None, (f"no {dtype} GGUF: pass --gguf {dtype}=PATH, or --llama_cpp_dir with convert_hf_to_gguf.py "
                      "(see benchmarks/peers/README.md)")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {args.model} to {target} (once, not timed)")
    log_path = out / "logs" / f"gguf_convert_{dtype}.log"
    measured = run_measured([sys.executable, str(script), str(Path(args.model).resolve()), "--outtype",
                             GGUF_OUTTYPE[dtype], "--outfile", str(target)], log_path)
    if measured.returncode != 0 or not target.is_file():
        return None, f"convert_hf_to_gguf.py failed (exit {measured.returncode}), see {log_path}"
    return target, ""


def run_peer(name: str, args: argparse.Namespace, prep: Prepared, out: Path, dtype: str,
             threads: int, extra: list[str] = ()) -> tuple[dict, list | None]:
    """One peer in one dtype (after its untimed preparation); `extra`: more options for its script."""
    engine = {"vllm": "vllm", "ctranslate2": "ctranslate2", "llamacpp": "llama.cpp"}[name]
    if name == "vllm":
        return run_child(engine, PEERS_DIR / "vllm_generate.py", args, prep, out, dtype, threads, extra,
                         python=args.vllm_python)
    if name == "ctranslate2":
        folder, problem = ensure_ct2_model(args, out)
        if folder is None:
            return result_row(engine, dtype, status="failed", note=problem), None
        return run_child(engine, PEERS_DIR / "ct2_generate.py", args, prep, out, dtype, threads,
                         ["--ct2_model", str(folder), *extra])
    gguf, problem = find_gguf(args, out, dtype)
    if gguf is None:
        return result_row(engine, dtype, status="skipped", note=problem), None
    return run_child(engine, PEERS_DIR / "llamacpp_generate.py", args, prep, out, dtype, threads,
                     ["--gguf", str(gguf), *extra])


def select_peers(spec: str, vllm_python: str | None = None) -> list[str]:
    """--peers: 'auto' (every installed peer, with a printed reason for the others), 'none', or a list."""
    if spec == "none":
        return []
    if spec == "auto":
        chosen = []
        for name in PEERS:
            reason = peer_unavailable(name, vllm_python)
            if reason:
                print(f"peer {name}: skipped, {reason}")
            else:
                chosen.append(name)
        return chosen
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        sys.exit(f"error: unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}, or auto / none")
    return names
