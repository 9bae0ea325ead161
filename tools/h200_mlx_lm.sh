#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`): issue 21's records in one call.
# Builds (tools/h200.sh), then mlx-lm-decode: mlx-lm's stream_generate with and without
# attn_kernels.mlx_lm, random weights, 4-bit, Qwen3-4B then a Llama-3-8B-shaped config, 32+97 and
# 8192+65, $ROUNDS (default 6) rotated rounds, all in one process. Under $OUT: log.txt, and
# records.tar holding the records (their names carry "+", which the device tool refuses; the tar
# is rewritten after each record, so a call cut short keeps what finished).
# If a request hangs, Python's stacks go to log.txt after $WATCHDOG_S seconds (default 240).
# Arguments, when given, replace the default mlx-lm-decode arguments (--output stays), e.g.
# enable(fused_step=False) (the attention call alone) as a third variant:
#   tools/h200_mlx_lm.sh --model qwen3-4b --workload 32+97 --workload 8192+65 --rounds 4 --attention-only
set -uo pipefail
OUT="${OUT:-/tmp/out}"
source tools/h200.sh
set +e
export PYTHONUNBUFFERED=1
mkdir -p /tmp/records
if [ $# -eq 0 ]; then
  set -- --model qwen3-4b --model llama-3-8b --quantize 4bit --workload 32+97 \
    --workload 8192+65 --rounds "${ROUNDS:-6}"
fi
python3 - "$@" --output /tmp/records 2>&1 <<PY |
import faulthandler, sys
faulthandler.dump_traceback_later(${WATCHDOG_S:-240}, exit=False)
from llm_eval.mlx_lm_decode import main
main(sys.argv[1:])
PY
  while IFS= read -r line; do
    printf '%s\n' "$line" | tee -a "$OUT/log.txt"
    case "$line" in record*) tar -C /tmp/records -cf "$OUT/records.tar" . ;; esac
  done
