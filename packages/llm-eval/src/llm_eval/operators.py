"""bench-operators: attention operator sweeps, implementations interleaved in one run.

Protocol: for each pass over the shapes (forward, then reverse, alternating), each shape's
implementations are warmed up with `--warmup` untimed samples (the same batched eval as a timed
one: through MLX's CUDA backend the first eval of a new batch builds its graph, and warm-up calls
evaluated one by one left that to the first timed sample, up to 17x the others), then timed
`--iterations` times; iteration i runs them in the i-th of all their orders (every order equally
often), so drift and cache effects fall on every implementation alike. A sample is the wall time
of `--calls-per-eval` calls evaluated together, divided by that count: independent calls
(throughput; MLX may overlap them on a GPU), or with `--chain` each call's query the previous
call's output (latency, as the layers of a decode step wait on each other). Every sample is kept;
medians, spread and per-pass wins are derived from them. Each time is reported with GB/s of K+V
read and the fraction of the bandwidth floor (K+V bytes / measured or given read bandwidth).

With --fresh-inputs a sample is one call in its own mx.eval on q/K/V buffers that no call has read
before (what a decode step sees: its inputs are new arrays), as MLX ops make them: per shape the
cache is cleared, then one copy per implementation and iteration is made and kept alive until
the shape is done (so the allocator cannot hand a buffer back), then every copy is used once in
rotated order ("first use"), then once more in the same order ("repeat use"). On MLX's CUDA
backend this exposes any copy into unified memory an op makes the first time it reads a buffer.

With --kv-bits, K and V are also quantized (mx.quantize, mlx-lm's QuantizedKVCache layout) for
the implementations custom-quantized (attn_kernels.decode_attention_quantized) and
mlx-lm-quantized (mlx_lm's quantized_scaled_dot_product_attention) and readable-quantized
(mx.dequantize, then the readable path: qwen3-model's fallback); their GB/s and floor count
the quantized bytes (codes, scales and biases), the others' the K+V bytes in --dtype.

With --batch B the calls attend B sequences at once (a decode step of B requests); with --ragged
their lengths differ, as in a serving batch: row b holds its own length (drawn between S/4 and S)
at the end of the cache, left-padded as mlx-lm's batch caches are. The fused op reads each row's
range (starts=); mlx and readable take the equivalent boolean (B, 1, L, S) mask, as mlx-lm's
batch generation gives them. GB/s and the floor then count the rows' own positions.

PyTorch's CPU attention is an optional peer (`pip install 'llm-eval[torch]'`, or any torch >= 2.5
in the same environment): `--implementations ...,torch,torch-float32` times
`torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` in this process, on
copies of the inputs in --dtype (torch) and in float32 (torch-float32: twice the bytes, but
PyTorch's fastest CPU path), with torch's default intra-op threads.

    bench-operators --device cpu --context 1024 --context 4096        # ours against mx.fast
    bench-operators --device gpu --chain --attention-mask causal --query-length 8 --context 131072
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from attn_kernels import (
    SCHEDULES,
    _ext,
    decode_attention_custom,
    range_mask,
    scaled_dot_product_attention,
)

from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    positive_float,
    refuse_overwrite,
    write_record,
)

IMPLEMENTATIONS = ("readable", "custom", "mlx", "torch", "torch-float32")
DEFAULT_IMPLEMENTATIONS = ("readable", "custom", "mlx")
QUANTIZED_IMPLEMENTATIONS = ("custom-quantized", "mlx-lm-quantized", "readable-quantized")
# H200 HBM3e copy rate measured with MLX (shared/gpu-kit/README.md); CPUs are measured in-run.
DEFAULT_GPU_BANDWIDTH_GBS = 4300.0
# Calls per timed eval unless --calls-per-eval says otherwise (bench-coverage's default too).
CALLS_PER_EVAL = {"cpu": 1, "gpu": 50}


class TorchAttention:
    """PyTorch's scaled_dot_product_attention on torch copies of one shape's inputs (made once,
    outside the timing). Called with mx arrays it reads its copies; with a torch query (--chain:
    the previous call's output) it uses that."""

    def __init__(self, dtype_name: str, scale: float, mask, inputs):
        import numpy as np
        import torch
        from attn_kernels.attention import causal_mask

        self.torch, self.scale = torch, scale
        self.dtype = getattr(torch, dtype_name)
        q, k, v = inputs

        def copy(a):
            return torch.from_numpy(np.array(a.astype(mx.float32))).to(self.dtype)

        self.q, self.k, self.v = copy(q), copy(k), copy(v)
        if isinstance(
            mask, str
        ):  # "causal", bottom-right aligned as ours (torch's is_causal is not)
            self.mask = torch.from_numpy(np.array(causal_mask(q.shape[2], k.shape[2])))
        elif mask is not None:
            self.mask = copy(mask)
        else:
            self.mask = None

    def __call__(self, q, k, v):
        query = q if isinstance(q, self.torch.Tensor) else self.q
        with self.torch.inference_mode():
            return self.torch.nn.functional.scaled_dot_product_attention(
                query, self.k, self.v, attn_mask=self.mask, scale=self.scale, enable_gqa=True
            )


def implementation(
    name: str, scale: float, mask, inputs=None, dtype_name: str = "bfloat16", ranges=None
):
    """fn(q, k, v) of one implementation. ranges: (starts, mask) where the rows have their own
    ranges: the fused op reads starts with that mask (None or "causal"), the others take `mask`,
    the boolean mask the ranges stand for."""
    if ranges is not None and (name == "custom" or name.startswith("custom:")):
        starts, own_mask = ranges
        schedule = name.partition(":")[2] or "auto"
        return lambda q, k, v: decode_attention_custom(
            q, k, v, scale=scale, mask=own_mask, starts=starts, schedule=schedule
        )
    if name == "torch":
        return TorchAttention(dtype_name, scale, mask, inputs)
    if name == "torch-float32":
        return TorchAttention("float32", scale, mask, inputs)
    if name == "readable":
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if name == "custom" or name.startswith("custom:"):
        schedule = name.partition(":")[2] or "auto"
        return lambda q, k, v: decode_attention_custom(
            q, k, v, scale=scale, mask=mask, schedule=schedule
        )
    if name == "mlx":
        return lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    raise ValueError(f"unknown implementation {name!r}")


def quantized_implementation(name: str, scale: float, mask, keys, values, group_size, bits):
    """A quantized implementation as fn(q, k, v): it reads the quantized triples instead of k, v."""
    if name == "custom-quantized":
        from attn_kernels import decode_attention_quantized

        return lambda q, _k, _v: decode_attention_quantized(
            q, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits
        )
    if name == "readable-quantized":  # qwen3-model's fallback: dequantise, then the readable path

        def readable(q, _k, _v):
            k, v = (
                mx.dequantize(*t, group_size=group_size, bits=bits).astype(q.dtype)
                for t in (keys, values)
            )
            return scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        return readable
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    return lambda q, _k, _v: quantized_scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits
    )


