"""One look at decode_attention_quantized on the default device before longer runs: a few
shapes against the readable path over the dequantised cache (float32), largest error printed.
Each shape runs twice in separate evals: a kernel that leaves state behind for the next call
(a counter it forgot to reset, as the removed mmat4d had to) shows it in the second error."""

import mlx.core as mx
from attn_kernels import decode_attention_quantized, scaled_dot_product_attention

for bits, group_size, s, length, hq, hkv, mask in [
    (8, 64, 32768, 1, 32, 8, None),
    (4, 64, 131072, 1, 32, 8, None),
    (4, 32, 129, 8, 32, 8, "causal"),
    (8, 128, 1000, 3, 8, 2, "causal"),
]:
    q = mx.random.normal((1, hq, length, 128)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, hkv, s, 128)).astype(mx.bfloat16) for _ in range(2))
    kq, vq = mx.quantize(k, group_size, bits), mx.quantize(v, group_size, bits)
    kd, vd = (
        mx.dequantize(c, sc.astype(mx.float32), b.astype(mx.float32), group_size, bits)
        for c, sc, b in (kq, vq)
    )
    ref = scaled_dot_product_attention(q.astype(mx.float32), kd, vd, mask=mask)
    errs = []
    for _ in range(2):
        out = decode_attention_quantized(q, kq, vq, mask=mask, group_size=group_size, bits=bits)
        errs.append(mx.abs(out.astype(mx.float32) - ref).max().item())
    print(
        f"bits {bits} group {group_size} S {s} L {length}: max |ours - readable| = "
        + ", then ".join(f"{e:.2e}" for e in errs)
    )
