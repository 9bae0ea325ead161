#!/usr/bin/env bash
# On the H200 (device tool), after `source tools/h200.sh`: the long-context decode of the fused
# step (docs/fused-step.md, "Long contexts"). First the owned-cache and add-norm tests on CUDA
# (~20 s). Then bf16 Qwen3-4B at 32768+65, 16384+65 and 1024+65 through mlx-lm's generate_step,
# 2 rotated rounds: decode-attention (owned caches), the same step under MLX's donation rule
# alone (decode-attention-mlx-rule: the code of the 0.75x record), two experiments on the kernel
# count (decode-attention-addmm: the residual adds in the matmuls; decode-attention-add-norm: the
# add after attention and the norm in one kernel), the unfused chain and mlx-lm; per variant the
# cache copies, anatomy, slowest pipelined step and greedy tokens (the record is rewritten after
# every workload, so a run cut short keeps what it finished). Last the kernels per decode step
# (1024+9). About 190 s after the build (at most 350 s); three files under $OUT:
#   step-long.txt (everything printed), step-long-bf16.json, kernels-bf16.json
#   bash tools/h200_step_long.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/step-long.txt"
{
  date -u
  # The owned-cache tests and the add-norm kernel on CUDA first (~20 s): their first GPU run.
  timeout 60 python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_attention_step.py \
    -k "gpu and (owned or pipelined or view_of or held or donates)" 2>&1 | tail -6
  timeout 40 python3 -m pytest -q -p no:cacheprovider packages/qwen3-model/tests/test_add_norm.py \
    2>&1 | tail -6
  date -u
  timeout 170 python3 tools/step_bench.py --quantize none --workloads 32768+65 16384+65 1024+65 \
    --rounds 2 --anatomy-steps 8 --variants decode-attention decode-attention-mlx-rule \
    decode-attention-addmm decode-attention-add-norm decode-attention-unfused mlx-lm \
    --json-output "$OUT/step-long-bf16.json" 2>&1 | grep -v Warning
  echo "rc ${PIPESTATUS[0]}"
  date -u
  timeout 80 python3 tools/step_bench.py --count-kernels /tmp/graphs-long --quantize none \
    --workloads 1024+9 --count-steps 2 \
    --variants decode-attention decode-attention-addmm decode-attention-add-norm mlx-lm \
    --json-output "$OUT/kernels-bf16.json" 2>&1 | grep -v Warning
  echo "rc ${PIPESTATUS[0]}"
  date -u
} 2>&1 | tee "$log"
