#!/usr/bin/env bash
# On the H200 after `source .gpu-kit/activate.sh && source tools/h200.sh`: the operator records
# of issues 5 and 7 (Qwen3-4B shapes), written to $OUT.
#   tools/h200_operators.sh kernels|grid|short|long
set -euo pipefail
OUT="${OUT:-/tmp/out}"
ops() { python3 -m llm_eval.operators --device gpu "$@"; }
case "${1:-kernels}" in
  kernels)  # every schedule over the context, L=1; then L=2/4/8 causal
    ops --context 1 --context 32 --context 128 --context 256 --context 1024 --context 4096 \
      --context 16384 --context 32768 --context 131072 --schedule auto --schedule split-gqa \
      --schedule split --schedule chapter-8 --schedule chapter-16 --schedule chapter-32 \
      --implementations readable,mlx --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-L1-mlx-0.32.4.json"
    ops --query-length 2 --query-length 4 --query-length 8 --attention-mask causal \
      --context 32 --context 128 --context 256 --context 1024 --context 4096 --context 16384 \
      --context 32768 --context 131072 --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-L2-L8-causal-mlx-0.32.4.json"
    ;;
  grid)  # the chapter's grid and sweeps (issue 7)
    ops --context 1 --context 31 --context 32 --context 127 --context 128 --context 129 \
      --context 255 --context 256 --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-grid-L1-mlx-0.32.4.json"
    ops --query-length 8 --attention-mask causal --context 8 --context 31 --context 32 \
      --context 127 --context 128 --context 129 --context 255 --context 256 --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-grid-L8-causal-mlx-0.32.4.json"
    ops --context 32 --context 128 --context 160 --context 192 --context 256 --context-repeats 6 \
      --json-output "$OUT/h200-qwen3-4b-attention-context-sweep-mlx-0.32.4.json"
    ops --context 128 --query-length 1 --query-length 2 --query-length 4 --query-length 8 \
      --attention-mask causal --context-repeats 6 \
      --json-output "$OUT/h200-qwen3-4b-attention-query-sweep-mlx-0.32.4.json"
    ops --gqa-ratio 1 --context 128 --context 1024 --context 4096 --context 16384 --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-gqa1-mlx-0.32.4.json"
    ops --attention-mask explicit --query-length 1 --query-length 2 --context 128 --context 1024 \
      --context 4096 --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-explicit-mask-mlx-0.32.4.json"
    ;;
  short)  # L=1 up to S=4096, schedules side by side: independent calls, then chained (latency)
    for mode in independent chained; do
      ops --context 1 --context 32 --context 64 --context 128 --context 192 --context 256 \
        --context 512 --context 1024 --context 4096 --schedule auto --schedule split-mma \
        --schedule chapter-16 --schedule split --implementations mlx --context-repeats 2 \
        $([ $mode = chained ] && echo --chain) \
        --json-output "$OUT/h200-qwen3-4b-attention-L1-short-$mode-mlx-0.32.4.json"
    done
    ops --query-length 2 --query-length 8 --attention-mask causal --context 32 --context 256 \
      --context 1024 --context 4096 --implementations custom,mlx --context-repeats 2 \
      --json-output "$OUT/h200-qwen3-4b-attention-L2-L8-short-mlx-0.32.4.json"
    ;;
  long)  # chained calls from S=4096 on: one call at a time reads K/V from HBM, where independent
    # calls at long contexts run side by side and share K/V through L2 (past 100% of the floor)
    ops --context 4096 --context 16384 --context 32768 --context 131072 --schedule auto \
      --implementations mlx --context-repeats 2 --chain \
      --json-output "$OUT/h200-qwen3-4b-attention-L1-long-chained-mlx-0.32.4.json"
    ops --query-length 2 --query-length 4 --query-length 8 --attention-mask causal \
      --context 4096 --context 16384 --context 32768 --context 131072 \
      --implementations custom,mlx --context-repeats 2 --chain \
      --json-output "$OUT/h200-qwen3-4b-attention-L2-L8-long-chained-mlx-0.32.4.json"
    ;;
esac
