#!/usr/bin/env bash
# On the H200 host (device tool, after `source .gpu-kit/activate.sh`): the CPU kernel's many-core
# records. Builds attn-kernels without its CUDA kernels (ATTN_KERNELS_CUDA=OFF: the CPU kernel is
# all this needs, and the build takes seconds), then
#   1. the kernel alone, every path, interleaved; the pool's hand-off (make bench-cpu-kernel),
#   2. bench-operators --device cpu through MLX's CPU backend, once per x86 path (avx512, then
#      avx2 by ATTN_KERNELS_CPU_PATH), the floor measured in the run.
# Everything lands in $OUT; about 2-3 minutes.
set -euo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export ATTN_KERNELS_CUDA=OFF PYTHONUNBUFFERED=1
source tools/h200.sh
{
  echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3"
  grep -o -w -E "avx512f|avx512bw|avx512_bf16|avx2|fma|f16c" /proc/cpuinfo | sort | uniq -c
  python3 -c "import attn_kernels._ext as e; print('paths', e.cpu_paths(), 'threads', e.cpu_threads())"
} | tee "$OUT/cpu.txt"
make bench-cpu-kernel 2>&1 | tee "$OUT/bench_cpu.txt"
R="$OUT/h200-host-cpu-qwen3-4b-attention-L1"
for path in avx512 avx2; do
  ATTN_KERNELS_CPU_PATH=$path python3 -m llm_eval.operators --device cpu --implementations custom \
    --iterations 10 \
    --context 1024 --context 4096 --context 16384 --context 65536 --context-repeats 3 \
    --json-output "$R-$path-mlx-0.32.4.json" | tail -8
done
