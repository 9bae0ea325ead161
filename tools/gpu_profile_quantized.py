"""decode_attention_quantized calls (Qwen3-4B shapes, bf16, L=1) for Nsight Compute, one call per
mx.eval, for each S of a comma-separated list (ncu's kernel IDs follow the printed cases):

    ncu --clock-control none -k regex:attend_quantized \\
        python3 tools/gpu_profile_quantized.py BITS S[,S...] [GROUP]

ATTN_QUANTIZED_VARIANT picks the kernel (default: the dispatcher's)."""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_quantized

bits, contexts = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
group = int(sys.argv[3]) if len(sys.argv) > 3 else 64
mx.set_default_device(mx.gpu)
for s in contexts:
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    kq, vq = (
        mx.quantize(
            mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16), group_size=group, bits=bits
        )
        for _ in range(2)
    )
    mx.eval(q, kq, vq)
    print(f"case bits={bits} group={group} S={s}", flush=True)
    mx.eval(decode_attention_quantized(q, kq, vq, group_size=group, bits=bits))
