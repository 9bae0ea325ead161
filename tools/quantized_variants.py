"""Times decode_attention_quantized alone (Qwen3-4B shapes, L=1, group 64 unless --group-size
says otherwise, 50 calls per eval, independent or --chain'ed, median of 15 samples) at a few
contexts: run once per ATTN_QUANTIZED_VARIANT (and ATTN_QUANTIZED_SPLIT_BLOCKS) to compare the
CUDA kernel's variants (kernels-cuda/decode_attention_quantized.cu). With --baseline, mx.fast on the bf16 K/V the codes
came from is timed in alternation with ours (same samples, same process) and the ratio printed.

    ATTN_QUANTIZED_VARIANT=mmat python3 tools/quantized_variants.py --baseline

(The default variant is mmat4: the tensor-core kernel with transposed scores fed by a cp.async
pipeline through shared memory, sized for 4 blocks per SM; mmat is the same kernel sized for 2;
8x2 is the SIMT kernel; docs/quantized-kv.md. Where mmat's layout requirements fail, 8x2 runs:
ATTN_QUANTIZED_LOG=1 prints the kernel each call shape really ran. An experimental variant is
added to the kernel's variant() for as long as it is being timed.)
"""

import argparse
import os
import statistics
import time

import mlx.core as mx
from attn_kernels import decode_attention_quantized

HBM_BYTES_PER_S = 4.3e12  # the floor's rate: operators.py's DEFAULT_GPU_BANDWIDTH_GBS
HBM_PEAK_BYTES_PER_S = 4.8e12  # the H200's HBM3e peak (issue 25's target: 85% of it)


def sample(fn, q, *args, calls=50, chain=False, **kwargs):
    """µs per call of `calls` calls in one eval: independent (the GPU may overlap one call's
    tail with the next one's start) or chained, each call's output the next one's queries (a
    decode step's attention waits for the layer before it)."""
    start = time.perf_counter()
    if chain:
        for _ in range(calls):
            q = fn(q, *args, **kwargs)
        mx.eval(q)
    else:
        mx.eval([fn(q, *args, **kwargs) for _ in range(calls)])
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", action="store_true", help="also time mx.fast on bf16 K/V")
    p.add_argument("--context", type=int, action="append", help="S (repeatable)")
    p.add_argument("--bits", type=int, choices=[4, 8], action="append", help="(repeatable)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--chain", action="store_true", help="each call's output is the next's queries")
    args = p.parse_args()
    label = os.environ.get("ATTN_QUANTIZED_VARIANT", "mmat4")
    if args.chain:
        label += " chained"
    if args.group_size != 64:
        label += f" group {args.group_size}"
    if "ATTN_QUANTIZED_SPLIT_BLOCKS" in os.environ:
        label += f" split-blocks {os.environ['ATTN_QUANTIZED_SPLIT_BLOCKS']}"
    group = args.group_size
    for bits in args.bits or (8, 4):
        for s in args.context or (4096, 32768, 131072):
            q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
            k, v = (mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16) for _ in range(2))
            kq, vq = (mx.quantize(x, group_size=group, bits=bits) for x in (k, v))
            mx.eval(q, k, v, kq, vq)
            nbytes = sum(a.nbytes for t in (kq, vq) for a in t)
            ours, theirs = [], []
            for i in range(18):  # 3 warm-up samples, 15 timed
                x = sample(
                    decode_attention_quantized,
                    q,
                    kq,
                    vq,
                    chain=args.chain,
                    group_size=group,
                    bits=bits,
                )
                if i >= 3:
                    ours.append(x)
                if args.baseline:
                    y = sample(
                        mx.fast.scaled_dot_product_attention,
                        q,
                        k,
                        v,
                        chain=args.chain,
                        scale=128**-0.5,
                    )
                    if i >= 3:
                        theirs.append(y)
            us = statistics.median(ours)
            line = (
                f"variant {label} bits {bits} S {s}: {us:.1f} us ({nbytes / us / 1e3:.0f} GB/s, "
                f"{nbytes / HBM_BYTES_PER_S * 1e6 / us:.0%} of the quantized floor at 4.3 TB/s, "
                f"{nbytes / HBM_PEAK_BYTES_PER_S * 1e6 / us:.0%} at 4.8) "
                f"p10-p90 {sorted(ours)[1]:.1f}-{sorted(ours)[-2]:.1f}"
            )
            if args.baseline:
                base = statistics.median(theirs)
                line += f"; mx.fast bf16 {base:.1f} us: {base / us:.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
