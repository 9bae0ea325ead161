"""One DecodeAttention call for Nsight Compute:
ncu --clock-control none -k regex:attend python3 tools/gpu_profile_case.py SCHEDULE S"""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_custom

schedule, s = sys.argv[1], int(sys.argv[2])
mx.set_default_device(mx.gpu)
q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
k = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
v = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
mx.eval(q, k, v)
mx.eval(decode_attention_custom(q, k, v, schedule=schedule))
