#!/usr/bin/env bash
# On the H200 host (device tool), after `source .gpu-kit/activate.sh && source tools/h200.sh` (the
# extension built; ATTN_KERNELS_CUDA=OFF is enough): where a CPU call's time goes through MLX on
# the 16-core host, in one call of about 2-3 minutes that writes 5 files under $OUT:
#   cpu-overhead-log.txt   the CPU, the pool's hand-off (kernel alone, workers sleeping at once vs
#                          polling first), every table printed below
#   h200-host-cpu-eval-overhead-$TAG-mlx-0.32.4.json   tools/cpu_eval_overhead.py: MLX's own
#                          per-eval cost (a stream round trip, one and 8 `x + 1` per eval) and
#                          our op at S = 1024, 4096, 16384 with 1 and 8 calls per eval, the pool's
#                          worker spin 0 (the previous pool), 50 (the default) and 200 µs, each
#                          without and with a 300 µs prewake (ATTN_KERNELS_POOL_PREWAKE_US), avx512
#   h200-host-cpu-qwen3-4b-attention-L1-{avx512,avx2}-$TAG-mlx-0.32.4.json   bench-operators,
#                          1 call per eval (as the records before), S = 1024 .. 65536
#   h200-host-cpu-qwen3-4b-attention-L1-avx512-8-calls-per-eval-$TAG-mlx-0.32.4.json
# TAG (default run2) keeps these records apart from the earlier ones. Set LLM_EVAL_GIT_SHA.
set -euo pipefail
OUT="${OUT:-/tmp/out}"
TAG="${TAG:-run2}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/cpu-overhead-log.txt"
R="$OUT/h200-host-cpu-qwen3-4b-attention-L1"
drop() { grep -v -E "$1" || true; }  # progress lines; never fails the pipeline
{
  echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none);" \
    "load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown); $(uname -r)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|L3"
  python3 -c "import attn_kernels._ext as e; print('paths', e.cpu_paths(), 'threads', e.cpu_threads())"
  echo "== the pool's hand-off, kernel alone (make bench-cpu-kernel ARGS=handoff)"
  make -j8 bench-cpu-kernel ARGS=handoff 2>&1 | drop "^(/|g\+\+|c\+\+|build/)"
  echo "== per-eval costs through MLX (tools/cpu_eval_overhead.py)"
  python3 tools/cpu_eval_overhead.py --rounds 16 --path avx512 \
    --spin-us 0 --spin-us 50 --spin-us 200 --prewake-us 0 --prewake-us 300 \
    --json-output "$OUT/h200-host-cpu-eval-overhead-$TAG-mlx-0.32.4.json" 2>&1 | drop "^round"
  for run in avx512:1 avx2:1 avx512:8; do
    path=${run%:*} calls=${run#*:}
    name="$R-$path-$TAG-mlx-0.32.4.json"
    [ "$calls" = 1 ] || name="$R-$path-$calls-calls-per-eval-$TAG-mlx-0.32.4.json"
    echo "== bench-operators $path, $calls call(s) per eval"
    ATTN_KERNELS_CPU_PATH=$path python3 -m llm_eval.operators --device cpu \
      --implementations custom --iterations 10 --calls-per-eval "$calls" \
      --context 1024 --context 4096 --context 16384 --context 65536 --context-repeats 3 \
      --json-output "$name" 2>&1 | drop "^\["
  done
  echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
} 2>&1 | tee "$LOG"
