"""bench-host-cost: host time per attention call (docs/host-cost.md), at one of two levels.

--level op (default): our op against mx.fast, in three parts:
- build: constructing the lazy op (Python wrapper, nanobind, the C++ op), nothing evaluated;
  the mean of --calls calls per sample.
- dispatch: build plus `mx.async_eval` (on a GPU: eval_gpu, the CUDA graph update and launch;
  on the CPU: eval_cpu's hand-off to the stream thread), not waiting for the result.
- eval: one call in its own `mx.eval` (dispatch, the kernel and the wait).
Implementations, each called as bench-operators calls it: custom (`decode_attention_custom`),
ext-direct (`_ext.decode_attention`, no Python wrapper), mlx (`mx.fast.scaled_dot_product_attention`),
add (`mx.add`, a trivial MLX op: the floor), and custom-donated / mlx-donated, whose query is made
in the same graph (q * 2, as a decode step's q is) so that the op may write over it. With
--old-wrapper REV, custom@REV is decode_attention_custom as attention.py had it at REV (on the
same extension): the Python wrapper's cost before and after a change, in one run. Dispatch and
eval samples of an implementation follow one untimed call of it (so MLX's CUDA graph cache holds
its kernel, as in a decode loop), and are synchronized before the next.

--level mlx-lm-attention: the host time to build one call of mlx-lm's Qwen3 attention module
(its projections, the attention and o_proj; nothing evaluated): mlx-lm as it is, with
attn_kernels.mlx_lm.enable(fused_step=False) (the attention call alone) and with enable() (the
fused step) (docs/mlx-lm.md). One Qwen3-4B-shaped layer (hidden 2560, 32 query heads, 8 KV
heads, D=128, bf16), one token at offset --context in a KVCache whose buffers are evaluated; a
sample is the mean over --calls calls (the cache's buffers and offset reset outside the timing).

--level mlx-lm-linear: the host time to build one call of a 4-bit nn.QuantizedLinear (group 64,
--linear-shape NxK, default Phi-3-mini's q/k/v 9216x3072) on one row of bf16 x, nothing
evaluated: MLX's own forward against enable()'s wrapped one, which a one-row step pays on each of
its ~130-250 linear calls.

All: rounds rotate the order (every variant in every position equally often); every sample is
kept, medians and p10/p90 printed, and written with --json-output.

    bench-host-cost [--context 1 --context 128] [--rounds 40] [--old-wrapper REV]
    bench-host-cost --level mlx-lm-attention [--context 1000] [--rounds 20]
    bench-host-cost --level mlx-lm-linear [--linear-shape 9216x3072] [--rounds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import attn_kernels.mlx_lm as kernel
import mlx.core as mx
import mlx.nn as nn
import qwen3_model
from attn_kernels import _ext, decode_attention_custom
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

from llm_eval.linear import layer_shape
from llm_eval.operators import implementation_orders
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    refuse_overwrite,
    write_record,
)

WRAPPER = "packages/attn-kernels/src/attn_kernels/attention.py"


def wrapper_at(rev: str):
    """decode_attention_custom as attention.py defined it at git revision `rev` (same _ext)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{WRAPPER}"],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,  # REV:PATH is read from the repository's root
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


def op_build_sample(fn, args, calls: int) -> float:
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


MODULE_VARIANTS = {
    "mlx-lm": contextlib.nullcontext,
    "mlx-lm+kernel-attention-only": lambda: kernel.enabled(fused_step=False),
    "mlx-lm+kernel": kernel.enabled,
}
# One Qwen3-4B layer (the built-in config; the vocabulary does not matter here).
QWEN3_4B_LAYER = {**qwen3_model.CONFIGS["qwen3-4b"].to_dict(), "num_hidden_layers": 1}


def module_build_sample(attn, x, cache, buffers, context: int, calls: int) -> float:
    """Mean seconds to build one attention call (the cache reset outside the timing)."""
    total = 0.0
    for _ in range(calls):
        cache.keys, cache.values = buffers
        cache.offset = context
        start = time.perf_counter()
        out = attn(x, mask=None, cache=cache)
        total += time.perf_counter() - start
        del out
    return total / calls


