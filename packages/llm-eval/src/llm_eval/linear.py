"""bench-linear: a decode step's linear layers, ours against MLX's own, interleaved.

Shapes: a model's projections (--model: q/k/v and gate/up fused as qwen3_model runs them, o,
down and the LM head) or --shape NxK (repeatable). Formats (--format, repeatable): bf16, f16,
f32 weights, and q4 / q8 (mx.quantize's affine codes, --group-size, activations bf16). Rows
(--rows, repeatable): the tokens of a decode step (1), a speculative verify or a batch (2-8).

Implementations: ours (attn_kernels.decode_linear / decode_linear_quantized) and mlx (x @ W.T,
mx.quantized_matmul: what nn.Linear and nn.QuantizedLinear run), and, with PyTorch installed,
torch (torch.nn.functional.linear on the same dense weights, its default intra-op threads).

Protocol: a decode step reads every weight once, from DRAM, so each sample's call reads one of
several copies of the weights, rotated past the last-level cache (--weights-mb of them in all).
Per (shape, format, rows) the implementations are warmed up, then timed --iterations times, the
i-th iteration in the i-th of their orders (every order equally often); every sample is kept.
GB/s counts the weights' bytes as stored (codes, scales and biases); the floor is those bytes at
the read rate the kernel's threads measure (best of the runs before and after).

On a GPU (--device gpu: NVIDIA, quantized formats): a sample is one evaluation of --batch
calls, each on the next copy of the weights and its input computed from the one before's output
(a decode step's chain), its time divided by the calls (launches included), less the two small
kernels that chain them (timed alone each iteration: `glue_us`); the floor is the rate MLX's sum
reads a 1 GiB array.

    bench-linear --model qwen3-0.6b --format bf16 --format q4 --rows 1 --rows 8
    bench-linear --device gpu --model qwen3-4b --format q4 --rows 1 --rows 8 --rows 32
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import mlx.core as mx
import qwen3_model
from attn_kernels import _ext, decode_linear, decode_linear_quantized

from llm_eval import bench
from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    refuse_overwrite,
    write_record,
)

FORMATS = {
    "bf16": (mx.bfloat16, 0),
    "f16": (mx.float16, 0),
    "f32": (mx.float32, 0),
    "q4": (mx.bfloat16, 4),
    "q8": (mx.bfloat16, 8),
}
IMPLEMENTATIONS = ("ours", "mlx", "torch")


def model_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of a decode step of the built-in config, as qwen3_model runs
    it: q/k/v and gate/up fused into one matmul each."""
    a = qwen3_model.CONFIGS[name]
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    return {
        "qkv": (q + 2 * kv, a.hidden_size),
        "o": (a.hidden_size, q),
        "gate_up": (2 * a.intermediate_size, a.hidden_size),
        "down": (a.hidden_size, a.intermediate_size),
        "lm_head": (a.vocab_size, a.hidden_size),
    }


