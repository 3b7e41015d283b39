"""A 100,000-sample job streams: peak memory stays flat when the prompt count grows tenfold."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from harness import REPO_ROOT, load_predictions, save_tiny_model, write_h5, write_params
from tiny_configs import tiny_llama_config

VOCAB = 32
WIDTH = 512  # 100,000 rows x 512 int32 = 205 MB: loading the file whole would show in the peak

# Runs the job in a child process and prints that child's peak RSS in KiB.
MEASURE = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""


def peak_rss_kib(params: Path, model_dir: Path) -> int:
    result = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, str(REPO_ROOT / "run_inference.py"),
                             "--params", str(params), "--model_dir", str(model_dir)],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.strip().splitlines()[-1])


def test_peak_memory_is_flat_in_the_number_of_prompts(tmp_path):
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=WIDTH)
    checkpoint = save_tiny_model(config, tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    peaks = {}
    for samples in (10_000, 100_000):
        rows = np.full((samples, WIDTH), VOCAB, dtype=np.int32)
        rows[:, :3] = rng.integers(0, VOCAB, size=(samples, 3))
        write_h5(tmp_path / f"data{samples}", rows)
        params = write_params(tmp_path / f"p{samples}.yaml", checkpoint, tmp_path / f"data{samples}",
                              batch_size=2000, start_token=VOCAB, max_tokens=1, log_steps=10)
        peaks[samples] = peak_rss_kib(params, tmp_path / f"run{samples}")
    last = load_predictions(tmp_path / "run100000")[50]
    assert int(last["sample_index"][-1]) == 99_999 and last["num_generated"].tolist() == [1] * 2000
    assert peaks[100_000] <= 1.10 * peaks[10_000], peaks
