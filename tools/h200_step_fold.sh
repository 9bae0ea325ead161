#!/usr/bin/env bash
# On the H200 (device tool; the lead's call has already run `source tools/h200.sh`): AttentionStep
# as one kernel (attend_mma_step, issue 24) against the two kernels in ONE process, the fold chosen
# per call (attention_step's fold, Model.set_fold_step; ATTN_STEP_FOLD=0 keeps decode-attention on
# two kernels). About 150 s, each step capped (195 s at most). Writes four files under $OUT:
#   fold-tests.txt    test_attention_step.py -k gpu (test_folded_step_matches_two_kernels_gpu: fold
#                     True against False with the same plan, counted by attention_step_folds(),
#                     within the dtype's tolerance, and against float64, positions up to 131072)
#   fold-kernels.txt  kernels per decode step, decode-attention and decode-attention-fold (1024+9)
#   fold-bench.txt    step_bench: decode-attention, decode-attention-fold and mlx-lm, bf16,
#                     32+97 1024+65 8192+65, 2 rotated rounds (folded steps printed per variant)
#   fold-bench.json   its record (written after every workload: a cut run keeps what it finished)
#   bash tools/h200_step_fold.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTN_STEP_FOLD=0
timeout 50 python3 -m pytest -q -p no:cacheprovider \
  packages/attn-kernels/tests/test_attention_step.py -k gpu > "$OUT/fold-tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/fold-tests.txt"
timeout 45 python3 tools/step_bench.py --count-kernels /tmp/graphs-fold --quantize none \
  --workloads 1024+9 --count-steps 2 --variants decode-attention decode-attention-fold \
  > "$OUT/fold-kernels.txt" 2>&1
echo "kernels rc=$?" >> "$OUT/fold-kernels.txt"
timeout 100 python3 tools/step_bench.py --quantize none --workloads 32+97 1024+65 8192+65 \
  --rounds 2 --variants decode-attention decode-attention-fold mlx-lm \
  --json-output "$OUT/fold-bench.json" 2>&1 | grep -v Warning > "$OUT/fold-bench.txt"
echo "bench rc=${PIPESTATUS[0]}" >> "$OUT/fold-bench.txt"
