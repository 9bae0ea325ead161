#!/usr/bin/env bash
# On the H200 after `source .gpu-kit/activate.sh && source tools/h200.sh`: issue 7's whole-model
# runs (fresh processes), written to $OUT (names use "-" for "+": the device tool refuses "+").
# `tools/h200_progressions.sh 4bit|bf16|schedules [repeats]`.
set -euo pipefail
REPEATS="${2:-4}"
OUT="${OUT:-/tmp/out}"
prog() { echo "== $(date +%T) $*"; python3 -m llm_eval.progression --device gpu --model qwen3-4b "$@"; }
case "${1:-4bit}" in
  4bit|bf16)
    q=$([ "$1" = 4bit ] && echo 4bit || echo none)
    tag=$([ "$1" = 4bit ] && echo 4b-4bit || echo 4b-bf16)
    for w in "32 97" "128 129"; do
      set -- $w
      prog --quantize "$q" --input-len "$1" --output-len "$2" --repeats "$REPEATS" \
        --json-output "$OUT/h200-qwen3-$tag-progression-$1-$2-mlx-0.32.4.json"
    done
    ;;
  schedules)  # decode-attention per kernel schedule, at two context lengths
    for w in "32 97" "1024 65"; do
      set -- $w
      for s in split-mma split-gqa split chapter-8 chapter-16 chapter-32; do
        prog --quantize 4bit --variant decode-attention --schedule "$s" --input-len "$1" \
          --output-len "$2" --repeats 2 \
          --json-output "$OUT/h200-qwen3-4b-4bit-schedule-$s-$1-$2-mlx-0.32.4.json"
      done
    done
    ;;
esac
echo "== $(date +%T) done"
