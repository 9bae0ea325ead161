#!/usr/bin/env bash
# On the H200 (device tool), after `source .gpu-kit/activate.sh`: build attn-kernels against the
# kit's CUDA MLX and put the packages on PYTHONPATH; source it, then run the GPU tests
# (`python3 -m pytest packages/attn-kernels/tests -k gpu`) or a measurement; tools/gpu.sh sources it.
#   source tools/h200.sh        build log under $OUT (or /tmp/out)
set -euo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export CUDAARCHS="${CUDAARCHS:-90}"  # the H200 (CMake reads it for CMAKE_CUDA_ARCHITECTURES)
if [ -z "${REUSE_EXT:-}" ] || [ ! -d /tmp/ext ]; then  # REUSE_EXT=1: keep a warm machine's build
  rm -rf /tmp/ext
  python3 -m pip install -q --no-build-isolation --no-deps --no-index -t /tmp/ext packages/attn-kernels \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
export PYTHONPATH="/tmp/ext:$PWD/packages/llm-eval/src:$PWD/packages/qwen3-model/src:${PYTHONPATH:-}"
python3 -c "import attn_kernels, mlx.core as mx; print('attn_kernels on', mx.default_device())"
