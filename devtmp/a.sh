python3 -m pytest -q -x packages/attn-kernels/tests -k gpu -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "tests rc $?" >> $OUT/log.txt
nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda kernels-cuda/dev/bench_attend.cu -o /tmp/bn -lcuda >> $OUT/log.txt 2>&1
S=$OUT/sanitizer.txt
echo "# compute-sanitizer on bench_attend at $LLM_EVAL_GIT_SHA, H200: racecheck split-mma (S<=512), synccheck split-mma (S<=512), memcheck split-mma and split-gqa (S<=1024). Every case checked against float64." > $S
echo "== racecheck split-mma" >> $S; BENCH_MAX_S=512 BENCH_REPLAYS=1 compute-sanitizer --tool racecheck /tmp/bn split-mma >> $S 2>&1
echo "== synccheck split-mma" >> $S; BENCH_MAX_S=512 BENCH_REPLAYS=1 compute-sanitizer --tool synccheck /tmp/bn split-mma >> $S 2>&1
echo "== memcheck split-mma split-gqa" >> $S; BENCH_MAX_S=1024 BENCH_REPLAYS=1 compute-sanitizer --tool memcheck /tmp/bn split-mma split-gqa >> $S 2>&1
echo "sanitizers done" >> $OUT/log.txt
