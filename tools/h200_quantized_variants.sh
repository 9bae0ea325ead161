#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh` and `source tools/h200.sh`: the
# CUDA quantized-KV kernel's variants side by side (issue 25), within BUDGET seconds (145):
#   1. correctness first: tools/gpu_quantized_sanity.py (largest error against the readable path)
#      under mmat4 and mmat, with ATTN_QUANTIZED_LOG=1 naming the kernel each shape really ran
#      (where mmat's layout requirements fail, 8x2 runs);
#   2. tools/quantized_variants.py --baseline (Qwen3-4B shapes, L = 1, group 64, bits 8 and 4,
#      S 4096/32768/131072, mx.fast on the bf16 K/V timed in alternation, ratio printed) for
#      mmat4 (the default), mmat, 8x2, then mmat4 again (drift shows), one process each (the
#      variant is read once per process);
#   3. Nsight Compute on one mmat4 call at S = 131072, 8 and 4 bits (duration, DRAM throughput,
#      registers, shared memory, occupancy);
#   4. the GPU tests of test_quantized.py under mmat, as far as the time allows.
# Every step has a time limit within what is left, so a call cut short returns what was written.
# SANITY and VARIANTS replace the lists of steps 1 and 2; NCU=0 and TESTS=0 skip steps 3 and 4.
#   bash tools/h200_quantized_variants.sh        outputs under $OUT (quantized-variants*.txt)
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET="${BUDGET:-145}"
# limited SECONDS CMD...: CMD with at most SECONDS, or what is left of the budget (skipped at 0).
limited() {
  local want=$1 left=$((BUDGET - SECONDS))
  shift
  if [ "$left" -le 0 ]; then echo "(skipped, out of time: $*)"; return 0; fi
  timeout "$((want < left ? want : left))" "$@"
}
for variant in ${SANITY:-mmat4 mmat}; do
  echo "== sanity $variant"
  ATTN_QUANTIZED_LOG=1 ATTN_QUANTIZED_VARIANT=$variant limited 60 \
    python3 tools/gpu_quantized_sanity.py
done 2>&1 | tee "$OUT/quantized-variants-sanity.txt"
for variant in ${VARIANTS:-mmat4 mmat 8x2 mmat4}; do
  ATTN_QUANTIZED_LOG=1 ATTN_QUANTIZED_VARIANT=$variant limited 25 \
    python3 tools/quantized_variants.py --baseline
done 2>&1 | tee "$OUT/quantized-variants.txt"
[ "${NCU:-1}" = 0 ] || for bits in 8 4; do
  ATTN_QUANTIZED_VARIANT=mmat4 limited 20 ncu --clock-control none -k regex:attend_quantized \
    --section SpeedOfLight --section LaunchStats --section Occupancy \
    python3 tools/gpu_profile_quantized.py $bits 131072 2>&1 |
    grep -E "attend_quantized|Duration|DRAM Throughput|Memory Throughput|Grid Size|Registers|Shared Memory|Achieved Occupancy|Block Limit|skipped" |
    sed "s/^/mmat4 $bits-bit: /"
done 2>&1 | tee "$OUT/quantized-variants-ncu.txt"
[ "${TESTS:-1}" = 0 ] || ATTN_QUANTIZED_VARIANT=mmat limited 60 python3 -m pytest -q -x \
  packages/attn-kernels/tests/test_quantized.py -k gpu 2>&1 | tail -15 |
  tee "$OUT/quantized-variants-tests.txt"
