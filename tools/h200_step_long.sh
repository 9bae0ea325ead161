#!/usr/bin/env bash
# On the H200 (device tool), after `source tools/h200.sh`: the long-context decode of the fused
# step (docs/fused-step.md, "Long contexts"). bf16 Qwen3-4B, 32768+65, 16384+65 and 1024+65,
# through mlx-lm's generate_step, 2 rotated rounds: decode-attention (owned caches), the same step
# under MLX's donation rule alone (the code of the 0.75x record), the step with the residual adds
# in the matmuls (decode-attention-addmm, an experiment), the unfused chain and mlx-lm; cache
# copies, the step anatomy and the slowest pipelined step per variant. Then the kernels per
# decode step (1024+9). About 150 s after the build (the record is rewritten after every
# workload, so a run cut short keeps what it finished); writes three files under $OUT:
#   step-long.txt (everything printed), step-long-bf16.json, kernels-bf16.json
#   bash tools/h200_step_long.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/step-long.txt"
{
  date -u
  timeout 170 python3 tools/step_bench.py --quantize none --workloads 32768+65 16384+65 1024+65 \
    --rounds 2 --anatomy-steps 8 --variants decode-attention decode-attention-mlx-rule \
    decode-attention-addmm decode-attention-unfused mlx-lm \
    --json-output "$OUT/step-long-bf16.json" 2>&1 | grep -v Warning
  echo "rc ${PIPESTATUS[0]}"
  date -u
  timeout 60 python3 tools/step_bench.py --count-kernels /tmp/graphs-long --quantize none \
    --workloads 1024+9 --count-steps 2 --variants decode-attention decode-attention-addmm mlx-lm \
    --json-output "$OUT/kernels-bf16.json" 2>&1 | grep -v Warning
  echo "rc ${PIPESTATUS[0]}"
  date -u
} 2>&1 | tee "$log"
