#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`; reuses tools/h200.sh's build in
# /tmp/ext when there is one, builds it otherwise): issue 21 with the fused step as enable()'s
# default, for a Llama-3-8B-shaped config (no q/k norm) and Qwen3-4B, in one call:
#   1. the GPU tests of attention_step (with and without q/k norm) and of mlx-lm's fused step
#      (Llama, Qwen2, Qwen3 on CUDA): $OUT/tests.txt;
#   2. tools/h200_mlx_lm.sh: mlx-lm-decode, llama-3-8b then qwen3-4b, 4-bit, 32+97 and 8192+65,
#      three variants rotated in one process (mlx-lm; mlx-lm+kernel = enable(), the fused step;
#      mlx-lm+kernel-attention-only = enable(fused_step=False)), $ROUNDS (default 3) rounds:
#      $OUT/log.txt, $OUT/records.tar.
# At most 4 files under $OUT (build.log when it builds).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
REUSE_EXT=1 source tools/h200.sh
set +e
python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_attention_step.py \
  packages/attn-kernels/tests/test_mlx_lm_step.py \
  -k "gpu or cuda" > "$OUT/tests.txt" 2>&1
rc=$?
echo "GPU tests: rc $rc, $(grep -E '(passed|failed|error)' "$OUT/tests.txt" | tail -1)" |
  tee -a "$OUT/log.txt"
REUSE_EXT=1 tools/h200_mlx_lm.sh --model llama-3-8b --model qwen3-4b --quantize 4bit \
  --workload 32+97 --workload 8192+65 --rounds "${ROUNDS:-3}" --attention-only
