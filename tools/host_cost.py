"""Host time per attention call, in three parts, for our op against mx.fast (docs/host-cost.md).

- build: constructing the lazy op (Python wrapper, nanobind, the C++ op), nothing evaluated;
  the mean of --calls calls per sample.
- dispatch: build plus `mx.async_eval` (on a GPU: eval_gpu, the CUDA graph update and launch;
  on the CPU: eval_cpu's hand-off to the stream thread), not waiting for the result.
- eval: one call in its own `mx.eval` (dispatch, the kernel and the wait).

Implementations, each called as bench-operators calls it: custom (`decode_attention_custom`),
ext-direct (`_ext.decode_attention`, no Python wrapper), mlx (`mx.fast.scaled_dot_product_attention`),
add (`mx.add`, a trivial MLX op: the floor), and custom-donated / mlx-donated, whose query is made
in the same graph (q * 2, as a decode step's q is) so that the op may write over it.

With --old-wrapper REV, custom@REV is decode_attention_custom as attention.py had it at REV (on
the same extension): the Python wrapper's cost before and after a change, in one run.

Protocol: rounds rotate the implementations' order (every implementation in every position
equally often); dispatch and eval samples of an implementation follow one untimed call of it (so
MLX's CUDA graph cache holds its kernel, as in a decode loop), and are synchronized before the
next. Every sample is kept; medians and p10/p90 are printed, and with --json the samples too.

    python3 tools/host_cost.py [--context 1 --context 128] [--rounds 40] [--old-wrapper REV]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import subprocess
import tempfile
import time

import mlx.core as mx
from attn_kernels import _ext, decode_attention_custom
from llm_eval.operators import implementation_orders
from llm_eval.record import SCHEMA_VERSION, collect_metadata, write_record

WRAPPER = "packages/attn-kernels/src/attn_kernels/attention.py"


def wrapper_at(rev: str):
    """decode_attention_custom as attention.py defined it at git revision `rev` (same _ext)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{WRAPPER}"], check=True, capture_output=True, text=True
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"attention_{rev}", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention_custom


def implementations(scale: float, old_wrapper: str | None) -> dict:
    custom = lambda q, k, v: decode_attention_custom(q, k, v, scale=scale, mask=None)  # noqa: E731
    mlx = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)  # noqa: E731
    old = {}
    if old_wrapper:
        wrapper = wrapper_at(old_wrapper)
        old[f"custom@{old_wrapper}"] = lambda q, k, v: wrapper(q, k, v, scale=scale, mask=None)
    return {
        **old,
        "custom": custom,
        "ext-direct": lambda q, k, v: _ext.decode_attention(q, k, v, scale, None, False, "auto"),
        "mlx": mlx,
        "add": lambda q, k, v: mx.add(q, q),
        "custom-donated": lambda q, k, v: custom(q * 2, k, v),
        "mlx-donated": lambda q, k, v: mlx(q * 2, k, v),
    }


def build_sample(fn, args, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - start) / calls / 1e3


def dispatch_sample(fn, args) -> float:
    mx.eval(fn(*args))  # untimed: the same kernel in the graph cache
    mx.synchronize()
    start = time.perf_counter_ns()
    out = fn(*args)
    mx.async_eval(out)
    took = (time.perf_counter_ns() - start) / 1e3
    mx.eval(out)
    mx.synchronize()
    return took


def eval_sample(fn, args) -> float:
    mx.eval(fn(*args))  # untimed: the same kernel in the graph cache
    mx.synchronize()
    start = time.perf_counter_ns()
    mx.eval(fn(*args))
    return (time.perf_counter_ns() - start) / 1e3


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "median_us": statistics.median(s),
        "p10_us": s[len(s) // 10],
        "p90_us": s[9 * len(s) // 10],
        "n": len(s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, action="append", help="S (repeatable; default 1, 128)")
    p.add_argument("--rounds", type=int, default=40, help="rotated rounds per measurement")
    p.add_argument("--calls", type=int, default=200, help="calls per construction sample")
    p.add_argument(
        "--evals",
        type=int,
        default=3,
        help="dispatch and eval samples per implementation and round",
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--gqa-ratio", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--old-wrapper",
        metavar="REV",
        help="also time decode_attention_custom as attention.py had it at git revision REV",
    )
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args()
    scale = 1.0 / math.sqrt(args.head_dim)
    fns = implementations(scale, args.old_wrapper)
    orders = implementation_orders(list(fns))
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": "host-cost",
        "metadata": collect_metadata(device),
        "config": vars(args),
        "execution_order": [],
        "results": {},
    }
    for context in args.context or [1, 128]:
        q = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(mx.bfloat16)
        k, v = (
            mx.random.normal((1, args.heads // args.gqa_ratio, context, args.head_dim)).astype(
                mx.bfloat16
            )
            for _ in range(2)
        )
        mx.eval(q, k, v)
        build = {n: [] for n in fns}
        dispatch = {n: [] for n in fns}
        evals = {n: [] for n in fns}
        for fn in fns.values():  # warm-up: first calls resolve kernels, fill caches
            mx.eval(fn(q, k, v))
            build_sample(fn, (q, k, v), args.calls)
        for r in range(args.rounds):
            order = orders[r % len(orders)]
            record["execution_order"].append({"context": context, "round": r, "order": list(order)})
            for name in order:
                build[name].append(build_sample(fns[name], (q, k, v), args.calls))
            for name in order:
                fn = fns[name]
                dispatch[name].extend(dispatch_sample(fn, (q, k, v)) for _ in range(args.evals))
                evals[name].extend(eval_sample(fn, (q, k, v)) for _ in range(args.evals))
        result = {"build": {}, "dispatch": {}, "eval": {}}
        for kind, samples in (("build", build), ("dispatch", dispatch), ("eval", evals)):
            for name, s in samples.items():
                result[kind][name] = {**summary(s), "samples_us": s}
                t = result[kind][name]
                print(
                    f"S={context:<6} {kind:8} {name:14} median {t['median_us']:7.2f} us "
                    f"(p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f}, n {t['n']})"
                )
        record["results"][f"S={context}"] = result
    if args.json:
        print(f"wrote {write_record(record, args.json, force=True)}")


if __name__ == "__main__":
    main()
