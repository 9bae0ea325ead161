#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`): issue 21's records in one call.
# Builds (tools/h200.sh), then mlx-lm-decode: mlx-lm's stream_generate with and without
# attn_kernels.mlx_lm, random weights, 4-bit, Qwen3-4B then a Llama-3-8B-shaped config, 32+97 and
# 8192+65, $ROUNDS (default 6) rotated rounds, all in one process. Writes under $OUT, each record
# as it finishes: h200-<model>-4bit-mlx-lm-decode-<prompt>-<generated>-mlx-0.32.4.json (names
# without "+", which the device tool refuses: rename when committing) and log.txt.
# If a request hangs, Python's stacks go to log.txt after $WATCHDOG_S seconds (default 240).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
source tools/h200.sh
set +e
export PYTHONUNBUFFERED=1
python3 - --model qwen3-4b --model llama-3-8b --quantize 4bit --workload 32+97 \
  --workload 8192+65 --rounds "${ROUNDS:-6}" \
  --json-output "$OUT/h200-{model}-4bit-mlx-lm-decode-{workload}-mlx-0.32.4.json" \
  2>&1 <<PY | grep --line-buffered -v '^\[#' | tee "$OUT/log.txt"
import faulthandler, sys
faulthandler.dump_traceback_later(${WATCHDOG_S:-240}, exit=False)
from llm_eval.mlx_lm_decode import main
main(sys.argv[1:])
PY
