#!/usr/bin/env python
"""llama.cpp peer of benchmarks/throughput.py: a local `llama-server`, one request per prompt.

    python benchmarks/peers/llamacpp_generate.py --model models/smollm2-135m-instruct \\
        --gguf out/gguf/smollm2-bf16.gguf --tokens_json out/tokens.json --dtype bfloat16 \\
        --batch_size 32 --max_tokens 64 --out out/llamacpp.json

How to build llama-server and make the GGUF (convert_hf_to_gguf.py --outtype f32|bf16) is in
benchmarks/peers/README.md. The GGUF must hold the weights in --dtype; throughput.py picks the
file per dtype.

The server is started on a free local port with --parallel --batch_size slots (its continuous
batching over that many sequences), a context of slots x (longest prompt + --max_tokens), and
--threads; once /health answers, --batch_size client threads send every prompt as token ids to
/completion with n_predict=--max_tokens, temperature 0 and top_k 1 (greedy), cache_prompt false
(no reuse of earlier prompts' KV) and return_tokens true. EOS ends a row (the server's default).
Timed: from the first request to the last answer (server start-up and model load excluded).
The server is a child of this script, so its peak memory is in this process tree's peak RSS.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import DTYPES, base_parser, normalize, read_teacher_forced, read_token_ids, threads, write_result, write_skipped

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict, timeout: float) -> dict:
    """POSTs `body` as JSON and returns the JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(base: str, server: subprocess.Popen) -> None:
    """Waits until GET /health answers 200 (the model is loaded), or raises."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {server.returncode} during start-up")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server did not become healthy within {STARTUP_TIMEOUT_S} s")


def main(argv: list[str] | None = None) -> int:
    """Starts llama-server, sends the prompts concurrently, writes the result JSON."""
    parser = base_parser(__doc__, (*DTYPES, "int8"))  # int8: a Q8_0 GGUF
    parser.add_argument("--gguf", type=Path, required=True, help="GGUF file with the weights in --dtype (int8: Q8_0)")
    parser.add_argument("--server_bin", default="llama-server", help="llama-server executable (default: on PATH)")
    args = parser.parse_args(argv)
    binary = shutil.which(args.server_bin)
    if binary is None:
        write_skipped(args, f"{args.server_bin} not found on PATH")
        return 0
    if not args.gguf.is_file():
        write_skipped(args, f"GGUF file not found: {args.gguf}")
        return 0
    token_ids = read_token_ids(args.tokens_json)
    forced_pairs = read_teacher_forced(args.teacher_forced)
    slots = args.batch_size
    context = slots * (max([len(ids) for ids in token_ids] + [len(s) for s, _ in forced_pairs]) + args.max_tokens)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = args.out.with_suffix(".server.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = [binary, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "--ctx-size", str(context), "--threads", str(threads(args)),
               "--threads-batch", str(threads(args))]
    load_start = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base, server)
            load_seconds = time.perf_counter() - load_start

            def complete(ids: list[int]) -> list[int]:
                answer = post_json(base + "/completion", {
                    "prompt": list(ids), "n_predict": args.max_tokens, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True, "stream": False,
                }, timeout=3600)
                # Newer servers say stop_type "eos"; older ones stopped_eos true.
                at_eos = answer.get("stop_type") == "eos" or bool(answer.get("stopped_eos"))
                return normalize(answer.get("tokens") or [], args.eos_id, at_eos)

            start = time.perf_counter()  # --- timed: all requests ---
            with ThreadPoolExecutor(max_workers=slots) as pool:
                tokens = list(pool.map(complete, token_ids))
            seconds = time.perf_counter() - start  # --- end of timed part ---

            def forced_top1(pair: tuple[list[int], int]) -> list[bool]:
                """One greedy token after each prefix of the sequence, the slot's cache reused from one to the next."""
                sequence, begin = pair
                return [post_json(base + "/completion", {
                    "prompt": sequence[:i], "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": True,
                    "return_tokens": True, "stream": False}, timeout=600).get("tokens", [None])[0] == sequence[i]
                    for i in range(begin, len(sequence))]

            with ThreadPoolExecutor(max_workers=slots) as pool:
                forced = list(pool.map(forced_top1, forced_pairs))
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    write_result(args, "llama.cpp", tokens, seconds, load_seconds=load_seconds, threads=threads(args),
                 **({"teacher_forced_top1": forced} if forced else {}),
                 gguf=str(args.gguf), versions={"llama.cpp": version[0] if version else "unknown"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
