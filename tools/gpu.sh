#!/usr/bin/env bash
# The device runs, named after what they measure. On the H200 (the device tool), from the
# repository root:
#
#   source .gpu-kit/activate.sh && bash tools/gpu.sh TARGET[:PART] [TARGET ...]
#
# Builds attn-kernels against the kit's CUDA MLX once per machine (tools/h200.sh; REUSE_EXT=1
# keeps a warm machine's build), then runs each target. Records go to $OUT/records/ and leave as
# one archive, $OUT/records.tar, under the names benchmark_results/ gives them, each starting with
# the GPU it ran on (h200-, or h100- where the device tool lent an H100); the device tool returns
# at most 8 files, none with "+" in its name; logs stay beside it. Each target fits one device
# call (600 s) unless noted.
#   tests       every package's GPU cases (every schedule), four processes at once: gpu-tests-*.txt
#   operators   bench-operators, the records of docs/results-h200.md; PART picks one (two calls
#               for all): kernels (every schedule over S = 1..131072, L = 1; L = 2/4/8 causal),
#               grid (the chapter's grid, context/query sweeps, GQA 1, explicit masks, fresh
#               inputs), short (L = 1 to S = 4096, independent and chained calls), long (chained
#               calls from S = 4096: the honest bandwidth figure, independent calls share K/V in
#               L2); mma16 (not in all): split-mma against split-mma-16, GQA 4 and 8, L 2-8,
#               S 16384-131072
#   coverage    bench-coverage: ours against mx.fast over head dims 64-256, bf16/f16/f32, groups
#               1-8, L = 1/4/8, S = 32..131072 (8192: issue 40's D 96 target), chained calls, a
#               process per head dim (issue 40's sweep; the guard's CUDA shapes); PART names the
#               head dims, comma-separated (coverage:128,256), all five otherwise
#   ragged      bench-operators: a decode step of B rows, each of its own length (--ragged), and
#               the same B rows all full, B = 8 and 32, S = 512 / 2048 / 8192, L = 1 causal
#   model       whole-model decode, fresh processes (progression: Qwen3-4B bf16 and 4-bit at
#               32+97 and 128+129) and one process (ab-decode at 8192+65 and 32768+65)
#   step        the fused step: its GPU tests, bench-step (kernels per step; fused step, mlx-lm
#               and composition through generate_step, bf16 and 4-bit, 32+97 1024+65 8192+65),
#               bench-host-cost at both levels, mlx-lm-decode with and without enable()
#               (Qwen3-4B and a Llama-3-8B-shaped config, 4-bit, 32+97 and 8192+65)
#   quantized   the quantized-cache op (4 and 8 bits, independent and chained calls), its GPU
#               tests, bench-accuracy, and ab-decode with a 4-bit cache at 32768+65 against
#               mlx-lm's kv_bits=4; PART head-dims (alone, ~4 min after the build): the op at
#               head dims 64, 96 (group 32; also without GQA) and 256, chained, against mx.fast
#               on bf16 K/V and mlx-lm's quantized path, its GPU tests at those head dims
#   serve       bench-serve: Qwen3-4B 4-bit, 32 requests of 256-2048 prompt tokens + 64 each,
#               slots 8 and 32: mlx-lm's BatchGenerator, with enable(), and ours (--anatomy;
#               PART rates: without it, with enable(linear=False) (attention alone) and
#               ours on MLX's CUDA graph limits);
#               PART anatomy: the anatomy alone at 1, 8 and 32 rows under MLX's default CUDA
#               graphs, without them and with 1000 ops a graph (where a step's time goes);
#               PART trace (not in all): each kernel of two decode steps at 8 and 32 rows under
#               Nsight Compute (bench-serve --kernel-trace)
#   linear      the quantized linear kernel (kernels-cuda/linear_quantized.cuh): its GPU tests
#               (the quick tier: 291 s for both tiers on a fresh H100, MLX's first calls slow),
#               bench-linear --device gpu on Qwen3-4B's projections (4 and 8 bits, 1-32 rows,
#               groups 64 and 128: the serving model's) against mx.quantized_matmul, and the
#               row-tile A/B at 16 and 32 rows; PART bench: the two bench-linear records alone;
#               PART candidates (alone, ~1 min after the build): kernels-cuda/dev/
#               bench_linear.cu, the one-row candidates against the plan (bf16 4/8 bits, f16):
#               bench-linear-*.txt; PART one-row (alone, after `git revert fa75489` puts the
#               one-row kernel into the plan and the guard): its GPU tests, the candidates,
#               bench-host-cost --level mlx-lm-linear, mlx-lm-decode on Phi-3-mini and
#               Llama-3.2-1B (8192+65) and bench-linear at one row over issue 40's layer shapes;
#               if the default (SIMT) form fails its GPU tests, all of it with the tensor-core one
#   models      issue 40's shapes through mlx-lm's own generate with and without enable():
#               Llama-3.2-1B, Phi-3-mini, Gemma-3-4B, 4-bit, 8192+65; and Qwen3-4B decoding
#               speculatively (its own weights as the draft); PART one-graph: each also with a
#               decode step as one CUDA graph (--one-graph-a-step: twice the time, the A/B behind
#               enable() leaving MLX's graph limits alone, docs/mlx-lm.md); PART trace (alone):
#               Phi-3-mini's decode steps under Nsight Compute (mlx-lm-decode --kernel-trace)
#   cpu-host    the 16-core host's CPU through the kit's MLX (its CPU backend), two calls; PART
#               kernels: the linear kernel alone (make bench-linear-kernel, every core and 2
#               threads), the attention kernel alone (make bench-cpu-kernel), bench-operators
#               --device cpu per x86 path, bench-eval-overhead (~8 min); model: bench --device
#               cpu Qwen3-4B 4-bit with the pool's workers sleeping and polling between ops,
#               bench-linear on Qwen3-4B's projections
# Set LLM_EVAL_GIT_SHA (and LLM_EVAL_GIT_DIRTY) to the workstation's: the device's copy of the
# tree carries a stale .git. ROUNDS sets the whole-model targets' rounds.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
source tools/h200.sh
set +e  # h200.sh sets -e: one target's failure must not skip the others
export PYTHONUNBUFFERED=1
R="$OUT/records"
G=$(python3 -c "from llm_eval.bench import machine_tag; print(machine_tag('gpu'))")  # h200, h100
mkdir -p "$R"
V=mlx-0.32.4
quiet() { grep -v -E '^\[(#| )' || true; }  # progress bars; never fails the pipeline
ops() { python3 -m llm_eval.operators --device gpu --force "$@" 2>&1 | quiet; }
CONTEXTS_LONG=(--context 4096 --context 16384 --context 32768 --context 131072)

