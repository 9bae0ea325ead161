"""One decode_attention_quantized call (Qwen3-4B shapes, bf16, L=1, group 64) for Nsight Compute:
ATTN_QUANTIZED_VARIANT=8x2|mma ncu --clock-control none -k regex:attend_quantized \\
    python3 tools/gpu_profile_quantized.py BITS S"""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_quantized

bits, s = int(sys.argv[1]), int(sys.argv[2])
mx.set_default_device(mx.gpu)
q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
kq, vq = (
    mx.quantize(mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16), group_size=64, bits=bits)
    for _ in range(2)
)
mx.eval(q, kq, vq)
mx.eval(decode_attention_quantized(q, kq, vq, group_size=64, bits=bits))
