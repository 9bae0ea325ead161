F="-std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda kernels-cuda/dev/bench_attend.cu -lcuda"
nvcc $F -DMERGE_WIDE=0 -o /tmp/bnw0 & nvcc $F -DMERGE_WIDE=1 -o /tmp/bnw1 & wait
for r in 1 2 3 4; do
  case $r in 1|4) o="0 1";; *) o="1 0";; esac
  for w in $o; do echo "## wide=$w round=$r"; BENCH_MAX_S=4096 /tmp/bnw$w split-mma; done
done > $OUT/wide_ab.txt 2>&1
BENCH_MAX_S=4096 /tmp/bnw1 split-gqa split > $OUT/wide_other.txt 2>&1
