#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`): the fused step inside mlx-lm's
# Qwen3 (attn_kernels.mlx_lm.enable(), whose default is the fused step; docs/mlx-lm.md) in one
# call. Builds (tools/h200.sh), then the host time per attention call of the three variants
# (tools/mlx_lm_step_host_cost.py: $OUT/h200-qwen3-4b-mlx-lm-step-host-cost.json), then
# tools/h200_mlx_lm.sh with --attention-only: stream_generate without the kernel, with enable()
# and with enable(fused_step=False), Qwen3-4B 4-bit, 32+97 and 8192+65, $ROUNDS (default 4)
# rotated rounds in one process ($OUT/log.txt, $OUT/records.tar). For Llama-3-8B as well:
# tools/h200_mlx_lm_llama_step.sh.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
(
  source tools/h200.sh &&
    python3 tools/mlx_lm_step_host_cost.py --json "$OUT/h200-qwen3-4b-mlx-lm-step-host-cost.json"
) 2>&1 | tee -a "$OUT/log.txt"
REUSE_EXT=1 tools/h200_mlx_lm.sh --model qwen3-4b --quantize 4bit --workload 32+97 \
  --workload 8192+65 --rounds "${ROUNDS:-4}" --attention-only