tests() {
  # Four pytest processes side by side on the one GPU (16 host cores): one after another the GPU
  # cases took ~10 minutes on an H100, past a device call; test_quantized alone takes ~200 s
  # (mlx-lm's quantized attention on the GPU). The CUDA emulation's cases run on the CPU and in
  # `make test`, so not here. Each log is written as it goes (a call cut at its limit still
  # returns what ran); a case that hangs fails after 100 s with every thread's stack.
  local t=packages/attn-kernels/tests
  local run=(python3 -X faulthandler -m pytest -v -p no:cacheprovider --timeout 100
    --timeout-method thread --durations 8 -k "(gpu or cuda) and not emulation")
  "${run[@]}" $t/test_attention_step.py > "$OUT/gpu-tests-step.txt" 2>&1 &
  "${run[@]}" $t/test_decode_attention.py $t/test_attention_step_quantized.py \
    > "$OUT/gpu-tests-decode-step-quantized.txt" 2>&1 &
  "${run[@]}" $t/test_quantized.py > "$OUT/gpu-tests-quantized.txt" 2>&1 &
  {  # one process per package: their conftest modules share a name
    "${run[@]}" $(ls $t/test_*.py | grep -v -e /test_attention_step -e /test_decode_attention.py \
      -e /test_quantized.py)
    "${run[@]}" packages/qwen3-model/tests
    "${run[@]}" packages/llm-eval/tests
  } > "$OUT/gpu-tests-rest.txt" 2>&1 &
  wait
  tail -n 2 "$OUT"/gpu-tests-*.txt
}

