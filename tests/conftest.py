"""pytest setup: tests import their helpers from tests/harness.py; nothing is fetched from a hub.

The fixtures here are the ones more than one test file uses; they import their helpers when first used, so that
collecting stays light.
"""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))
# Inductor's compiled code in this machine type's folder, as a job keeps it (modelzoo/runtime.py), not in the shared
# default folder: PyTorch 2.13's graph cache serves code compiled at AVX-512 to a process held to AVX2
# (ATEN_CPU_CAPABILITY=avx2) on the same CPU, whose compiled decode step then picked token 0 at every step.
from modelzoo.cpu.kernels import machine_dir  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(machine_dir() / "inductor"))


@pytest.fixture(scope="session")
def tokenizer():
    """The real tokenizer; a missing checkpoint is a failure, not a skip (test_data_tools.py,
    test_decode_predictions.py)."""
    from prompt_files import TOKENIZER_DIR

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.fail(f"tokenizer not found at {TOKENIZER_DIR}: run `make setup` to create it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def three_adapters(tmp_path_factory) -> dict:
    """A tiny Llama and three adapters: attention only (q, v), MLP only (rank 8), every projection with rsLoRA
    (test_lora.py, test_lora_errors.py: built once for both)."""
    from harness import save_tiny_model
    from lora_adapters import PROMPTS, make_adapter, run_rows
    from tiny_configs import tiny_llama_config

    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    adapters = {"attn": make_adapter(base, root / "attn", ["q_proj", "v_proj"], r=4, seed=2),
                "mlp": make_adapter(base, root / "mlp", ["gate_proj", "up_proj", "down_proj"], r=8, seed=3),
                "all": make_adapter(base, root / "all", r=2, alpha=4, use_rslora=True, seed=4)}
    keys = {"adapters": {name: str(folder) for name, folder in adapters.items()}}
    alone = {name: run_rows(root, f"alone-{name}", base, PROMPTS, 3, {**keys, "adapter": name}) for name in adapters}
    alone[""] = run_rows(root, "alone-base", base, PROMPTS, 3, {})
    return {"root": root, "base": base, "adapters": adapters, "keys": keys, "alone": alone}
