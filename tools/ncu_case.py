"""Attention calls on Qwen3-4B shapes (Hq 32, Hkv 8, D 128, bf16) for Nsight Compute, one call per
mx.eval, printed before each call so ncu's kernel IDs follow the printed cases:

    ncu --clock-control none -k regex:attend python3 tools/ncu_case.py SCHEDULES S [L] [CALLS]
    ncu --clock-control none -k regex:'attend|sdpav' --metrics gpu__time_duration.sum --csv \\
        python3 tools/ncu_case.py auto,mx.fast 1,128 1 5
    ncu --clock-control none -k regex:attend_quantized python3 tools/ncu_case.py quantized 4 4096

SCHEDULES and S are comma-separated lists: decode_attention_custom's schedules, or "mx.fast" for
mx.fast.scaled_dot_product_attention (kernel sdpav*); L > 1 is causal, as a decode step with
several query tokens; CALLS repeats each case. `quantized BITS S[,S...] [GROUP]` times
decode_attention_quantized at L = 1 on mx.quantize's codes (group 64 by default).
"""

import sys

import mlx.core as mx
from attn_kernels import decode_attention_custom, decode_attention_quantized


def tensors(s, length=1):
    q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 8, s, 128)).astype(mx.bfloat16) for _ in range(2))
    return q, k, v


def quantized(bits: int, contexts: list[int], group: int) -> None:
    for s in contexts:
        q, k, v = tensors(s)
        kq, vq = (mx.quantize(x, group_size=group, bits=bits) for x in (k, v))
        mx.eval(q, kq, vq)
        print(f"case bits={bits} group={group} S={s}", flush=True)
        mx.eval(decode_attention_quantized(q, kq, vq, group_size=group, bits=bits))


def dense(schedules: list[str], contexts: list[int], length: int, calls: int) -> None:
    mask = "causal" if length > 1 else None
    for s in contexts:
        q, k, v = tensors(s, length)
        mx.eval(q, k, v)
        for schedule in schedules:
            for _ in range(calls):
                print(f"case S={s} L={length} {schedule}", flush=True)
                if schedule == "mx.fast":
                    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask=mask)
                else:
                    out = decode_attention_custom(q, k, v, mask=mask, schedule=schedule)
                mx.eval(out)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    mx.set_default_device(mx.gpu)
    if argv[0] == "quantized":
        group = int(argv[3]) if len(argv) > 3 else 64
        quantized(int(argv[1]), [int(s) for s in argv[2].split(",")], group)
    else:
        length = int(argv[2]) if len(argv) > 2 else 1
        calls = int(argv[3]) if len(argv) > 3 else 1
        dense(argv[0].split(","), [int(s) for s in argv[1].split(",")], length, calls)


if __name__ == "__main__":
    main(sys.argv[1:])
