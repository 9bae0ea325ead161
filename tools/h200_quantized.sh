#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh`: the quantized-KV op's operator
# records (8- and 4-bit, against mx.fast on bf16 K/V and mlx-lm's quantized path), its GPU tests,
# accuracy record, an A/B of the CUDA kernel's variants and chained-call records, most important
# first (a call cut short still returns what was written).
#   LLM_EVAL_GIT_SHA=<commit> bash tools/h200_quantized.sh       outputs under $OUT
# (the device's copy of the tree carries a stale .git: the records name the commit given).
set -uo pipefail
: "${LLM_EVAL_GIT_SHA:?set LLM_EVAL_GIT_SHA to the commit being measured}"
export LLM_EVAL_GIT_SHA
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/h200.sh || exit 1
python3 tools/gpu_quantized_sanity.py
ops() {
  python3 -m llm_eval.operators --device gpu \
    --implementations mlx,custom-quantized,mlx-lm-quantized,readable-quantized "$@"
}
for bits in 8 4; do
  ops --kv-bits $bits --context 1024 --context 4096 --context 32768 --context 131072 \
    --json-output "$OUT/h200-qwen3-4b-attention-quantized-$bits-bit.json"
done
python3 -m pytest -q -x packages/attn-kernels/tests/test_quantized.py -k gpu 2>&1 | tail -30
python3 tools/quantized_accuracy.py --device gpu --context 1000 --context 4133 --context 32768 \
  --json-output "$OUT/h200-qwen3-4b-attention-quantized-accuracy.json" | tail -3
# The default (mmat4) beside mmat (2 blocks per SM) and the SIMT kernel, then mmat4 again:
# drift shows.
for variant in mmat4 mmat 8x2 mmat4; do
  ATTN_QUANTIZED_VARIANT=$variant python3 tools/quantized_variants.py --baseline
done 2>&1 | tee "$OUT/variants.txt"
for bits in 8 4; do
  ops --kv-bits $bits --context 32768 --context 131072 --chain \
    --json-output "$OUT/h200-qwen3-4b-attention-quantized-$bits-bit-chained.json"
done