operators() {
  local part="$1" f="$R/$G-qwen3-4b-attention"
  if [ "$part" = all ] || [ "$part" = kernels ]; then
    ops --context 1 --context 32 --context 128 --context 256 --context 1024 "${CONTEXTS_LONG[@]}" \
      --schedule auto --schedule split-gqa --schedule split --schedule chapter-8 \
      --schedule chapter-16 --schedule chapter-32 --implementations readable,mlx \
      --context-repeats 2 --json-output "$f-L1-$V.json"
    ops --query-length 2 --query-length 4 --query-length 8 --attention-mask causal \
      --context 32 --context 128 --context 256 --context 1024 "${CONTEXTS_LONG[@]}" \
      --context-repeats 2 --json-output "$f-L2-L8-causal-$V.json"
  fi
  if [ "$part" = all ] || [ "$part" = grid ]; then
    ops --context 1 --context 31 --context 32 --context 127 --context 128 --context 129 \
      --context 255 --context 256 --context-repeats 2 --json-output "$f-grid-L1-$V.json"
    ops --query-length 8 --attention-mask causal --context 8 --context 31 --context 32 \
      --context 127 --context 128 --context 129 --context 255 --context 256 --context-repeats 2 \
      --json-output "$f-grid-L8-causal-$V.json"
    ops --context 32 --context 128 --context 160 --context 192 --context 256 --context-repeats 6 \
      --json-output "$f-context-sweep-$V.json"
    ops --context 128 --query-length 1 --query-length 2 --query-length 4 --query-length 8 \
      --attention-mask causal --context-repeats 6 --json-output "$f-query-sweep-$V.json"
    ops --gqa-ratio 1 --context 128 --context 1024 --context 4096 --context 16384 \
      --context-repeats 2 --json-output "$f-gqa1-$V.json"
    ops --attention-mask explicit --query-length 1 --query-length 2 --context 128 \
      --context 1024 --context 4096 --context-repeats 2 --json-output "$f-explicit-mask-$V.json"
    ops --fresh-inputs --implementations custom,mlx --context 1 --context 128 --context 1024 \
      "${CONTEXTS_LONG[@]}" --iterations 12 --context-repeats 2 \
      --json-output "$f-fresh-inputs-$V.json"
  fi
  if [ "$part" = all ] || [ "$part" = short ]; then
    for mode in independent chained; do
      ops --context 1 --context 32 --context 64 --context 128 --context 192 --context 256 \
        --context 512 --context 1024 --context 4096 --schedule auto --schedule split-mma \
        --schedule chapter-16 --schedule split --implementations mlx --context-repeats 2 \
        $([ $mode = chained ] && echo --chain) --json-output "$f-L1-short-$mode-$V.json"
    done
    ops --query-length 2 --query-length 8 --attention-mask causal --context 32 --context 256 \
      --context 1024 --context 4096 --implementations custom,mlx --context-repeats 2 \
      --json-output "$f-L2-L8-short-$V.json"
  fi
  if [ "$part" = mma16 ]; then  # not in all: where split-mma-16 pays, for auto's rule
    local g
    for g in 4 8; do
      ops --gqa-ratio $g --query-length 2 --query-length 4 --query-length 6 --query-length 8 \
        --attention-mask causal --context 16384 --context 32768 --context 131072 \
        --schedule split-mma --schedule split-mma-16 --implementations mlx --chain \
        --context-repeats 2 --iterations 6 \
        --json-output "$R/$G-attention-G$g-L2-L8-split-mma-16-chained-$V.json"
    done
  fi
  if [ "$part" = all ] || [ "$part" = long ]; then
    ops "${CONTEXTS_LONG[@]}" --schedule auto --implementations mlx --context-repeats 2 --chain \
      --json-output "$f-L1-long-chained-$V.json"
    ops --query-length 2 --query-length 4 --query-length 8 --attention-mask causal \
      "${CONTEXTS_LONG[@]}" --implementations custom,mlx --context-repeats 2 --chain \
      --json-output "$f-L2-L8-long-chained-$V.json"
  fi
}

