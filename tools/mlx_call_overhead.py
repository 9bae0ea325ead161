"""Where an operator benchmark's time per call goes through MLX's CUDA backend.

bench-operators times a sample as: build `calls` lazy calls in Python, mx.eval them, wall time
divided by `calls`. On the GPU that time holds more than the kernels: the Python building (done
before the GPU starts), MLX's encoding of each op, and a CUDA graph committed every
MLX_MAX_MB_PER_BUFFER of inputs (1000 MB on sm_90) or MLX_MAX_OPS_PER_BUFFER ops (100), each
launched after the one before has drained. This script makes the same inputs and calls as
bench-operators (llm_eval.operators; Qwen3-4B shapes, bf16, L = 1, group 64: custom-quantized,
attn_kernels.decode_attention_quantized, and mlx, mx.fast on the bf16 K/V) and splits each sample into its Python building and its mx.eval, at 50 and 200
calls a sample. Run it once per MLX setting, e.g. once as is and once with
MLX_MAX_MB_PER_BUFFER=1000000 (one graph a sample), and compare.

    python3 tools/mlx_call_overhead.py --context 32768 --context 131072 --bits 4 --bits 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import mlx.core as mx
from llm_eval.operators import (
    implementation,
    implementation_orders,
    make_shape,
    quantized_implementation,
)

HEADS, GQA_RATIO, HEAD_DIM, GROUP_SIZE = 32, 4, 128, 64


def make_calls(context: int, bits: int) -> dict:
    """bench-operators' inputs and calls: custom-quantized and mlx, no mask."""
    q, k, v, _ = make_shape(context, 1, HEADS, GQA_RATIO, HEAD_DIM, "none", mx.bfloat16, seed=0)
    kq, vq = (mx.quantize(x, group_size=GROUP_SIZE, bits=bits) for x in (k, v))
    mx.eval(kq, vq)
    scale = HEAD_DIM**-0.5
    ours = quantized_implementation("custom-quantized", scale, None, kq, vq, GROUP_SIZE, bits)
    fast = implementation("mlx", scale, None)
    return {"quantized": lambda: ours(q, k, v), "mx.fast": lambda: fast(q, k, v)}


def sample(call, calls: int) -> tuple[float, float]:
    """(building, building + eval) per call, in µs."""
    start = time.perf_counter()
    outs = [call() for _ in range(calls)]
    built = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return (built - start) / calls * 1e6, (done - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, action="append", required=True)
    parser.add_argument("--bits", type=int, action="append", required=True, choices=(4, 8))
    parser.add_argument("--calls", type=int, action="append", help="calls a sample (50, 200)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json-output", help="every sample, as JSON")
    args = parser.parse_args()
    calls_list = args.calls or [50, 200]
    setting = {k: os.environ.get(k) for k in ("MLX_MAX_MB_PER_BUFFER", "MLX_MAX_OPS_PER_BUFFER")}
    print(f"MLX {mx.__version__} on {mx.default_device()}, {setting}")
    rows = []
    for context, bits in itertools.product(args.context, args.bits):
        fns = make_calls(context, bits)
        for calls in calls_list:
            for fn in fns.values():  # warm-up: the first eval of a batch builds its graphs
                sample(fn, calls)
            samples = {name: [] for name in fns}
            orders = implementation_orders(list(fns))
            for i in range(args.iterations):
                for name in orders[i % len(orders)]:
                    samples[name].append(sample(fns[name], calls))
            for name, got in samples.items():
                build = statistics.median(b for b, _ in got)
                total = sorted(t for _, t in got)
                row = {
                    "context": context,
                    "bits": bits,
                    "calls": calls,
                    "implementation": name,
                    "build_us": build,
                    "median_us": statistics.median(total),
                    "min_us": total[0],
                    "max_us": total[-1],
                    "samples": got,
                }
                rows.append(row)
                print(
                    f"S {context:6d} bits {bits} calls {calls:3d} {name:9s} "
                    f"sample {row['median_us']:7.1f} us [{total[0]:6.1f}..{total[-1]:6.1f}]"
                    f"  building {build:5.1f}  eval {row['median_us'] - build:7.1f}",
                    flush=True,
                )
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump({"mlx": mx.__version__, "setting": setting, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
