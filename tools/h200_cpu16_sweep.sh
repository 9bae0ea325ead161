#!/usr/bin/env bash
# On the H200 host (device tool), from the repository root after `source .gpu-kit/activate.sh`,
# with `.whl` carried: the 16-core CPU kernel through the CPU-only MLX wheel (issue 23's targets:
# >= 50% of the read floor from S = 4096, >= 70% from 16384), and a sweep of how a call is split
# over the cores. One device call of at most ~150 s (docs/cpu-kernel.md, "Splitting a call over
# 16 cores"):
#   1-3. tools/cpu_only_mlx_setup.sh: unpack the wheels, build the extension against them into
#        /tmp/ext-cpu (~1-2 min on 16 cores), check that only the CPU-only MLX is in the process;
#   4. bench-operators --device cpu, the defaults, 1 call per eval, avx512 then avx2, S = 4096,
#      16384, 65536 (K/V reused, as every earlier record), the floor measured in the run;
#   5. tools/cpu_eval_overhead.py, avx512, 1 call per eval, S = 4096 and 16384, every case
#      interleaved: ATTN_KERNELS_CALL_THREADS 4 / 8 / 12 / all (16) x
#      ATTN_KERNELS_CPU_UNITS_PER_THREAD 1 / 2 / 4 / 8 (the default) / 16, each with K/V hot
#      (one set reused, as bench-operators) and cold (copies rotated over 768 MiB, past the
#      300 MiB L3: what a decode step's layers read); rounds until the script's time is up
#      (--max-seconds, from what steps 1-4 left of SWEEP_BUDGET, default 140 s).
# Writes 4 files under $OUT: cpu16-sweep-log.txt (the compiler's output stays in /tmp),
# h200-host-cpu-qwen3-4b-attention-L1-{avx512,avx2}-cpu16-cpu-only-mlx-0.32.4.json and
# h200-host-cpu16-split-sweep-cpu-only-mlx-0.32.4.json.
#   LLM_EVAL_GIT_SHA=<sha> bash tools/h200_cpu16_sweep.sh
# CONTEXTS ("4096 16384 65536"), SWEEP_CONTEXTS ("4096 16384"), SWEEP_BUDGET (140) and COLD_MIB
# (768) are there for a short local trial; CPU_SITE, EXT_DIR, BUILD_DIR as in the setup.
set -euo pipefail
OUT="${OUT:-/tmp/out}"
CONTEXTS="${CONTEXTS:-4096 16384 65536}"
SWEEP_CONTEXTS="${SWEEP_CONTEXTS:-4096 16384}"
SWEEP_BUDGET="${SWEEP_BUDGET:-140}"
COLD_MIB="${COLD_MIB:-768}"
TAG=cpu16-cpu-only-mlx-0.32.4
LOG="$OUT/cpu16-sweep-log.txt"
BUILD_LOG="${BUILD_LOG:-/tmp/cpu16-sweep-build.log}"
R="$OUT/h200-host-cpu-qwen3-4b-attention-L1"
drop() { grep -v -E "$1" || true; }  # progress lines; never fails the pipeline
mkdir -p "$OUT" && : > "$LOG"
source tools/cpu_only_mlx_setup.sh  # steps 1-3

{
  lscpu | grep -i -E "numa|socket" || true
  contexts=()
  for s in $CONTEXTS; do contexts+=(--context "$s"); done
  for path in avx512 avx2; do
    say "bench-operators $path, defaults, 1 call per eval, S = $CONTEXTS"
    ATTN_KERNELS_CPU_PATH=$path python3 -m llm_eval.operators --device cpu \
      --implementations custom --iterations 10 --calls-per-eval 1 "${contexts[@]}" \
      --context-repeats 3 --json-output "$R-$path-$TAG.json" 2>&1 | drop "^\["
  done
  sweep=()
  for s in $SWEEP_CONTEXTS; do sweep+=(--context "$s"); done
  pool="$(python3 -c 'from attn_kernels import _ext; print(_ext.cpu_threads())')"
  for t in 4 8 12; do
    if [ "$t" -lt "$pool" ]; then sweep+=(--call-threads "$t"); fi  # a short trial's smaller pool
  done
  sweep+=(--call-threads default)
  for u in 1 2 4 default 16; do sweep+=(--units-per-thread "$u"); done
  # What is left of the budget, less ~10 s for the import, the cold copies and the last read rate.
  seconds=$((SWEEP_BUDGET - SECONDS - 10))
  seconds=$((seconds < 5 ? 5 : seconds))
  say "split sweep, avx512, 1 call per eval, hot and cold K/V, ${seconds} s of rounds"
  python3 tools/cpu_eval_overhead.py --path avx512 --calls 1 --spin-us default "${sweep[@]}" \
    --kv hot --kv cold --cold-mib "$COLD_MIB" --rounds 1000 --max-seconds "$seconds" \
    --json-output "$OUT/h200-host-cpu16-split-sweep-cpu-only-mlx-0.32.4.json" 2>&1 | drop "^round"
  say "done; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
} 2>&1 | tee -a "$LOG"
