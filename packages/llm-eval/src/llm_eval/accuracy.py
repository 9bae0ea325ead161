"""bench-accuracy: the accuracy of attention over a quantized KV cache. decode_attention_quantized
and mlx-lm's quantized_scaled_dot_product_attention on the same codes, both against float64
attention over the original (unquantized) bf16 K/V. Qwen3-4B shapes (Hq 32, Hkv 8, D 128),
random normal inputs, causal; RMS and largest absolute error over every output value.

A second figure separates faithfulness from luck: each path's error against float64 attention
over the dequantized codes (scale * code + bias in float32), the function both paths compute.

--bits, --group-size and --context narrow the grid; L is 1 and 4 (causal).

    bench-accuracy --device gpu --context 1000 --context 4133 --context 32768 \\
        --json-output benchmark_results/h200-qwen3-4b-attention-quantized-accuracy-mlx-0.32.4.json
"""

import argparse
from functools import partial

import mlx.core as mx
import numpy as np
from attn_kernels import decode_attention_quantized
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    refuse_overwrite,
    write_record,
)


def to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def attention_f64(q, k, v) -> np.ndarray:
    """Causal attention in float64: q (B, Hq, L, D) at the last L of k/v's S positions."""
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    length, s_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("bhld,bhsd->bhls", q, k) / np.sqrt(q.shape[-1])
    keep = np.arange(s_len)[None, :] <= np.arange(s_len - length, s_len)[:, None]
    scores = np.where(keep, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhls,bhsd->bhld", weights / weights.sum(axis=-1, keepdims=True), v)


def kq_f32(triple):
    """A quantized triple with float32 scales and biases: dequantizing it does not round."""
    codes, scales, biases = triple
    return codes, scales.astype(mx.float32), biases.astype(mx.float32)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="bench-accuracy", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--context", type=int, action="append", help="S (repeatable; 1000 and 4133)")
    p.add_argument("--bits", type=int, choices=[4, 8], action="append", help="(default 8 and 4)")
    p.add_argument(
        "--group-size", type=int, choices=[32, 64, 128], action="append", help="(default all)"
    )
    add_record_args(p)
    args = p.parse_args(argv)
    if any(c < 4 for c in args.context or []):
        p.error("--context must be >= 4 (the causal L = 4 rows)")
    refuse_overwrite(p, args.json_output, args.force)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    contexts = args.context or [1000, 4133]
    rows = []
    paths = {
        "custom-quantized": decode_attention_quantized,
        "mlx-lm-quantized": partial(quantized_scaled_dot_product_attention, scale=128**-0.5),
    }
    for bits in args.bits or (8, 4):
        for group_size in args.group_size or (32, 64, 128):
            for s in contexts:
                for length in (1, 4):
                    keys = mx.random.split(mx.random.key(s + length + bits + group_size), 3)
                    q = mx.random.normal((1, 32, length, 128), key=keys[0]).astype(mx.bfloat16)
                    k = mx.random.normal((1, 8, s, 128), key=keys[1]).astype(mx.bfloat16)
                    v = mx.random.normal((1, 8, s, 128), key=keys[2]).astype(mx.bfloat16)
                    kq = mx.quantize(k, group_size=group_size, bits=bits)
                    vq = mx.quantize(v, group_size=group_size, bits=bits)
                    exact = attention_f64(q, k, v)
                    k_codes = mx.dequantize(*kq_f32(kq), group_size=group_size, bits=bits)
                    v_codes = mx.dequantize(*kq_f32(vq), group_size=group_size, bits=bits)
                    exact_codes = attention_f64(q, k_codes, v_codes)
                    row = {
                        "bits": bits,
                        "group_size": group_size,
                        "context": s,
                        "query_length": length,
                    }
                    for name, path in paths.items():
                        try:
                            out = to_numpy(
                                path(q, kq, vq, mask="causal", group_size=group_size, bits=bits)
                            )
                        except RuntimeError as e:  # MLX 0.32.4's CUDA quantized_matmul lacks shapes
                            row[name] = {"error": str(e)}
                            continue
                        row[name] = {
                            "rms_error": float(np.sqrt(np.mean((out - exact) ** 2))),
                            "max_abs_error": float(np.abs(out - exact).max()),
                            "rms_error_vs_codes": float(np.sqrt(np.mean((out - exact_codes) ** 2))),
                            "rms_output": float(np.sqrt(np.mean(out**2))),
                        }
                    rows.append(row)
                    print(f"bits {bits} group {group_size} S {s} L {length}:", flush=True)
                    print(f"  exact rms {np.sqrt(np.mean(exact**2)):.4f}", flush=True)
                    for name in paths:
                        e = row[name]
                        print(
                            f"  {name}: "
                            + (
                                f"failed: {e['error']}"
                                if "error" in e
                                else f"rms {e['rms_error']:.3e} max {e['max_abs_error']:.3e} "
                                f"rms vs codes {e['rms_error_vs_codes']:.3e} "
                                f"rms out {e['rms_output']:.4f}"
                            ),
                            flush=True,
                        )
    both = [r for r in rows if all("error" not in r[n] for n in paths)]
    wins = sum(
        r["custom-quantized"]["rms_error"] <= r["mlx-lm-quantized"]["rms_error"] for r in both
    )
    print(
        f"ours at most mlx-lm's RMS error in {wins} of {len(both)} cases where both ran "
        f"({len(rows) - len(both)} where one raised)"
    )
    if args.json_output:
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "quantized-kv-accuracy",
            "metadata": collect_metadata(args.device),
            "config": {
                "device": args.device,
                "contexts": contexts,
                "dtype": "bfloat16",
            },
            "execution_order": [],
            "results": rows,
        }
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
