#!/usr/bin/env bash
# On the H200 (device tool, after `source .gpu-kit/activate.sh`): the fused attention step's GPU
# tests, mlx-lm parity on CUDA, then tools/step_bench.py records and kernel counts.
#   bash tools/h200_step.sh [tests|bench|count|all]     outputs under $OUT
set -uo pipefail
OUT="${OUT:-/tmp/out}"
what="${1:-all}"
source tools/h200.sh || exit 1
export PYTHONUNBUFFERED=1
tag="$(date -u +%H%M%S)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_attention_step.py -k gpu \
    2>&1 | tail -15 | tee "$OUT/step-tests-gpu.txt"
  python3 -m pytest -q -p no:cacheprovider packages/qwen3-model/tests/test_model.py -k cuda \
    2>&1 | tail -8 | tee "$OUT/parity-cuda.txt"
fi
if [ "$what" = count ] || [ "$what" = all ]; then
  for q in none 4bit; do
    python3 tools/step_bench.py --count-kernels "/tmp/graphs-$q" --quantize "$q" \
      --workloads 1024+9 --count-steps 2 --json-output "$OUT/kernels-$q.json" \
      2>&1 | tee "$OUT/kernels-$q.txt"
  done
  f=$(ls /tmp/graphs-none/steps/*/graph_*.dot | head -1)
  head -c 3000 "$f" > "$OUT/sample-graph.txt"
  tar czf "$OUT/graphs.tgz" -C /tmp graphs-none/steps graphs-4bit/steps 2>/dev/null
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for q in none 4bit; do
    python3 tools/step_bench.py --quantize "$q" --workloads 32+97 1024+65 8192+65 \
      --rounds "${ROUNDS:-2}" --anatomy-steps 8 --json-output "$OUT/step-bench-$q.json" \
      2>&1 | grep -v Warning | tee "$OUT/step-bench-$q.txt"
  done
fi
echo "done $tag"