def rotated_rounds(variants: dict, sample, rounds: int) -> tuple[dict, list]:
    """`sample()` (µs) of every variant, each inside its context, over `rounds` rounds in rotated
    orders; the samples per variant and the order each round ran in."""
    samples = {name: [] for name in variants}
    orders = implementation_orders(list(variants))
    execution = []
    for r in range(rounds):
        order = list(orders[r % len(orders)])
        execution.append({"round": r, "order": order})
        for name in order:
            with variants[name]():
                samples[name].append(sample())
    return samples, execution


def summarized(samples: dict, width: int, per: str) -> dict:
    """Each variant's summary and samples, printed a line each."""
    results = {}
    for name, s in samples.items():
        results[name] = t = {**summary(s), "samples_us": s}
        print(
            f"{name:{width}} build median {t['median_us']:7.2f} us per {per} "
            f"(p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f}, n {t['n']})"
        )
    return results


def run_op(args) -> dict:
    scale = 1.0 / math.sqrt(args.head_dim)
    fns = implementations(scale, args.old_wrapper)
    orders = implementation_orders(list(fns))
    execution, results = [], {}
    for context in args.context:
        q = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(mx.bfloat16)
        kv_shape = (1, args.heads // args.gqa_ratio, context, args.head_dim)
        k, v = (mx.random.normal(kv_shape).astype(mx.bfloat16) for _ in range(2))
        mx.eval(q, k, v)
        build = {n: [] for n in fns}
        dispatch = {n: [] for n in fns}
        evals = {n: [] for n in fns}
        for fn in fns.values():  # warm-up: first calls resolve kernels, fill caches
            mx.eval(fn(q, k, v))
            op_build_sample(fn, (q, k, v), args.calls)
        for r in range(args.rounds):
            order = orders[r % len(orders)]
            execution.append({"context": context, "round": r, "order": list(order)})
            for name in order:
                build[name].append(op_build_sample(fns[name], (q, k, v), args.calls))
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
                    f"(p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f}, n {t['n']})",
                    flush=True,
                )
        results[f"S={context}"] = result
    return {"kind": "host-cost", "config": {}, "execution_order": execution, "results": results}


def run_mlx_lm_attention(args) -> dict:
    (context,) = args.context
    attn = qwen3.Attention(qwen3.ModelArgs.from_dict(QWEN3_4B_LAYER))
    attn.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 1, QWEN3_4B_LAYER["hidden_size"])).astype(mx.bfloat16)
    cache = KVCache()
    zeros = mx.zeros((1, QWEN3_4B_LAYER["num_key_value_heads"], context, 128), mx.bfloat16)
    cache.update_and_fetch(zeros, zeros)
    buffers = (cache.keys, cache.values)
    mx.eval(attn.parameters(), x, *buffers)
    warmup_calls = {}
    for name, variant in MODULE_VARIANTS.items():  # warm-up, and the proof each took its path
        with variant():
            module_build_sample(attn, x, cache, buffers, context, args.calls)
            calls = kernel.calls() if name != "mlx-lm" else None
        print(f"{name}: attention calls in the warm-up {calls}")
        path = {"mlx-lm+kernel-attention-only": "fused", "mlx-lm+kernel": "fused_step"}.get(name)
        if path and not calls[path]:
            raise SystemExit(f"{name} did not take its path (calls {calls}): outside the guard?")
        warmup_calls[name] = calls
    samples, execution = rotated_rounds(
        MODULE_VARIANTS,
        lambda: module_build_sample(attn, x, cache, buffers, context, args.calls) * 1e6,
        args.rounds,
    )
    results = summarized(samples, 28, "attention call")
    config = {"layer": QWEN3_4B_LAYER, "dtype": "bfloat16", "L": 1, "warmup_calls": warmup_calls}
    return {
        "kind": "mlx-lm-step-host-cost",
        "config": config,
        "execution_order": execution,
        "results": results,
    }


LINEAR_VARIANTS = {
    "mlx-lm": contextlib.nullcontext,
    "mlx-lm+kernel": lambda: kernel.enabled(linear=True),
}


