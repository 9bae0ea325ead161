#!/usr/bin/env bash
# This CPU's operator records (Qwen3-4B shapes), written to benchmark_results/ (--force: replaces
# them). `tools/cpu_operators.sh` from the repository root; a few minutes on 2 cores.
set -euo pipefail
R=benchmark_results/cpu-2core-qwen3-4b-attention
ops() { uv run --package llm-eval bench-operators --device cpu --force "$@"; }
ops --context 32 --context 128 --context 256 --context 1024 --context 4096 --context 16384 \
  --context-repeats 4 --json-output "$R-L1-mlx-0.32.4.json"
# A decode step evaluates every layer in one mx.eval: 8 calls per eval leave out most of the
# per-eval hand-offs (16-119 µs on this VM, mostly vCPU wake-ups: tools/cpu_eval_overhead.py),
# which the record above pays on every call.
ops --context 256 --context 1024 --context 4096 --context 16384 --calls-per-eval 8 \
  --context-repeats 2 --json-output "$R-L1-8-calls-per-eval-mlx-0.32.4.json"
ops --query-length 2 --query-length 4 --query-length 8 --attention-mask causal --context 32 \
  --context 128 --context 256 --context 1024 --context 4096 --context 16384 --context-repeats 2 \
  --json-output "$R-L2-L8-causal-mlx-0.32.4.json"
ops --context 32 --context 128 --context 160 --context 192 --context 256 --context-repeats 6 \
  --json-output "$R-context-sweep-mlx-0.32.4.json"
ops --context 128 --query-length 1 --query-length 2 --query-length 4 --query-length 8 \
  --attention-mask causal --context-repeats 6 --json-output "$R-query-sweep-mlx-0.32.4.json"
ops --gqa-ratio 1 --context 128 --context 1024 --context-repeats 2 --json-output "$R-gqa1-mlx-0.32.4.json"
ops --attention-mask explicit --context 128 --context 1024 --context-repeats 2 \
  --json-output "$R-explicit-mask-mlx-0.32.4.json"
uv run --package llm-eval plot "$R"-*.json
