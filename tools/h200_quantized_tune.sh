#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh` and `source tools/h200.sh`: the
# transposed-score variants of the quantized-KV kernel (mmat, mmat3, mmat4;
# kernels-cuda/decode_attention_quantized_mmat.cuh, docs/quantized-kv.md) against mmacp, the
# default, within BUDGET seconds (150), through tools/h200_quantized_variants.sh:
#   1. tools/gpu_quantized_sanity.py under each new variant (largest error against the readable
#      path, ATTN_QUANTIZED_LOG=1 naming the kernel, grid and shared memory each shape ran);
#   2. tools/quantized_variants.py --baseline (Qwen3-4B shapes, L = 1, group 64, bits 8 and 4,
#      S 4096/32768/131072, mx.fast on the bf16 K/V in alternation) for mmacp, mmat4, mmat3,
#      mmat, mmacp, one process each (the second mmacp shows drift).
#   bash tools/h200_quantized_tune.sh     2 files under $OUT: quantized-variants-sanity.txt,
#                                         quantized-variants.txt
BUDGET="${BUDGET:-150}" SANITY="mmat mmat3 mmat4" VARIANTS="mmacp mmat4 mmat3 mmat mmacp" \
  NCU=0 TESTS=0 exec bash "$(dirname "$0")/h200_quantized_variants.sh"
