"""The real SmolLM2 tokenizer's folder and ids, and the prompt files and command line of create_inference_h5.py."""
from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
VOCAB_SIZE = 49152
EOS_ID = 2


def create_args(input_path: Path, out_dir: Path, max_seq_len: int = 16, *extra: str) -> list[str]:
    """The command line of create_inference_h5 with the real tokenizer."""
    return [
        "--input", str(input_path), "--tokenizer", str(TOKENIZER_DIR),
        "--max_seq_len", str(max_seq_len), "--output_dir", str(out_dir), *extra,
    ]


def write_jsonl(path: Path, prompts: list[str], field: str = "prompt") -> Path:
    path.write_text("".join(json.dumps({field: p, "id": i}) + "\n" for i, p in enumerate(prompts)), encoding="utf-8")
    return path
