#!/usr/bin/env bash
# The device runs, named after what they measure. On the H200 (the device tool), from the
# repository root:
#
#   source .gpu-kit/activate.sh && bash tools/gpu.sh TARGET [TARGET ...]
#
# Builds attn-kernels against the kit's CUDA MLX once per machine (tools/h200.sh; REUSE_EXT=1
# keeps a warm machine's build), then runs each target, writing under $OUT (the device tool
# returns at most 8 files, no "+" in their names):
#   tests    every package's GPU cases (attn-kernels: -k gpu, every schedule), gpu-tests.txt
#   ragged   bench-operators: a decode step of B rows, each of its own length (--ragged: the
#            fused op reads each row's range, mx.fast takes the mask), and the same B rows all
#            full (no ranges, no mask), B = 8 and 32, S = 512 / 2048 / 8192, L = 1 causal
#   serve    bench-serve: Qwen3-4B 4-bit, 32 requests of 256-2048 prompt tokens + 64 each,
#            slots 8 and 32: mlx-lm's BatchGenerator, with enable(), and ours; then what a
#            decode step of ours is made of at each (--anatomy)
#   cpu-host the 16-core host's CPU through the kit's MLX (its CPU backend): bench-linear on
#            Qwen3-4B's projections (decode_linear against MLX's matmuls, bf16 / 4-bit / 8-bit,
#            one row), then bench --device cpu, Qwen3-4B 4-bit, ours alone (mlx-lm's CPU path
#            decodes 4-bit at ~0.1 GB/s: its per-layer ratio is in the bench-linear record)
# Set LLM_EVAL_GIT_SHA (and LLM_EVAL_GIT_DIRTY) to the workstation's: the device's copy of the
# tree carries a stale .git. ROUNDS (default 2) sets bench-serve's rounds.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
source tools/h200.sh
set +e  # h200.sh sets -e: one target's failure must not skip the others
export PYTHONUNBUFFERED=1

tests() {
  python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests -k gpu 2>&1 |
    tail -40 > "$OUT/gpu-tests.txt"
  for p in qwen3-model llm-eval; do
    python3 -m pytest -q -p no:cacheprovider "packages/$p/tests" -k gpu 2>&1 | tail -5 \
      >> "$OUT/gpu-tests.txt"
  done
  tail -3 "$OUT/gpu-tests.txt"
}

ragged() {
  local common=(--attention-mask causal --context 512 --context 2048 --context 8192
    --implementations custom,mlx --context-repeats 2 --iterations 4)
  for b in 8 32; do
    python3 -m llm_eval.operators "${common[@]}" --batch "$b" --ragged \
      --json-output "$OUT/h200-qwen3-4b-attention-B$b-ragged.json" 2>&1 | grep -v '^\[#'
    python3 -m llm_eval.operators "${common[@]}" --batch "$b" \
      --json-output "$OUT/h200-qwen3-4b-attention-B$b-full.json" 2>&1 | grep -v '^\[#'
  done
}

serve() {
  python3 -m llm_eval.serve --model qwen3-4b --quantize 4bit --requests 32 --prompt-min 256 \
    --prompt-max 2048 --new-tokens 64 --slots 8 --slots 32 --rounds "${ROUNDS:-2}" --anatomy \
    --output "$OUT/h200-qwen3-4b-4bit-serve.json" 2>&1 | grep -v '^\[#'
}

cpu_host() {
  python3 -m llm_eval.linear --model qwen3-4b --format bf16 --format q4 --format q8 --rows 1 \
    --iterations 2 --output "$OUT/h200-host-qwen3-4b-linear.json" 2>&1 | grep -v '^\['
  python3 -m llm_eval.bench --device cpu --model qwen3-4b --quantize 4bit --input-len 8 \
    --output-len 17 --rounds 3 --variant decode-attention \
    --output "$OUT/h200-host-qwen3-4b-4bit-bench.json" 2>&1 | grep -v '^\['
}

for target in "$@"; do
  case "$target" in
    tests | ragged | serve) echo "== $target"; "$target" ;;
    cpu-host) echo "== $target"; cpu_host ;;
    *) echo "tools/gpu.sh: unknown target $target (tests, ragged, serve, cpu-host)" >&2 ;;
  esac
done