coverage() {
  local dims="${1/all/64,80,96,128,256}"
  # Chained calls (bench-coverage's GPU default: a step's latency), one process per head dim, so
  # that an abort loses one record (two of four whole D 80 sweeps died in MLX's child-graph node,
  # results-h200.md). These records replace the ones llm-eval's test_coverage reads.
  local d
  for d in ${dims//,/ }; do
    python3 -X faulthandler -m llm_eval.coverage --device gpu --head-dim "$d" --context 32 \
      --context 128 --context 1024 --context 4096 --context 8192 --context 16384 \
      --context 32768 --context 131072 --force \
      --json-output "$R/$G-attention-coverage-chained-D$d-$V.json" 2>&1 | quiet | tail -12
    tar -C "$OUT" -cf "$OUT/records.tar" records  # ~90 s a head dim: a call cut short keeps these
  done
}

ragged() {
  local common=(--attention-mask causal --context 512 --context 2048 --context 8192
    --implementations custom,mlx --context-repeats 2 --iterations 4)
  for b in 8 32; do
    ops "${common[@]}" --batch "$b" --ragged --json-output "$R/$G-qwen3-4b-attention-B$b-ragged.json"
    ops "${common[@]}" --batch "$b" --json-output "$R/$G-qwen3-4b-attention-B$b-full.json"
  done
}

model() {
  for quantize in 4bit none; do
    local tag=$([ $quantize = 4bit ] && echo 4bit || echo bf16)
    for w in 32+97 128+129; do
      python3 -m llm_eval.progression --device gpu --model qwen3-4b --quantize "$quantize" \
        --input-len "${w%+*}" --output-len "${w#*+}" --repeats "${ROUNDS:-4}" --force \
        --json-output "$R/$G-qwen3-4b-$tag-progression-$w-$V.json" 2>&1 | quiet | tail -4
    done
    for w in 8192+65 32768+65; do
      python3 -m llm_eval.ab_decode --quantize "$quantize" --input-len "${w%+*}" \
        --output-len "${w#*+}" --rounds "${ROUNDS:-4}" --variants decode-attention,mlx-lm --force \
        --json-output "$R/$G-qwen3-4b-$tag-ab-decode-$w-$V.json" 2>&1 | quiet | tail -5
    done
  done
}

step() {
  python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_attention_step.py \
    packages/attn-kernels/tests/test_mlx_lm.py -k gpu 2>&1 | tail -5 | tee "$OUT/step-tests.txt"
  python3 -m llm_eval.step --count-kernels /tmp/graphs --quantize none 4bit --workloads 1024+9 \
    --count-steps 2 --force --json-output "$R/$G-qwen3-4b-kernels-per-step-$V.json" 2>&1 | quiet
  python3 -m llm_eval.step --quantize none 4bit --workloads 32+97 1024+65 8192+65 \
    --rounds "${ROUNDS:-2}" --anatomy-steps 8 --force \
    --json-output "$R/$G-qwen3-4b-step-bench-$V.json" 2>&1 | quiet
  python3 -m llm_eval.host_cost --context 1 --context 128 --context 1024 --rounds 60 --force \
    --json-output "$R/$G-host-cost-$V.json" | tail -9
  python3 -m llm_eval.host_cost --level mlx-lm-attention --force \
    --json-output "$R/$G-qwen3-4b-mlx-lm-step-host-cost-$V.json" | tail -3
  python3 -m llm_eval.mlx_lm_decode --model qwen3-4b --model llama-3-8b --quantize 4bit \
    --workload 32+97 --workload 8192+65 --rounds "${ROUNDS:-3}" --output "$R" 2>&1 | quiet
}

quantized() {
  local f="$R/$G-qwen3-4b-attention-quantized"
  if [ "$1" = head-dims ]; then  # the guard keeps D 128 on CUDA until these are timed
    python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_quantized.py \
      -k "gpu and head_dims" 2>&1 | tail -3 | tee "$OUT/quantized-head-dim-tests.txt"
    local case d g gqa bits shape
    # D, group (32: the one that divides 96), GQA (1: Phi-3's heads), bits
    for case in "64 64 4 4" "96 32 4 4" "96 32 1 4" "256 64 4 4" "64 64 4 8" "96 32 4 8" \
      "256 64 4 8"; do
      read -r d g gqa bits <<< "$case"
      shape="D$d$([ $gqa = 1 ] && echo -G1)$([ $g = 64 ] || echo -group-$g)-$bits-bit"
      ops --head-dim $d --kv-group-size $g --kv-bits $bits --gqa-ratio $gqa \
        --implementations mlx,custom-quantized,mlx-lm-quantized --context 4096 --context 32768 \
        --context 131072 --chain --context-repeats 2 \
        --json-output "$R/$G-attention-quantized-chained-$shape-$V.json"
    done
    return
  fi
  python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_quantized.py -k gpu \
    2>&1 | tail -5 | tee "$OUT/quantized-tests.txt"
  for bits in 8 4; do
    ops --implementations mlx,custom-quantized,mlx-lm-quantized,readable-quantized \
      --kv-bits $bits --context 1024 "${CONTEXTS_LONG[@]}" --json-output "$f-$bits-bit.json"
    ops --implementations mlx,custom-quantized,mlx-lm-quantized --kv-bits $bits \
      --context 32768 --context 131072 --chain --json-output "$f-$bits-bit-chained.json"
  done
  python3 -m llm_eval.accuracy --device gpu --context 1000 --context 4133 --context 32768 --force \
    --json-output "$f-accuracy-$V.json" | tail -1
  python3 -m llm_eval.ab_decode --model qwen3-4b --quantize 4bit --kv-bits 4 --kv-group-size 64 \
    --mlx-lm-kv-bits none --input-len 32768 --output-len 65 --rounds "${ROUNDS:-4}" \
    --variants decode-attention,mlx-lm --force \
    --json-output "$R/$G-qwen3-4b-4bit-kv4-ab-decode-32768+65-$V.json" 2>&1 | quiet | tail -8
}

serve() {
  local mix=(--model qwen3-4b --quantize 4bit --requests 32 --prompt-min 256 --prompt-max 2048
    --new-tokens 64)
  if [ "$1" = all ]; then
    python3 -m llm_eval.serve "${mix[@]}" --slots 8 --slots 32 --rounds "${ROUNDS:-2}" --anatomy \
      --output "$R/$G-qwen3-4b-4bit-serve-32x256-2048+64-$V.json" 2>&1 | quiet
  fi
  if [ "$1" = rates ]; then  # the same runs without the anatomy (a shorter call), with
    # enable(linear=False) (attention alone: the A/B of enable()'s routing of batched steps) and
    # ours on MLX's CUDA graph limits (the A/B of batch_stream()'s one graph a step) and with
    # its outputs in MLX's managed memory (the A/B of attn_kernels.output_memory)
    python3 -m llm_eval.serve "${mix[@]}" --slots 8 --slots 32 --rounds "${ROUNDS:-2}" \
      --variant mlx-lm --variant mlx-lm+kernel --variant mlx-lm+attention --variant ours \
      --variant ours-mlx-graphs --variant ours-managed-outputs \
      --output "$R/$G-qwen3-4b-4bit-serve-rates-32x256-2048+64-$V.json" 2>&1 | quiet
  fi
  if [ "$1" = trace ]; then  # not in "all": its own call
    python3 -m llm_eval.serve "${mix[@]}" --slots 8 --slots 32 --kernel-trace --force \
      --output "$R/$G-qwen3-4b-4bit-serve-kernel-trace-$V.json" 2>&1 | quiet | grep -v '^==PROF=='
  fi
  if [ "$1" = all ] || [ "$1" = anatomy ]; then
    local name setting
    for name in default graphs-off 1000-ops-a-graph; do
      case $name in
        default) setting= ;;
        graphs-off) setting=MLX_USE_CUDA_GRAPHS=0 ;;
        *) setting=MLX_MAX_OPS_PER_BUFFER=1000 ;;
      esac
      env $setting python3 -m llm_eval.serve "${mix[@]}" --slots 1 --slots 8 --slots 32 \
        --anatomy-only --force \
        --output "$R/$G-qwen3-4b-4bit-serve-anatomy-$name-$V.json" 2>&1 | quiet
    done
  fi
}