def implementation_orders(names: list[str]) -> list[tuple[str, ...]]:
    """All orders for up to three implementations; beyond that every cyclic rotation forward and
    reversed, so each implementation takes each position equally often."""
    if len(names) <= 3:
        return list(itertools.permutations(names))
    rotations = [tuple(names[i:] + names[:i]) for i in range(len(names))]
    return rotations + [tuple(reversed(r)) for r in rotations]


def make_shape(
    context, query_length, heads, gqa_ratio, head_dim, mask_kind, dtype, seed, batch: int = 1
):
    kv_heads = heads // gqa_ratio
    keys = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((batch, heads, query_length, head_dim), key=keys[0]).astype(dtype)
    k = mx.random.normal((batch, kv_heads, context, head_dim), key=keys[1]).astype(dtype)
    v = mx.random.normal((batch, kv_heads, context, head_dim), key=keys[2]).astype(dtype)
    if mask_kind == "explicit":
        mask = mx.random.normal((batch, heads, query_length, context), key=keys[3]).astype(dtype)
    elif mask_kind == "causal":
        mask = "causal"
    else:
        mask = None
    mx.eval(q, k, v)
    if isinstance(mask, mx.array):
        mx.eval(mask)
    return q, k, v, mask


def ragged_starts(batch: int, context: int, query_length: int, seed: int) -> mx.array:
    """--ragged rows' first positions: row b holds a length drawn between S/4 and S (at least L)
    at the end of the cache (left padding, as mlx-lm's batch caches lay rows out); row 0 the
    whole cache."""
    lengths = mx.random.randint(
        max(context // 4, query_length, 1), context + 1, (batch,), key=mx.random.key(seed + 7)
    )
    lengths[0] = context
    starts = (context - lengths).astype(mx.int32)
    mx.eval(starts)
    return starts


def _evaluate(results) -> None:
    """mx.eval on MLX results; PyTorch's have been computed by the call itself."""
    mx.eval([r for r in results if isinstance(r, mx.array)])


def time_sample(fn, args, calls: int, chain: bool = False) -> float:
    start = time.perf_counter()
    if chain:
        q, k, v = args
        for _ in range(calls):
            q = fn(q, k, v)
        _evaluate([q])
    else:
        _evaluate([fn(*args) for _ in range(calls)])
    return (time.perf_counter() - start) / calls


def fresh_copies(q, k, v, count: int) -> list[tuple]:
    """`count` (q, k, v) copies in buffers of their own (made by MLX ops, evaluated)."""
    copies = [(q * 1, k * 1, v * 1) for _ in range(count)]
    mx.eval(copies)
    return copies


def time_one_call(fn, args) -> float:
    mx.synchronize()
    start = time.perf_counter()
    _evaluate([fn(*args)])
    return time.perf_counter() - start


def time_fresh(fns: dict, q, k, v, iterations: int, orders: list) -> tuple[dict, dict, list]:
    """First-use and repeat-use samples (seconds) per implementation, and the orders run."""
    mx.clear_cache()
    copies = {name: fresh_copies(q, k, v, iterations) for name in fns}
    first = {n: [] for n in fns}
    repeat = {n: [] for n in fns}
    ran = []
    for samples in (first, repeat):
        for it in range(iterations):
            order = orders[it % len(orders)]
            for name in order:
                samples[name].append(time_one_call(fns[name], copies[name][it]))
            if samples is first:
                ran.append(list(order))
    return first, repeat, ran


def peak_bytes(fn, args) -> int | None:
    """Memory an implementation allocates beyond its inputs, for one call (None: not MLX's)."""
    if isinstance(fn, TorchAttention):
        return None
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(fn(*args))
    return max(0, mx.get_peak_memory() - before)


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {
        "median_us": statistics.median(samples) * 1e6,
        "p10_us": pick(0.10) * 1e6,
        "p90_us": pick(0.90) * 1e6,
        "min_us": ordered[0] * 1e6,
        "n": len(samples),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-operators",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--section", choices=["attention"], default="attention")
    p.add_argument(
        "--context",
        type=int,
        action="append",
        help="cached context S (repeatable; default 128, 1024, 4096, 16384)",
    )
    p.add_argument("--query-length", type=int, action="append", help="query length L (repeatable)")
    p.add_argument("--heads", type=int, default=32, help="query heads (Qwen3-4B: 32)")
    p.add_argument("--gqa-ratio", type=int, default=4, help="query heads per KV head (Qwen3-4B: 4)")
    p.add_argument("--head-dim", type=int, default=128, metavar="D", help="1-256 (default 128)")
    p.add_argument(
        "--batch", type=int, default=1, help="sequences per call (B; a decode step's requests)"
    )
    p.add_argument(
        "--ragged",
        action="store_true",
        help="rows of different lengths (see above): the fused op reads each row's range, the "
        "others a mask",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--attention-mask", choices=["none", "causal", "explicit"], default="none")
    p.add_argument(
        "--implementations",
        default=",".join(DEFAULT_IMPLEMENTATIONS),
        help="comma-separated subset of "
        + ",".join(IMPLEMENTATIONS + QUANTIZED_IMPLEMENTATIONS)
        + " (the quantized ones need --kv-bits; torch, torch-float32: PyTorch's CPU attention in "
        "--dtype and in float32, needs llm-eval[torch])",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="also quantize K/V (mx.quantize) for custom-quantized and mlx-lm-quantized",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=[32, 64, 128],
        default=64,
        help="quantization group size with --kv-bits (mlx-lm's default: 64)",
    )
    p.add_argument(
        "--schedule",
        action="append",
        help="time the custom kernel with this GPU schedule (repeatable; one of "
        + ", ".join(SCHEDULES)
        + "); each becomes implementation custom:NAME",
    )
    p.add_argument(
        "--context-repeats",
        type=int,
        default=1,
        help="passes over the shapes, alternating forward and reverse order",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed samples (each --calls-per-eval calls, chained with --chain) per "
        "implementation, shape and pass, before the timed ones",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed samples per implementation, shape and pass; a multiple of the "
        "number of implementation orders (default: that number, times 2 on GPU)",
    )
    p.add_argument(
        "--calls-per-eval",
        type=int,
        default=None,
        help="calls per timed mx.eval (default 1 on CPU, 50 on GPU)",
    )
    p.add_argument(
        "--chain",
        action="store_true",
        help="each call's query is the previous call's output (dependent calls: latency)",
    )
    p.add_argument(
        "--fresh-inputs",
        action="store_true",
        help="one call per mx.eval on q/K/V buffers no call has read before, then once more on "
        "the same buffers (first use against repeat use; see above); not with --chain or "
        "--calls-per-eval",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default="gpu" if mx.cuda.is_available() or mx.metal.is_available() else "cpu",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        default=None,
        help="read bandwidth for the floor (default: on CPU the best of the read rates measured "
        "before the first and after every pass; 4300 on the H200)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_record_args(p)
    args = p.parse_args(argv)
    if not 1 <= args.head_dim <= 256:
        p.error(f"--head-dim must be in 1..256 (the kernels' range), got {args.head_dim}")
    args.context = args.context or [128, 1024, 4096, 16384]
    args.query_length = args.query_length or [1]
    args.implementations = [s for s in args.implementations.split(",") if s]
    for name in args.implementations:
        if name in QUANTIZED_IMPLEMENTATIONS and args.kv_bits is None:
            p.error(f"--implementations: {name} needs --kv-bits 4 or 8")
        if name not in IMPLEMENTATIONS + QUANTIZED_IMPLEMENTATIONS:
            p.error(
                f"--implementations: unknown {name!r} (choose from "
                f"{', '.join(IMPLEMENTATIONS + QUANTIZED_IMPLEMENTATIONS)})"
            )
    if "mlx-lm-quantized" in args.implementations and args.attention_mask == "explicit":
        p.error("mlx-lm-quantized takes --attention-mask none or causal")
    if any(name.startswith("torch") for name in args.implementations):
        try:
            import torch
        except ImportError:
            p.error(
                "--implementations torch/torch-float32 need PyTorch: pip install 'llm-eval[torch]'"
            )
        if args.device != "cpu":
            p.error("--implementations torch/torch-float32: PyTorch's peer runs on --device cpu")
        args.torch_version = torch.__version__
        args.torch_threads = torch.get_num_threads()
        if args.fresh_inputs:
            p.error("--fresh-inputs: the torch peers read their own copies of one input set")
    if args.schedule:
        for name in args.schedule:
            if name not in SCHEDULES:
                p.error(f"--schedule: unknown {name!r} (choose from {', '.join(SCHEDULES)})")
        args.implementations = [n for n in args.implementations if n != "custom"] + [
            f"custom:{name}" for name in args.schedule
        ]
    orders = len(implementation_orders(args.implementations))
    if args.iterations is None:
        args.iterations = orders * (2 if args.device == "gpu" else 1)
    if args.iterations <= 0 or args.iterations % orders:
        p.error(f"--iterations must be a positive multiple of {orders} (the implementation orders)")
    if args.fresh_inputs and (args.chain or args.calls_per_eval not in (None, 1)):
        p.error("--fresh-inputs times one call per eval: drop --chain and --calls-per-eval")
    if args.calls_per_eval is None:
        args.calls_per_eval = 1 if args.fresh_inputs else CALLS_PER_EVAL[args.device]
    if args.heads % args.gqa_ratio:
        p.error(f"--heads {args.heads} is not a multiple of --gqa-ratio {args.gqa_ratio}")
    if any(s < 1 for s in args.context) or any(q < 1 for q in args.query_length):
        p.error("--context and --query-length must be positive")
    if args.attention_mask == "causal" and any(
        q > s for q in args.query_length for s in args.context
    ):
        p.error("causal masks need every --query-length <= every --context")
    if args.context_repeats < 1:
        p.error("--context-repeats must be >= 1")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    if args.ragged and (args.attention_mask == "explicit" or args.kv_bits or args.fresh_inputs):
        p.error("--ragged takes --attention-mask none or causal, no --kv-bits, no --fresh-inputs")
    if args.ragged and any(n.startswith("torch") for n in args.implementations):
        p.error("--ragged: the torch peers take no ranges")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def run(args) -> dict:
    device = mx.gpu if args.device == "gpu" else mx.cpu
    mx.set_default_device(device)
    dtype = getattr(mx, args.dtype)
    # On the CPU the floor is the best read rate measured in the run (before the first pass and
    # after every pass): one measurement on a busy VM would put the floor too low.
    read_rates: list[float] = []
    if args.bandwidth_gbs is None:
        if args.device == "gpu":
            args.bandwidth_gbs = DEFAULT_GPU_BANDWIDTH_GBS
        else:
            print("measuring CPU read bandwidth ...", file=sys.stderr)
            read_rates.append(_ext.measure_read_bandwidth(1 << 30, 5) / 1e9)
    if args.device == "cpu":  # which compiled path of the CPU kernel ran, and on how many threads
        args.cpu_kernel_path = _ext.cpu_path()
        args.cpu_threads = _ext.cpu_threads()
    scale = 1.0 / math.sqrt(args.head_dim)
    orders = implementation_orders(args.implementations)
    shapes = [(s, q) for q in args.query_length for s in args.context]
    results: dict[str, dict] = {}
    execution_order = []
    progress = Progress(args.context_repeats * len(shapes))
    for rep in range(args.context_repeats):
        pass_shapes = shapes if rep % 2 == 0 else shapes[::-1]
        for context, query_length in pass_shapes:
            key = f"S={context},L={query_length}"
            q, k, v, mask = make_shape(
                context,
                query_length,
                args.heads,
                args.gqa_ratio,
                args.head_dim,
                args.attention_mask,
                dtype,
                args.seed,
                args.batch,
            )
            ranges, valid = None, None
            if args.ragged:
                starts = ragged_starts(args.batch, context, query_length, args.seed)
                ranges = (starts, mask)
                mask = range_mask(args.batch, query_length, context, starts, None, mask is not None)
                mx.eval(mask)
                valid = (context - starts).sum().item()
            quantized = None
            if args.kv_bits:
                quantized = [
                    mx.quantize(x, group_size=args.kv_group_size, bits=args.kv_bits) for x in (k, v)
                ]
                mx.eval(quantized)
            fns = {
                name: quantized_implementation(
                    name, scale, mask, *quantized, args.kv_group_size, args.kv_bits
                )
                if name in QUANTIZED_IMPLEMENTATIONS
                else implementation(name, scale, mask, (q, k, v), args.dtype, ranges)
                for name in args.implementations
            }
            entry = results.setdefault(
                key,
                {
                    "context": context,
                    "query_length": query_length,
                    # the rows' own positions with --ragged: what a kernel must read
                    "kv_bytes": 2 * k.nbytes * (valid / (args.batch * context) if valid else 1),
                    **({"valid_positions": valid} if valid else {}),
                    "kv_quantized_bytes": sum(a.nbytes for t in quantized for a in t)
                    if quantized
                    else None,
                    "samples_us": {n: [] for n in fns},
                    **({"repeat_samples_us": {n: [] for n in fns}} if args.fresh_inputs else {}),
                    "passes": [],
                    "peak_extra_bytes": {},
                },
            )
            for name, fn in fns.items():
                for _ in range(args.warmup):
                    time_sample(fn, (q, k, v), args.calls_per_eval, args.chain)
                if name not in entry["peak_extra_bytes"]:
                    entry["peak_extra_bytes"][name] = peak_bytes(fn, (q, k, v))
            if args.fresh_inputs:
                pass_samples, repeat, ran = time_fresh(fns, q, k, v, args.iterations, orders)
                for n, s in repeat.items():
                    entry["repeat_samples_us"][n].extend(x * 1e6 for x in s)
                execution_order += [{"pass": rep, "shape": key, "order": o} for o in ran]
            else:
                pass_samples = {n: [] for n in fns}
                for it in range(args.iterations):
                    order = orders[it % len(orders)]
                    for name in order:
                        pass_samples[name].append(
                            time_sample(fns[name], (q, k, v), args.calls_per_eval, args.chain)
                        )
                    execution_order.append({"pass": rep, "shape": key, "order": list(order)})
            medians = {n: statistics.median(s) * 1e6 for n, s in pass_samples.items()}
            entry["passes"].append(
                {"pass": rep, "median_us": medians, "winner": min(medians, key=medians.get)}
            )
            for n, s in pass_samples.items():
                entry["samples_us"][n].extend(x * 1e6 for x in s)
            progress.step(f"pass {rep} {key}")
        if read_rates:
            read_rates.append(_ext.measure_read_bandwidth(1 << 30, 5) / 1e9)
    if read_rates:
        args.bandwidth_gbs = max(read_rates)
        args.read_rates_gbs = read_rates
    floor_gbs = args.bandwidth_gbs
    for entry in results.values():
        floor_us = entry["kv_bytes"] / (floor_gbs * 1e9) * 1e6
        entry["floor_us"] = floor_us
        entry["summary"] = {}
        if entry.get("kv_quantized_bytes"):
            entry["floor_quantized_us"] = entry["kv_quantized_bytes"] / (floor_gbs * 1e9) * 1e6
        for name, samples in entry["samples_us"].items():
            s = summarize([x / 1e6 for x in samples])
            quantized = name in QUANTIZED_IMPLEMENTATIONS
            read = entry["kv_quantized_bytes"] if quantized else entry["kv_bytes"]
            s["gbs"] = read / (s["median_us"] * 1e-6) / 1e9
            s["floor_fraction"] = (entry["floor_quantized_us"] if quantized else floor_us) / s[
                "median_us"
            ]
            s["pass_wins"] = sum(p["winner"] == name for p in entry["passes"])
            if "repeat_samples_us" in entry:
                r = summarize([x / 1e6 for x in entry["repeat_samples_us"][name]])
                s["repeat_use"] = r
                s["first_over_repeat"] = s["median_us"] / r["median_us"]
            entry["summary"][name] = s
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "operator-sweep",
        "metadata": collect_metadata(args.device),
        "config": config,
        "execution_order": execution_order,
        "results": results,
    }


def format_table(record: dict) -> str:
    names = record["config"]["implementations"]
    customs = [n for n in names if n.startswith("custom")]
    others = [n for n in names if not n.startswith("custom")]
    head = "| S | L | floor µs | " + " | ".join(f"{n} µs (GB/s, floor %)" for n in names)
    head += "".join(f" | {c} vs {o}" for c in customs for o in others)
    fresh = record["config"].get("fresh_inputs", False)
    if fresh:  # the main columns are first use; then repeat use (first / repeat)
        head += "".join(f" | {n} repeat-use µs (first/repeat)" for n in names)
    head += " |"
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for entry in record["results"].values():
        sm, passes = entry["summary"], entry["passes"]
        floor = f"{entry['floor_us']:.2f}"
        if entry.get("floor_quantized_us"):
            floor += f" / {entry['floor_quantized_us']:.2f} quantized"
        row = f"| {entry['context']} | {entry['query_length']} | {floor} | "
        row += " | ".join(
            f"{sm[n]['median_us']:.1f} ({sm[n]['gbs']:.0f}, {100 * sm[n]['floor_fraction']:.0f}%)"
            for n in names
        )
        for c in customs:
            for o in others:
                wins = sum(p["median_us"][c] < p["median_us"][o] for p in passes)
                ratio = sm[o]["median_us"] / sm[c]["median_us"]
                row += f" | {ratio:.2f}x (wins {wins}/{len(passes)})"
        if fresh:
            row += "".join(
                f" | {sm[n]['repeat_use']['median_us']:.1f} ({sm[n]['first_over_repeat']:.2f})"
                for n in names
            )
        lines.append(row + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    print(
        f"device {args.device}, {args.dtype}, B={args.batch}{' ragged' if args.ragged else ''}, "
        f"Hq={args.heads}, Hkv={args.heads // args.gqa_ratio}, "
        f"D={args.head_dim}, mask={args.attention_mask}, floor at {args.bandwidth_gbs:.1f} GB/s, "
        f"{args.iterations} samples x {args.context_repeats} passes, {args.calls_per_eval} "
        f"{'chained' if args.chain else 'independent'} calls/eval"
        + (", fresh inputs: first use, then repeat use" if args.fresh_inputs else "")
    )
    print(format_table(record))
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
