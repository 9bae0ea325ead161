#!/usr/bin/env bash
# On the H200 after `source .gpu-kit/activate.sh && source tools/h200.sh`: what issue 19 still
# needs (docs/host-cost.md), written under $OUT as each step finishes. Set LLM_EVAL_GIT_SHA.
#   bash tools/h200_fresh_inputs.sh [tests|fresh|host|kernels|model|all]      (default all)
# Every step's printed output goes to stdout and $OUT/log.txt; records (7 files in all):
#   tests    the GPU cases of the three test changes never re-run on a GPU
#            (float32 TF32 tolerance in test_non_finite_inputs_match_readable_path, S=60 for
#            float32 in test_output_fully_written, test_no_worse_than_mlx_lm's agreement check
#            now CPU-only) and of test_output_over_a_donated_query (new)               ~25 s
#   fresh    bench-operators --fresh-inputs, custom against mx.fast, one call per mx.eval on
#            K/V neither has seen: S = 1, 128, 1024, 4096 with 1200 samples each, then
#            16384, 32768, 131072 with 160 (their copies take 0.5 GB each at 131072)    ~30 s
#            h200-qwen3-4b-attention-fresh-inputs-{short,long}-mlx-0.32.4.json, and
#            tools/fresh_inputs_pairs.py on both (medians after a call of the same op / of the
#            other: the kernel-switch cost MLX's graph cache adds, docs/host-cost.md)
#   host     tools/host_cost.py: build / dispatch / eval per call, S = 1, 128, 1024   ~10 s
#            h200-host-cost-mlx-0.32.4.json
#   kernels  ncu kernel durations, ours (auto) against mx.fast's sdpav, S = 1 and 128, 8 calls
#            each (skipped where ncu is missing)                                    ~20 s
#            ncu-kernels.csv
#   model    ab-decode bf16 32+97 and 8192+65: decode-attention-unfused (DecodeAttention per
#            layer: the path gpu_ptr and the donated query changed), decode-attention (fused
#            step) and mlx-lm, rotated rounds                                         ~45 s
#            ab-none-32-97.json, ab-none-8192-65.json; commit them as
#            h200-qwen3-4b-none-ab-decode-unfused-{32+97,8192+65}-mlx-0.32.4.json (the names
#            docs/results-h200.md cites; the device tool refuses "+")
#   suite    (not in all) every GPU case of test_decode_attention.py and the model's CUDA
#            parity with mlx-lm, which the donated query touches too            ~60-90 s
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -c "import attn_kernels, llm_eval" 2>/dev/null || source tools/h200.sh
set +e  # a failing test must not skip the records
export PYTHONUNBUFFERED=1
what="${1:-all}"
run() { [ "$what" = "$1" ] || { [ "$what" = all ] && [ "$1" != suite ]; }; }
ops() { python3 -m llm_eval.operators --device gpu "$@" 2>&1 | grep -v '^\[#'; }

steps() {
  if run tests; then
    python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_decode_attention.py \
      packages/attn-kernels/tests/test_quantized.py -k "gpu and (test_output_fully_written or \
  test_non_finite_inputs_match_readable_path or test_no_worse_than_mlx_lm or \
  test_output_over_a_donated_query)" 2>&1 | tail -40
  fi
  if run fresh; then
    ops --fresh-inputs --implementations custom,mlx --context 1 --context 128 --context 1024 \
      --context 4096 --iterations 300 --context-repeats 4 \
      --json-output "$OUT/h200-qwen3-4b-attention-fresh-inputs-short-mlx-0.32.4.json"
    ops --fresh-inputs --implementations custom,mlx --context 16384 --context 32768 \
      --context 131072 --iterations 40 --context-repeats 4 \
      --json-output "$OUT/h200-qwen3-4b-attention-fresh-inputs-long-mlx-0.32.4.json"
    for part in short long; do
      python3 tools/fresh_inputs_pairs.py \
        "$OUT/h200-qwen3-4b-attention-fresh-inputs-$part-mlx-0.32.4.json"
    done
  fi
  if run host; then
    python3 tools/host_cost.py --context 1 --context 128 --context 1024 --rounds 120 \
      $(git cat-file -e 80265b6 2>/dev/null && echo --old-wrapper 80265b6) \
      --json "$OUT/h200-host-cost-mlx-0.32.4.json"
  fi
  if run model; then
    for workload in 32+97 8192+65; do
      python3 -m llm_eval.ab_decode --quantize none --input-len "${workload%+*}" \
        --output-len "${workload#*+}" --rounds "${ROUNDS:-5}" \
        --variants decode-attention-unfused,decode-attention,mlx-lm \
        --json-output "$OUT/ab-none-${workload/+/-}.json" 2>&1 | grep -v '^\[#' | tail -8
    done
  fi
  if run kernels; then
    if command -v ncu > /dev/null; then
      ncu --clock-control none -k 'regex:attend|sdpav' --metrics gpu__time_duration.sum --csv \
        python3 tools/gpu_profile_case.py auto,mx.fast 1,128 1 8 > "$OUT/ncu-kernels.csv" 2>&1
      grep -c sdpav "$OUT/ncu-kernels.csv"
    else
      echo "ncu not found: kernels step skipped" | tee "$OUT/ncu-kernels.csv"
    fi
  fi
  if run suite; then
    python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_decode_attention.py \
      packages/qwen3-model/tests/test_model.py -k "gpu or cuda" 2>&1 | tail -40
  fi
  echo "done $(date -u +%H:%M:%S)"
}
steps 2>&1 | tee -a "$OUT/log.txt"