# Issue 40's one-row layer shapes: Phi-3-mini's q/k/v, o, gate/up, down, LM head; Llama-3.2-1B's
# q and o, k/v, gate/up, down, LM head; Gemma-3-4B's q, k/v, o, gate/up, down, LM head.
ONE_ROW_SHAPES=(9216x3072 3072x3072 16384x3072 3072x8192 32064x3072 2048x2048 512x2048 8192x2048
  2048x8192 128256x2048 2048x2560 1024x2560 2560x2048 10240x2560 2560x10240 262144x2560)

linear() {
  if [ "$1" = one-row ]; then  # not in all: the one-row kernel's judgement (tests ~200 s, H100)
    local run=(python3 -m pytest -q -p no:cacheprovider --timeout 100
      packages/attn-kernels/tests/test_linear.py -k cuda_kernel_gpu)
    if ! "${run[@]}" > "$OUT/linear-tests.txt" 2>&1; then
      # The default form (SIMT since b645f9d) failed on the GPU: judge the tensor-core form in
      # this call instead (the plan's A/B switch; each process reads it once).
      tail -15 "$OUT/linear-tests.txt"
      export ATTN_LINEAR_ONE_ROW=mma
      if ! "${run[@]}" > "$OUT/linear-tests-mma.txt" 2>&1; then
        tail -15 "$OUT/linear-tests-mma.txt"
        unset ATTN_LINEAR_ONE_ROW
        return 1
      fi
    fi
    tail -3 "$OUT"/linear-tests*.txt
    linear candidates
    python3 -m llm_eval.host_cost --level mlx-lm-linear --rounds 20 --force \
      --json-output "$R/$G-phi-3-mini-qkv-4bit-mlx-lm-linear-host-cost-$V.json" 2>&1 | tail -3
    # enable() routing one-row layers against enable(linear="batches") (one row on MLX's qmv, as
    # the guard had it) in one rotation: the host moved separate runs apart (serving-cuda.md)
    python3 -m llm_eval.mlx_lm_decode --model phi-3-mini --model llama-3.2-1b --quantize 4bit \
      --workload 8192+65 --linear-routing batches --rounds "${ROUNDS:-3}" --output "$R" 2>&1 | quiet
    python3 -m llm_eval.linear --device gpu $(printf -- "--shape %s " "${ONE_ROW_SHAPES[@]}") \
      --format q4 --rows 1 --iterations 6 --force \
      --output "$R/$G-linear-gpu-one-row-phi-3-llama-3.2-gemma-3-$V.json" 2>&1 | quiet
    unset ATTN_LINEAR_ONE_ROW
    return
  fi
  if [ "$1" = candidates ]; then
    nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda \
      kernels-cuda/dev/bench_linear.cu -o /tmp/bench_linear -lcuda || return 1
    BENCH_BITS=4,8 /tmp/bench_linear 2>&1 | tee "$OUT/bench-linear-bf16.txt"
    BENCH_F16=1 BENCH_BITS=4,8 BENCH_ROUNDS=1 /tmp/bench_linear 2>&1 |
      tee "$OUT/bench-linear-f16.txt"
    return
  fi
  if [ "$1" = all ]; then
    python3 -m pytest -q -p no:cacheprovider packages/attn-kernels/tests/test_linear.py \
      packages/attn-kernels/tests/test_mlx_lm_linear.py packages/attn-kernels/tests/test_guard_limits.py \
      -m "not full" -k "gpu or cuda or limits" 2>&1 | tail -30 | tee "$OUT/linear-tests.txt"
  fi
  local rows=(--rows 1 --rows 2 --rows 4 --rows 8 --rows 16 --rows 32)
  python3 -m llm_eval.linear --device gpu --model qwen3-4b --format q4 --format q8 "${rows[@]}" \
    --iterations 6 --force --output "$R/$G-qwen3-4b-linear-gpu-$V.json" 2>&1 | quiet
  # Group 128, as the serving model (and the published 4-bit checkpoints) quantize
  python3 -m llm_eval.linear --device gpu --model qwen3-4b --format q4 --format q8 \
    --group-size 128 "${rows[@]}" --iterations 6 --force \
    --output "$R/$G-qwen3-4b-linear-gpu-group-128-$V.json" 2>&1 | quiet
  [ "$1" = all ] || return 0
  local tiles
  for tiles in 1 2; do  # W rows a warp covers (plan_linear_quantized's choice: 2 from 17 rows)
    ATTN_LINEAR_ROW_TILES=$tiles python3 -m llm_eval.linear --device gpu --model qwen3-4b \
      --format q4 --rows 16 --rows 32 --iterations 4 --no-record 2>&1 | quiet |
      tee "$OUT/linear-row-tiles-$tiles.txt"
  done
}

