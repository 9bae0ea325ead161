#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`): issue 19's device work in one
# call. Builds (tools/h200.sh), then writes under $OUT, each step as it finishes:
#   1. h200-qwen3-4b-attention-fresh-inputs-mlx-0.32.4.json: bench-operators --fresh-inputs,
#      custom against mx.fast, S = 1 ... 131072, first use and repeat use;
#   2. gpu-tests.txt: the GPU cases of attn-kernels' tests (every schedule);
#   (SKIP_OPERATORS=1 leaves out step 1)
#   3. ab-<quant>-<L>.json: ab-decode, decode-attention against mlx-lm, Qwen3-4B random weights,
#      L+65 for L in $CONTEXTS (default 16384 32768), bf16 and 4-bit, $ROUNDS rotated rounds.
# Names without "+" (the device tool refuses them); rename when committing.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
source tools/h200.sh
set +e  # h200.sh sets -e: a failing test must not skip the records
export PYTHONUNBUFFERED=1
[ -n "${SKIP_OPERATORS:-}" ] || python3 -m llm_eval.operators --fresh-inputs --implementations custom,mlx \
  --context 1 --context 128 --context 1024 --context 4096 --context 16384 --context 32768 \
  --context 131072 --iterations 12 --context-repeats 2 \
  --json-output "$OUT/h200-qwen3-4b-attention-fresh-inputs-mlx-0.32.4.json" 2>&1 |
  grep -v '^\[#' | tee "$OUT/operators.txt"
python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests -k gpu 2>&1 |
  tail -40 > "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"
for context in ${CONTEXTS:-16384 32768}; do
  for quant in 4bit none; do
    python3 -m llm_eval.ab_decode --quantize "$quant" --input-len "$context" --output-len 65 \
      --rounds "${ROUNDS:-3}" --variants decode-attention,mlx-lm \
      --json-output "$OUT/ab-$quant-$context.json" 2>&1 | grep -v '^\[#' | tail -5
  done
done
