"""One representative GPU call per schedule, checked against the readable path (python3
tools/gpu_sanity_case.py). Under compute-sanitizer MLX's own kernels get in the way; sanitize the
kernels with kernels-cuda/dev/bench_attend.cu instead (see docs/cuda-kernel.md)."""

import mlx.core as mx
from attn_kernels import SCHEDULES, decode_attention_custom, scaled_dot_product_attention

mx.set_default_device(mx.gpu)
for s, length, mask in [(300, 1, None), (1000, 2, "causal"), (77, 3, "causal")]:
    q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
    ref = scaled_dot_product_attention(q, k, v, mask=mask).astype(mx.float32)
    for schedule in SCHEDULES:
        out = decode_attention_custom(q, k, v, mask=mask, schedule=schedule).astype(mx.float32)
        err = mx.abs(out - ref).max().item()
        print(f"S={s} L={length} {schedule}: max |err| {err:.4f}")
        assert err < 0.05
print("sanity ok")
