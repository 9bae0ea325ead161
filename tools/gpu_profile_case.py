"""One DecodeAttention call (Qwen3-4B shapes, bf16) for Nsight Compute:
ncu --clock-control none -k regex:attend python3 tools/gpu_profile_case.py SCHEDULE S [L]
L > 1 is causal, as in decode with several query tokens."""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_custom

schedule, s = sys.argv[1], int(sys.argv[2])
length = int(sys.argv[3]) if len(sys.argv) > 3 else 1
mx.set_default_device(mx.gpu)
q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
k = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
v = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
mx.eval(q, k, v)
mask = "causal" if length > 1 else None
mx.eval(decode_attention_custom(q, k, v, mask=mask, schedule=schedule))
