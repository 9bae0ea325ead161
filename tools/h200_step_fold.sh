#!/usr/bin/env bash
# On the H200 (device tool; the lead's call has already run `source tools/h200.sh`): AttentionStep
# as one kernel (attend_mma_step, issue 24). About 200 s. Writes four files under $OUT:
#   fold-tests.txt    test_attention_step.py -k gpu (test_folded_step_matches_two_kernels_gpu: the
#                     folded kernel bit for bit against the two-kernel path, and float64)
#   fold-kernels.txt  kernels per decode step, decode-attention and mlx-lm (1024+9, bf16)
#   fold-bench.txt    step_bench 32+97 and 8192+65, 3 rounds, with the fold (ATTN_STEP_FOLD=1, opt-in) and
#                     without (ATTN_STEP_FOLD=0, read once per process: two runs, each with mlx-lm as the
#                     common reference)
#   fold-bench.json   the record of the run with the fold
#   bash tools/h200_step_fold.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"
export PYTHONUNBUFFERED=1
ATTN_STEP_FOLD=1 python3 -m pytest -q -p no:cacheprovider \
  packages/attn-kernels/tests/test_attention_step.py -k gpu > "$OUT/fold-tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/fold-tests.txt"
ATTN_STEP_FOLD=1 python3 tools/step_bench.py --count-kernels /tmp/graphs-fold --quantize none --workloads 1024+9 \
  --count-steps 2 --variants decode-attention mlx-lm > "$OUT/fold-kernels.txt" 2>&1
for fold in 1 0; do
  echo "== ATTN_STEP_FOLD=$fold" >> "$OUT/fold-bench.txt"
  json=()
  [ "$fold" = 1 ] && json=(--json-output "$OUT/fold-bench.json")
  ATTN_STEP_FOLD=$fold python3 tools/step_bench.py --quantize none --workloads 32+97 8192+65 \
    --rounds 3 --variants decode-attention mlx-lm "${json[@]}" 2>&1 | grep -v Warning \
    >> "$OUT/fold-bench.txt"
done
