#!/usr/bin/env bash
# On the H200 host (device tool), from the repository root after `source .gpu-kit/activate.sh`,
# with `.whl` carried: the 16-core CPU records as a CPU user would get them, through the CPU-only
# MLX wheel (mlx + mlx-cpu 0.32.4, what `pip install mlx[cpu]` gives on Linux) instead of the
# kit's CUDA build, whose CPU-stream eval pays a CUDA event per mx.eval (docs/cpu-kernel.md,
# "The 16-core host"). About 1-2 minutes after the wheels are unpacked (1-3 are
# tools/cpu_only_mlx_setup.sh, shared with tools/h200_cpu16_sweep.sh):
#   1. unpack .whl/mlx-0.32.4-cp312-*.whl and .whl/mlx_cpu-0.32.4-*.whl into /tmp/cpu-site,
#   2. build attn-kernels with ATTN_KERNELS_CUDA=OFF against that MLX into /tmp/ext-cpu (its own
#      build folder; nanobind is the one the caller's Python has, i.e. the kit's),
#   3. check that the CUDA MLX is nowhere in the process (mlx.core, libmlx, no CUDA library, the
#      default device cpu, mlx-cpu installed) and that the op matches the readable oracle,
#   4. tools/cpu_eval_overhead.py (MLX's own per-eval cost: `add x1`, as h200_cpu_overhead.sh),
#   5. bench-operators --device cpu, 1 call per eval, avx512 then avx2 (ATTN_KERNELS_CPU_PATH),
#      the flags of tools/h200_cpu.sh, the floor measured in the run.
# Writes 5 files under $OUT: cpu-only-mlx-log.txt, cpu-only-mlx-build.log,
# h200-host-cpu-eval-overhead-cpu-only-mlx-0.32.4.json and
# h200-host-cpu-qwen3-4b-attention-L1-{avx512,avx2}-cpu-only-mlx-0.32.4.json.
#   LLM_EVAL_GIT_SHA=<sha> bash tools/h200_cpu_only_mlx.sh
# CONTEXTS (default "1024 4096 16384 65536") and ROUNDS (16) are there for a short local trial;
# CPU_SITE, EXT_DIR, BUILD_DIR (defaults under /tmp) move the folders.
set -euo pipefail
OUT="${OUT:-/tmp/out}"
CONTEXTS="${CONTEXTS:-1024 4096 16384 65536}"
ROUNDS="${ROUNDS:-16}"
TAG=cpu-only-mlx-0.32.4
LOG="$OUT/cpu-only-mlx-log.txt"
BUILD_LOG="$OUT/cpu-only-mlx-build.log"
R="$OUT/h200-host-cpu-qwen3-4b-attention-L1"
drop() { grep -v -E "$1" || true; }  # progress lines; never fails the pipeline
mkdir -p "$OUT" && : > "$LOG"
source tools/cpu_only_mlx_setup.sh  # steps 1-3

{
  contexts=()
  for s in $CONTEXTS; do contexts+=(--context "$s"); done
  say "per-eval costs through the CPU-only MLX (tools/cpu_eval_overhead.py)"
  overhead_contexts=()
  for s in $CONTEXTS; do
    if [ "$s" -le 16384 ]; then overhead_contexts+=(--context "$s"); fi
  done
  python3 tools/cpu_eval_overhead.py --rounds "$ROUNDS" --path avx512 "${overhead_contexts[@]}" \
    --spin-us 0 --spin-us 50 --spin-us 200 --prewake-us 0 --prewake-us 300 \
    --json-output "$OUT/h200-host-cpu-eval-overhead-$TAG.json" 2>&1 | drop "^round"
  for path in avx512 avx2; do
    say "bench-operators $path, 1 call per eval, S = $CONTEXTS"
    ATTN_KERNELS_CPU_PATH=$path python3 -m llm_eval.operators --device cpu \
      --implementations custom --iterations 10 --calls-per-eval 1 "${contexts[@]}" \
      --context-repeats 3 --json-output "$R-$path-$TAG.json" 2>&1 | drop "^\["
  done
  say "done; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
} 2>&1 | tee -a "$LOG"
