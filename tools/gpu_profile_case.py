"""DecodeAttention calls (Qwen3-4B shapes, bf16) for Nsight Compute, one call per mx.eval:

    ncu --clock-control none -k regex:attend python3 tools/gpu_profile_case.py SCHEDULE S [L]
    ncu --clock-control none -k regex:'attend|sdpav' --metrics gpu__time_duration.sum --csv \\
        python3 tools/gpu_profile_case.py auto,mx.fast 1,128 1 5

SCHEDULE and S may be comma-separated lists; "mx.fast" is mx.fast.scaled_dot_product_attention
(kernel sdpav*). The optional fourth argument repeats each call. Cases run in the printed order
(for each S, each schedule, the repeats), so ncu's kernel IDs follow it. L > 1 is causal, as in
decode with several query tokens."""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_custom

schedules, contexts = sys.argv[1].split(","), [int(s) for s in sys.argv[2].split(",")]
length = int(sys.argv[3]) if len(sys.argv) > 3 else 1
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 1
mx.set_default_device(mx.gpu)
mask = "causal" if length > 1 else None
for s in contexts:
    q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    for schedule in schedules:
        for _ in range(calls):
            print(f"case S={s} L={length} {schedule}", flush=True)
            if schedule == "mx.fast":
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask=mask)
            else:
                out = decode_attention_custom(q, k, v, mask=mask, schedule=schedule)
            mx.eval(out)
