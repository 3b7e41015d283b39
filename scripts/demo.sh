#!/usr/bin/env bash
# The main job on the embedded default model: prompts -> .h5 -> run_inference.py -> completions.
set -euo pipefail
py="${1:-.venv/bin/python}"
model=models/smollm2-135m-instruct
rm -rf runs/demo
"$py" data_tools/create_inference_h5.py --input data_tools/examples/prompts.jsonl --tokenizer "$model" \
    --max_seq_len 256 --chat_template --output_dir data/examples
start=$EPOCHREALTIME
"$py" run_inference.py --params params/smollm2_135m.yaml --model_dir runs/demo
awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "run_inference.py took %.1fs\n", b - a }'
"$py" data_tools/decode_predictions.py --model_dir runs/demo --tokenizer "$model" --skip_special_tokens \
    --output runs/demo/completions.jsonl
"$py" - <<'PY'
import json
for line in open("runs/demo/completions.jsonl"):
    row = json.loads(line)
    question = row["prompt"].rsplit("user\n", 1)[-1].replace("\nassistant\n", "").strip()
    print(f"\n[{row['sample_index']}] {question}\n--> {row['completion'].strip()}  ({row['num_generated']} tokens, {row['stop_reason']})")
PY