models() {
  if [ "$1" = trace ]; then  # not in all: where Phi-3's decode step goes, kernel by kernel
    python3 -m llm_eval.mlx_lm_decode --model phi-3-mini --quantize 4bit --workload 8192+24 \
      --kernel-trace 4 --output "$R" 2>&1 | quiet
    return
  fi
  python3 -m llm_eval.mlx_lm_decode --model llama-3.2-1b --model phi-3-mini --model gemma-3-4b \
    --quantize 4bit --workload 8192+65 --rounds "${ROUNDS:-3}" --output "$R" \
    $([ "$1" = one-graph ] && echo --one-graph-a-step) 2>&1 | quiet
  python3 -m llm_eval.mlx_lm_decode --model qwen3-4b --quantize 4bit --workload 32+97 \
    --draft-layers 36 --num-draft-tokens 3 --rounds "${ROUNDS:-3}" --output "$R" 2>&1 | quiet
}

cpu_host() {
  local f="$R/$G-host-cpu" part="$1"
  {
    echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3"
    grep -o -w -E "avx512f|avx512bw|avx512_bf16|avx512_vnni|avx2|fma|f16c" /proc/cpuinfo |
      sort | uniq -c
  } | tee "$OUT/cpu.txt"
  if [ "$part" = all ] || [ "$part" = kernels ]; then
    # Issue 41's first: the linear kernel alone (every core, then 2 threads as on a 2-vCPU VM)
    local linear=(--format q4 --format q8 --format bf16 --rows 1 avx512 avx2)
    make -j8 bench-linear-kernel ARGS="${linear[*]}" 2>&1 | grep -v -E "^(/|g\+\+|c\+\+)" |
      tee "$OUT/bench-linear-kernel.txt"
    ATTN_KERNELS_NUM_THREADS=2 make bench-linear-kernel ARGS="${linear[*]}" 2>&1 |
      tee "$OUT/bench-linear-kernel-2-threads.txt"
    make -j8 bench-cpu-kernel 2>&1 | grep -v -E "^(/|g\+\+|c\+\+)" |
      tee "$OUT/bench-cpu-kernel.txt"
    for path in avx512 avx2; do
      ATTN_KERNELS_CPU_PATH=$path python3 -m llm_eval.operators --device cpu --force \
        --implementations custom,mlx --iterations 10 --context 1024 --context 4096 \
        --context 16384 --context 65536 --context-repeats 3 \
        --json-output "$f-qwen3-4b-attention-L1-$path-$V.json" 2>&1 | quiet | tail -8
    done
    python3 -m llm_eval.eval_overhead --rounds 8 --force \
      --json-output "$f-eval-overhead-$V.json" 2>&1 | grep -v '^round'
  fi
  if [ "$part" = all ] || [ "$part" = model ]; then
    # The whole 4-bit model against the host's read floor (loading quantizes 4B weights on the
    # CPU: ~100 s), with the pool's workers sleeping between ops (the default) and polling
    # 200 µs (a step hands ~200 ops to 16 workers: +90 µs each from sleep at 934ef29), then
    # Qwen3-4B's projections through MLX
    local spin
    for spin in 0 200; do
      ATTN_KERNELS_POOL_SPIN_US=$spin python3 -m llm_eval.bench --device cpu --model qwen3-4b \
        --quantize 4bit --input-len 8 --output-len 17 --rounds 3 --variant decode-attention \
        --force --output "$f-qwen3-4b-4bit-bench$([ $spin = 0 ] || echo "-spin-${spin}us")-$V.json" \
        2>&1 | quiet
    done
    python3 -m llm_eval.linear --model qwen3-4b --format bf16 --format q4 --format q8 --rows 1 \
      --iterations 2 --force --output "$f-qwen3-4b-linear-$V.json" 2>&1 | quiet
  fi
}

for target in "$@"; do
  name="${target%%:*}" part="all"
  [ "$name" = "$target" ] || part="${target#*:}"
  echo "== $target $(date -u +%T)"
  case "$name" in
    operators | serve | linear | coverage | models | quantized) "$name" "$part" ;;
    tests | ragged | model | step) "$name" ;;
    cpu-host) cpu_host "$part" ;;
    *) echo "tools/gpu.sh: unknown target $target (tests, operators[:kernels|grid|short|long]," \
      "coverage[:D,D...], ragged, model, models[:one-graph|trace], step, quantized[:head-dims]," \
      "linear[:bench|candidates|one-row]," \
      "serve[:rates|anatomy|trace]," \
      "cpu-host[:kernels|model])" >&2 ;;
  esac
  # After each target, so that a call stopped at its limit still returns the finished ones
  tar -C "$OUT" -cf "$OUT/records.tar" records
done
rm -rf "$R"
echo "== done $(date -u +%T); records: $(tar -tf "$OUT/records.tar" | grep -c json)"