def layer_shape(text: str) -> tuple[int, int]:
    """A layer's "NxK" (outputs x inputs) as (N, K); ValueError saying what is wrong."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError("expected NxK, e.g. 6144x1024") from None
    if n < 1 or k < 1:
        raise ValueError("N and K must be positive")
    return n, k


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-linear",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device", choices=["cpu", "gpu"], default="cpu", help="where the layers run (cpu)"
    )
    p.add_argument(
        "--model", metavar="NAME", help=", ".join(qwen3_model.CONFIGS) + " (default qwen3-0.6b)"
    )
    p.add_argument("--shape", action="append", metavar="NxK", help="outputs x inputs (repeatable)")
    p.add_argument(
        "--format", action="append", choices=list(FORMATS), help="repeatable (default bf16, q4)"
    )
    p.add_argument(
        "--rows", action="append", type=int, metavar="M", help="repeatable (default 1, 8)"
    )
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument(
        "--implementations",
        default="ours,mlx",
        help="comma-separated: ours, mlx, torch (default ours,mlx)",
    )
    p.add_argument("--iterations", type=int, default=4, metavar="N", help="timed samples each (4)")
    p.add_argument("--batch", type=int, default=16, metavar="N", help="calls per GPU sample (16)")
    p.add_argument(
        "--weights-mb", type=int, default=512, metavar="MB", help="weight copies rotated (512)"
    )
    add_record_args(p, help="the record (default: benchmark_results/)", path_dest="output")
    p.add_argument("--no-record", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.model and args.shape:
        p.error("give --model or --shape, not both")
    if args.model and args.model not in qwen3_model.CONFIGS:
        p.error(f"--model: unknown {args.model!r} (choose from {', '.join(qwen3_model.CONFIGS)})")
    shapes = {}
    for text in args.shape or []:
        try:
            n, k = layer_shape(text)
        except ValueError as e:
            p.error(f"--shape {text!r}: {e}")
        shapes[f"{n}x{k}"] = (n, k)
    args.shapes = shapes or model_shapes(args.model or "qwen3-0.6b")
    gpu = args.device == "gpu"
    args.format = list(dict.fromkeys(args.format or (["q4"] if gpu else ["bf16", "q4"])))
    args.rows = list(dict.fromkeys(args.rows or ([1, 2, 4, 8, 16, 32] if gpu else [1, 8])))
    if gpu and any(not FORMATS[f][1] for f in args.format):
        p.error("--device gpu: quantized formats only (q4, q8): dense weights run MLX's matmul")
    if gpu and args.batch < 1:
        p.error("--batch must be >= 1")
    if any(m < 1 for m in args.rows):
        p.error("--rows must be >= 1")
    for fmt in args.format:
        if FORMATS[fmt][1] and any(k % args.group_size for _, k in args.shapes.values()):
            p.error(f"--format {fmt}: --group-size {args.group_size} must divide every K")
    args.implementations = [s.strip() for s in args.implementations.split(",") if s.strip()]
    unknown = [s for s in args.implementations if s not in IMPLEMENTATIONS]
    if unknown or not args.implementations:
        p.error(f"--implementations: unknown {unknown} (choose from {', '.join(IMPLEMENTATIONS)})")
    if gpu and "torch" in args.implementations:
        p.error("--implementations torch: CPU only")
    orders = len(list(itertools.permutations(args.implementations)))
    if args.iterations < 1 or args.iterations % orders:
        p.error(f"--iterations must be a positive multiple of {orders} (every order equally often)")
    refuse_overwrite(
        p, args.output if args.output and args.output.suffix == ".json" else None, args.force
    )
    return args


class Weights:
    """One copy of a layer's weights in a format: dense (N, K) or mx.quantize's triple."""

    def __init__(self, n: int, k: int, fmt: str, group_size: int, key):
        dtype, bits = FORMATS[fmt]
        w = (mx.random.normal((n, k), key=key) / k**0.5).astype(dtype)
        self.bits, self.group_size = bits, group_size
        self.arrays = mx.quantize(w, group_size=group_size, bits=bits) if bits else (w,)
        mx.eval(self.arrays)
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.torch = None

    def caller(self, name: str, x: mx.array):
        """A function of x (an mx.array like `x`) making the call, or None where `name` has no
        kernel for this format. Torch's inputs are ready beforehand: its copies of the weights
        (once per copy) and of `x` are made here, outside the timing, and its call ignores the
        argument."""
        if name == "ours":
            if self.bits:
                return lambda x: decode_linear_quantized(
                    x, *self.arrays, group_size=self.group_size, bits=self.bits
                )
            return lambda x: decode_linear(x, self.arrays[0])
        if name == "mlx":
            if self.bits:
                return lambda x: mx.quantized_matmul(
                    x, *self.arrays, transpose=True, group_size=self.group_size, bits=self.bits
                )
            return lambda x: x @ self.arrays[0].T
        if self.bits:
            return None  # PyTorch has no kernel for this layout
        import numpy as np
        import torch

        if self.torch is None:
            w = np.array(self.arrays[0].astype(mx.float32))
            self.torch = torch.from_numpy(w).to(
                getattr(torch, str(self.arrays[0].dtype).split(".")[-1])
            )
        xt = torch.from_numpy(np.array(x.astype(mx.float32))).to(self.torch.dtype)

        def call(_):
            with torch.inference_mode():
                return torch.nn.functional.linear(xt, self.torch)

        return call


def time_call(weights: list[Weights], name: str, x: mx.array) -> float | None:
    """Seconds a call takes: one call per copy in `weights` (one on the CPU, --batch on a GPU),
    evaluated together, the time divided by the calls. Each call's x is computed from the
    previous call's output (chained_input), as a decode step's projections wait for each other:
    independent calls in one graph may run side by side on a GPU, which flatters a kernel whose
    grid does not fill it."""
    calls = [w.caller(name, x) for w in weights]
    if calls[0] is None:
        return None
    start = time.perf_counter()
    outs, inp = [], x
    for call in calls:
        outs.append(call(inp))
        if isinstance(outs[-1], mx.array) and len(calls) > 1:
            inp = chained_input(x, outs[-1])
    mx.eval([out for out in outs if isinstance(out, mx.array)])
    return (time.perf_counter() - start) / len(calls)


def chained_input(x: mx.array, previous: mx.array) -> mx.array:
    """x's values, computed by ops that read `previous`: the next call cannot start before the
    previous one ends. (mx.depends does not order them on CUDA: MLX orders a graph's kernels by
    the buffers they read and write and depends writes none, so its "chained" calls ran side by
    side: a step's 144 quantized matmuls at 8 rows took 2.8 ms against 12.6 ms with each
    input computed from the previous output, H100; docs/serving-cuda.md.) Two small kernels a
    call, timed alone as the glue (time_glue) and taken off both implementations."""
    return x + 0 * previous[..., :1]


def time_glue(calls: int, x: mx.array) -> float:
    """Seconds a call's chained_input takes in a chain of `calls` of them alone."""
    start = time.perf_counter()
    inp = x
    for _ in range(calls):
        inp = chained_input(x, inp)
    mx.eval(inp)
    return (time.perf_counter() - start) / calls


