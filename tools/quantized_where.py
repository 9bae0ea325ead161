"""Where does decode_attention_quantized's time go on a GPU? Qwen3-4B shapes, L=1, group 64, 50
independent calls per eval, median of 15 samples, at the given contexts, for three versions of
the same cache:

  as-is      mx.quantize's (codes, scales, biases), as bench-operators passes them;
  fresh-sb   scales and biases copied by a GPU op (x + 0: new buffers from MLX's GPU allocator);
  fresh-all  codes too.

mlx-lm's quantized path is timed on the same three. On the H200 at f6e6a5d the SIMT (8x2) and
tensor-core (mma) kernels took the same time at every context and bit width (4-bit no faster than
8-bit), as did mlx-lm's path up to a factor 2: a cost outside the kernels' arithmetic that grows
with S. If fresh-sb is much faster than as-is, the scales/biases buffers were the cause (e.g.
living in unified or host memory).

    ATTN_QUANTIZED_VARIANT=8x2|mma python3 tools/quantized_where.py [--context S ...]
"""

import argparse
import os
import statistics
import time

import mlx.core as mx
from attn_kernels import decode_attention_quantized
from mlx_lm.models.base import quantized_scaled_dot_product_attention


def median_us(fn, *args, **kwargs):
    samples = []
    for i in range(18):  # 3 warm-up samples, 15 timed
        start = time.perf_counter()
        mx.eval([fn(*args, **kwargs) for _ in range(50)])
        if i >= 3:
            samples.append((time.perf_counter() - start) / 50 * 1e6)
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, action="append", help="S (repeatable)")
    args = p.parse_args()
    variant = os.environ.get("ATTN_QUANTIZED_VARIANT", "8x2")
    for bits in (8, 4):
        for s in args.context or (32768, 131072):
            q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
            k, v = (mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16) for _ in range(2))
            as_is = [mx.quantize(x, group_size=64, bits=bits) for x in (k, v)]
            fresh_sb = [(c, sc + 0, b + 0) for c, sc, b in as_is]
            fresh_all = [tuple(a + 0 for a in t) for t in as_is]
            mx.eval(q, as_is, fresh_sb, fresh_all)
            for name, (kq, vq) in (
                ("as-is", as_is),
                ("fresh-sb", fresh_sb),
                ("fresh-all", fresh_all),
            ):
                ours = median_us(decode_attention_quantized, q, kq, vq, group_size=64, bits=bits)
                theirs = median_us(
                    quantized_scaled_dot_product_attention,
                    q,
                    kq,
                    vq,
                    scale=128**-0.5,
                    mask=None,
                    group_size=64,
                    bits=bits,
                )
                print(
                    f"variant {variant} bits {bits} S {s} {name}: ours {ours:.1f} us, "
                    f"mlx-lm {theirs:.1f} us",
                    flush=True,
                )


if __name__ == "__main__":
    main()
