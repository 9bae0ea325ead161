"""Times decode_attention_quantized alone (Qwen3-4B shapes, L=1, group 64, 50 independent calls
per eval, median of 15 samples) at a few contexts: run once per ATTN_QUANTIZED_VARIANT to compare
the CUDA kernel's variants (kernels-cuda/decode_attention_quantized.cu)."""

import os
import statistics
import time

import mlx.core as mx
from attn_kernels import decode_attention_quantized

variant = os.environ.get("ATTN_QUANTIZED_VARIANT", "8x2")
for bits in (8, 4):
    for s in (4096, 32768, 131072):
        q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
        k, v = (mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16) for _ in range(2))
        kq, vq = mx.quantize(k, bits=bits), mx.quantize(v, bits=bits)
        mx.eval(q, kq, vq)
        nbytes = sum(a.nbytes for t in (kq, vq) for a in t)
        samples = []
        for i in range(18):
            start = time.perf_counter()
            mx.eval([decode_attention_quantized(q, kq, vq, bits=bits) for _ in range(50)])
            if i >= 3:
                samples.append((time.perf_counter() - start) / 50 * 1e6)
        us = statistics.median(samples)
        print(
            f"variant {variant} bits {bits} S {s}: {us:.1f} us "
            f"({nbytes / us / 1e3:.0f} GB/s, floor {nbytes / 4.3e12 * 1e6 / us:.0%}) "
            f"min {min(samples):.1f} max {max(samples):.1f}",
            flush=True,
        )