def run(args, progress: Progress | None = None) -> dict:
    gpu = args.device == "gpu"
    mx.set_default_device(mx.gpu if gpu else mx.cpu)
    progress = progress or Progress()
    if "torch" in args.implementations:
        try:
            import torch  # noqa: F401
        except ImportError as err:
            raise SystemExit(
                "bench-linear: --implementations torch needs PyTorch (pip install torch)"
            ) from err
    metadata = collect_metadata(args.device)
    measure = bench.gpu_read_bandwidth if gpu else lambda: _ext.measure_read_bandwidth(1 << 30, 3)
    read = [measure()]
    batch = args.batch if gpu else 1
    orders = list(itertools.permutations(args.implementations))
    cases = list(itertools.product(args.shapes.items(), args.format, args.rows))
    progress.restart(len(cases))
    results, order_log, key = {}, [], mx.random.key(0)
    for (label, (n, k)), fmt, rows in cases:
        key, wkey, xkey = mx.random.split(key, 3)
        first = Weights(n, k, fmt, args.group_size, wkey)
        copies = max(2, min(64, (args.weights_mb << 20) // first.nbytes))
        copy_keys = mx.random.split(wkey, copies)
        sets = [first] + [
            Weights(n, k, fmt, args.group_size, copy_keys[i]) for i in range(1, copies)
        ]
        x = mx.random.normal((rows, k), key=xkey).astype(FORMATS[fmt][0])
        mx.eval(x)
        samples = {name: [] for name in args.implementations}
        glue = []  # chained_input's own time per call (GPU chains), taken off every sample
        if "torch" in args.implementations:  # torch's copies of every weight copy, made first
            for w in sets:
                w.caller("torch", x)
        for name in args.implementations:  # warm-up: one sample each (on copies read last)
            time_call(sets[-batch:], name, x)
        if batch > 1:
            time_glue(batch, x)
        turn = 0
        for it in range(args.iterations):
            order_log.append(
                {"case": f"{label},{fmt},M={rows}", "order": list(orders[it % len(orders)])}
            )
            for name in orders[it % len(orders)]:
                t = time_call([sets[(turn + j) % copies] for j in range(batch)], name, x)
                turn += batch
                if t is not None:
                    samples[name].append(t)
            if batch > 1:
                glue.append(time_glue(batch, x))
        glue_s = statistics.median(glue) if glue else 0.0
        summary = {}
        for name, ts in samples.items():
            if not ts:
                continue
            med = statistics.median(ts) - glue_s
            summary[name] = {
                "median_us": med * 1e6,
                "min_us": (min(ts) - glue_s) * 1e6,
                "gbs": first.nbytes / med / 1e9,
            }
        if "ours" in summary:
            for s in summary.values():
                s["vs_ours"] = s["median_us"] / summary["ours"]["median_us"]
        results[f"{label},{fmt},M={rows}"] = {
            "layer": label,
            "outputs": n,
            "inputs": k,
            "format": fmt,
            "rows": rows,
            "weight_bytes": first.nbytes,
            "copies": copies,
            "samples_us": {name: [t * 1e6 for t in ts] for name, ts in samples.items()},
            "glue_us": [t * 1e6 for t in glue],  # per call, in samples_us, off the summary's
            "summary": summary,
        }
        del sets
        progress.step(f"{label} {fmt} M={rows}")
    read.append(measure())
    bandwidth = max(read) / 1e9
    for entry in results.values():
        for s in entry["summary"].values():
            s["floor_fraction"] = s["gbs"] / bandwidth
    progress.close()
    config = {k: v for k, v in vars(args).items() if k not in ("output", "shapes")}
    config["shapes"] = {label: list(nk) for label, nk in args.shapes.items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "linear-bench",
        "metadata": metadata,
        "config": config,
        "execution_order": order_log,
        "results": {"read_bandwidth_gbs": bandwidth, "cases": results},
    }


def format_table(record: dict) -> str:
    names = record["config"]["implementations"]
    head = "| layer | N x K | format | M | " + " | ".join(f"{n} µs (GB/s, of floor)" for n in names)
    head += " | mlx / ours |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for e in record["results"]["cases"].values():
        cells = []
        for n in names:
            s = e["summary"].get(n)
            cells.append(
                f"{s['median_us']:.0f} ({s['gbs']:.1f}, {100 * s['floor_fraction']:.0f}%)"
                if s
                else "-"
            )
        ratio = e["summary"].get("mlx", {}).get("vs_ours")
        lines.append(
            f"| {e['layer']} | {e['outputs']} x {e['inputs']} | {e['format']} | {e['rows']} | "
            + " | ".join(cells)
            + (f" | {ratio:.1f}x |" if ratio else " | - |")
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    where = record["metadata"]["device"]
    print(
        f"{args.device} ({where.get('gpu' if args.device == 'gpu' else 'cpu', '?')}), read rate "
        f"{record['results']['read_bandwidth_gbs']:.1f} GB/s, {args.iterations} samples each"
    )
    print(format_table(record))
    if not args.no_record:
        if args.output and args.output.suffix == ".json":
            path = args.output
        else:
            folder = args.output or bench.find_results_dir()
            stem = (
                f"{bench.machine_tag(args.device)}-{args.model or 'shapes'}-linear-mlx-"
                f"{mx.__version__}"
            )
            path = bench.unique_path(folder, stem)
        print(f"wrote {write_record(record, path, force=args.force)}")


if __name__ == "__main__":
    sys.exit(main())