def run_mlx_lm_linear(args) -> dict:
    """Host time to build one call of a 4-bit nn.QuantizedLinear (group 64) on one row of bf16
    x, the layer mlx-lm's quantized models call ~130-250 times a decode step: MLX's own forward
    against enable()'s wrapped one (the guard's questions, the layer's arrays, our op)."""
    n, k = args.linear_shape
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
    mx.eval(layer.parameters(), x)
    warmup_calls = {}
    for name, variant in LINEAR_VARIANTS.items():  # warm-up, and the proof each took its path
        with variant():
            mx.eval(layer(x))
            op_build_sample(layer, (x,), args.calls)
            calls = kernel.calls() if name != "mlx-lm" else None
        if calls is not None and not calls["linear"]:
            raise SystemExit(f"{name} did not route the layer (calls {calls}): outside the guard?")
        warmup_calls[name] = calls
    samples, execution = rotated_rounds(
        LINEAR_VARIANTS, lambda: op_build_sample(layer, (x,), args.calls), args.rounds
    )
    results = summarized(samples, 14, f"{n}x{k} layer call")
    config = {"shape": [n, k], "bits": 4, "group_size": 64, "dtype": "bfloat16", "rows": 1,
              "warmup_calls": warmup_calls}  # fmt: skip
    return {
        "kind": "mlx-lm-linear-host-cost",
        "config": config,
        "execution_order": execution,
        "results": results,
    }


LEVELS = {
    "op": run_op,
    "mlx-lm-attention": run_mlx_lm_attention,
    "mlx-lm-linear": run_mlx_lm_linear,
}
DEFAULTS = {  # per level: contexts, rounds, calls per build sample
    "op": ([1, 128], 40, 200),
    "mlx-lm-attention": ([1000], 20, 100),
    "mlx-lm-linear": ([1], 20, 1000),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench-host-cost", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--level", choices=list(LEVELS), default="op", help="what one call is")
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's default device")
    p.add_argument(
        "--context",
        type=int,
        action="append",
        help="S (repeatable; op: default 1 and 128; mlx-lm-attention: one, default 1000)",
    )
    p.add_argument("--rounds", type=int, help="rotated rounds (op: default 40, mlx-lm-*: 20)")
    p.add_argument(
        "--calls", type=int, help="calls per build sample (op: 200, attention 100, linear 1000)"
    )
    p.add_argument(
        "--evals", type=int, default=3, help="op: dispatch and eval samples per round (default 3)"
    )
    p.add_argument("--heads", type=int, default=32, help="op: query heads (default 32)")
    p.add_argument("--gqa-ratio", type=int, default=4, help="op: query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128, help="op: D (default 128)")
    p.add_argument(
        "--linear-shape",
        metavar="NxK",
        help="mlx-lm-linear: the layer's outputs x inputs (default 9216x3072, K a multiple of 64)",
    )
    p.add_argument(
        "--old-wrapper",
        metavar="REV",
        help="op: also time decode_attention_custom as attention.py had it at git revision REV",
    )
    add_record_args(p, help="write the record (every sample) here")
    args = p.parse_args(argv)
    contexts, rounds, calls = DEFAULTS[args.level]
    args.context = args.context or contexts
    args.rounds = args.rounds if args.rounds is not None else rounds
    args.calls = args.calls if args.calls is not None else calls
    if min(args.context) < 1 or args.rounds < 1 or args.calls < 1 or args.evals < 1:
        p.error("--context, --rounds, --calls and --evals must be >= 1")
    if args.level == "mlx-lm-attention" and len(args.context) != 1:
        p.error("--level mlx-lm-attention takes one --context")
    if args.level != "op" and args.old_wrapper:
        p.error("--old-wrapper: only with --level op")
    if args.level != "mlx-lm-linear" and args.linear_shape:
        p.error("--linear-shape: only with --level mlx-lm-linear")
    try:
        args.linear_shape = layer_shape(args.linear_shape or "9216x3072")
    except ValueError as e:
        p.error(f"--linear-shape {args.linear_shape!r}: {e}")
    if args.linear_shape[1] % 64:
        p.error(f"--linear-shape {args.linear_shape}: K must be a multiple of 64 (the group)")
    if args.heads < 1 or args.gqa_ratio < 1 or args.heads % args.gqa_ratio:
        p.error(f"--heads {args.heads} must be a positive multiple of --gqa-ratio {args.gqa_ratio}")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = LEVELS[args.level](args)
    if args.json_output:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": out["kind"],
            "metadata": collect_metadata(device),
            "config": {**config, **out["config"]},
            "execution_order": out["execution_order"],
            "results": out["results"],
        }
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
