#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh` and `source tools/h200.sh`: why
# the quantized-KV kernels run as they do (written when SIMT 8x2 and the first tensor-core
# kernel both ran at 400-800 GB/s; now 8x2 against the default, mmat4).
# Nsight Compute's kernel-only duration, DRAM throughput and launch shape for one call of each
# variant (S = 131072, 8- and 4-bit), then tools/quantized_where.py (each variant on the cache as
# mx.quantize returns it and with scales/biases re-made by a GPU op), and the default's GPU
# accuracy record (docs/quantized-kv.md says what each outcome would mean). About 100 s.
#   LLM_EVAL_GIT_SHA=<commit> bash tools/h200_quantized_diagnose.sh
set -uo pipefail
: "${LLM_EVAL_GIT_SHA:?set LLM_EVAL_GIT_SHA to the commit being measured}"
export LLM_EVAL_GIT_SHA PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
for variant in 8x2 mmat4; do
  for bits in 8 4; do
    ATTN_QUANTIZED_VARIANT=$variant ncu --clock-control none -k regex:attend_quantized \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      python3 tools/gpu_profile_quantized.py $bits 131072 2>&1 |
      grep -E "attend_quantized|Duration|DRAM Throughput|Memory Throughput|Grid Size|Registers|Achieved Occupancy|Block Limit" |
      sed "s/^/$variant $bits-bit: /"
  done
done 2>&1 | tee "$OUT/quantized-ncu.txt"
for variant in 8x2 mmat4; do
  ATTN_QUANTIZED_VARIANT=$variant python3 tools/quantized_where.py --context 131072
done 2>&1 | tee "$OUT/quantized-where.txt"
ATTN_QUANTIZED_VARIANT=mmat4 python3 tools/quantized_accuracy.py --device gpu \
  --json-output "$OUT/h200-qwen3-4b-attention-quantized-accuracy-mmat4-mlx-0.32.4.json" 2>&1 |
  tail -3 | tee -a "$OUT/quantized-where.txt"
