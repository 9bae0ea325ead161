#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh` and `source tools/h200.sh`: the
# quantized-KV whole-model record of issue 25 and the GPU accuracy record, about 6 minutes.
#   - ab-decode: Qwen3-4B, 4-bit weights (random, seed 0), 4-bit KV cache (group 64) at
#     32768+65, our model (decode-attention; the quantized guard decides the attention path)
#     against mlx-lm with its full-precision cache on the same weights (--mlx-lm-kv-bits none:
#     mlx-lm's QuantizedKVCache cannot run on MLX 0.32.4's CUDA backend, docs/quantized-kv.md),
#     4 rounds, order rotated;
#   - tools/quantized_accuracy.py --device gpu: ours (the default CUDA kernel) and mlx-lm's
#     quantized path against float64 over the original K/V, every bits x group size.
# Records go to $OUT with "-" for "+" in names (the device tool refuses "+"); rename on the way
# into benchmark_results/ (h200-qwen3-4b-4bit-kv4-ab-decode-32768+65-mlx-0.32.4.json).
#   LLM_EVAL_GIT_SHA=<commit> bash tools/h200_quantized_model.sh
set -uo pipefail
: "${LLM_EVAL_GIT_SHA:?set LLM_EVAL_GIT_SHA to the commit being measured}"
export LLM_EVAL_GIT_SHA PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -m llm_eval.ab_decode --model qwen3-4b --quantize 4bit --kv-bits 4 --kv-group-size 64 \
  --mlx-lm-kv-bits none --input-len 32768 --output-len 65 --rounds 4 \
  --variants decode-attention,mlx-lm \
  --json-output "$OUT/h200-qwen3-4b-4bit-kv4-ab-decode-32768-65-mlx-0.32.4.json" 2>&1 |
  tail -14 | tee "$OUT/quantized-model.txt"
python3 tools/quantized_accuracy.py --device gpu \
  --json-output "$OUT/h200-qwen3-4b-attention-quantized-accuracy-mlx-0.32.4.json" 2>&1 |
  tail -3 | tee -a "$OUT/quantized-model.txt"
