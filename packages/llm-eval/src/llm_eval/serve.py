"""bench-serve: many requests decoded together, as a server batches them, in ONE process on the
same random weights: mlx-lm's BatchGenerator (what mlx_lm.server and batch_generate run), the same
with attn_kernels.mlx_lm.enable(), and qwen3_model's BatchGenerator (batch_generate's).

The request mix: --requests N prompts of seeded random lengths between --prompt-min and
--prompt-max tokens, --new-tokens each, all submitted at once; --slots B of them decode at once
(repeatable: one series per batch size; mlx-lm's completion_batch_size, its prefill batch
min(8, B)). Every variant runs the whole mix once per round, the variant order rotated each round
(bench's rule), after an untimed warm-up round of a few short requests.

Per variant and batch size, from every call of the generator's next(), timed (all samples kept):
  decode tok/s   tokens returned by calls that prefilled nothing / their time (steady decoding)
  ms per step    median time of those calls, and their mean (a pipelined generator's calls can
                 alternate between waiting for one step and two: then only the mean is a step)
  e2e tok/s      all generated tokens / the wall time of the whole mix (prefill included)
  TTFT, ITL      time to a request's first token from submission, between its tokens (p50/p99)
  floor          a step must read every weight and the K/V of its requests' contexts: the time
                 of those bytes at --bandwidth-gbs (measured on a CPU, 4300 GB/s on an H200, MLX's
                 sum of 1 GiB on another GPU), over the decode calls' time (the fraction reached)
  cache copies   K/V caches the fused steps copied instead of writing in place (0 when the
                 loop donates them; each copy is a whole layer's cache)
  memory         MLX's peak allocations during the run and its buffer cache after it (GB); per
                 call (active_gb, cache_gb) its allocations and buffer cache after the call
  waited         per call of ours, the seconds its reads waited for the device, and beside it
                 (built_s, encoded_s) building the next step's graph and MLX's encoding of it
                 (which waits for the device too where MLX's command buffers in flight are at its
                 cap); the rest of a call prefills or hands out tokens
Greedy tokens: each request's against mlx-lm's in the same round (counted, not asserted: bf16
roundings of the paths differ and can flip near-ties).

    bench-serve --model qwen3-4b --quantize 4bit --slots 8 --slots 32 --rounds 3

With --anatomy, what one decode step of our generator is made of, per batch size, at --context
positions per row (the mix's mean context by default): the whole step (forward and sampling)
with the rows folded into one row's positions for the linear layers (Model.fold_rows, the
default) and without; the graph building alone (host time); a synchronous step's build, encode
(async_eval's return: MLX encoding every op) and wait, and the step pipelined as generate_step
runs it; the primitives in one step's graph; the caches those steps copied instead of updating
in place (0 expected); the attention steps alone (one layer's, times the layers), the same as
two kernels (CUDA's fold off) and the attention op alone over the same rows; each quantized
projection on (B, 1, K) and on (1, B, K), through our kernel (decode_linear, whatever the
guard's limits), and with its weights dequantised to bf16, as a step runs it: one call a layer,
each layer's weights, each input computed from the previous output (bench-linear's
chained_input, its kernels timed alone and taken off). --anatomy-only
skips the serving runs (one process per MLX setting, e.g. MLX_USE_CUDA_GRAPHS=0).

With --kernel-trace (a GPU with Nsight Compute), every kernel of --trace-steps synchronous decode
steps of ours at each --slots, under ncu in a child process (llm_eval.kernel_trace): each
kernel's device time and launch shape, totals by kernel per step, against the step's wall time
timed in the same child before the traced range. No serving runs; a record of its own.

Records under benchmark_results/ (the nearest such folder upwards) or --output.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import qwen3_model
from attn_kernels import (
    _ext,
    attention_step_cache_copies,
    decode_linear,
    decode_linear_quantized,
    guard,
)
from attn_kernels.cuda_backend import managed_outputs
from qwen3_model.batch import DeviceLengths
from qwen3_model.generate import own_stream

from llm_eval import bench, kernel_trace
from llm_eval.linear import chained_input
from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    at_least,
    collect_metadata,
    positive_float,
    write_record,
)

MLX_LM, MLX_LM_KERNEL, OURS = "mlx-lm", "mlx-lm+kernel", "ours"
VARIANTS = [MLX_LM, MLX_LM_KERNEL, OURS]
# On request: ours with the MLP's SwiGLU as MLX's op before down_proj, not inside its CPU kernel
# (Model.set_swiglu_in_linear(False); an A/B of that fusion).
OURS_SWIGLU_APART = "ours-swiglu-apart"
# On request: ours with the guard's row limit for decode_linear raised to the slots, every decode
# step's projections through our kernel (an A/B of guard.LINEAR_LIMITS at the batch's rows).
OURS_LINEAR_ALL_ROWS = "ours-linear-all-rows"
# On request: ours on a new stream with MLX's CUDA graph limits (a commit every 100 kernels or
# 1000 MB on sm_90), not its batch_stream()'s (guard.BATCH_GRAPH_LIMITS: a step a graph).
OURS_MLX_GRAPHS = "ours-mlx-graphs"
# On request: ours and enable() with our CUDA ops' outputs in MLX's managed memory
# (output_memory(device=False)), not the extension's device memory (the A/B).
OURS_MANAGED, MLX_LM_KERNEL_MANAGED = "ours-managed-outputs", "mlx-lm+kernel-managed-outputs"
MANAGED_VARIANTS = (OURS_MANAGED, MLX_LM_KERNEL_MANAGED)
OUR_VARIANTS = (OURS, OURS_SWIGLU_APART, OURS_LINEAR_ALL_ROWS, OURS_MLX_GRAPHS, OURS_MANAGED)
# On request: mlx-lm's generator under enable(linear=False), its attention alone fused (the A/B
# of enable()'s linear routing: every call on a CPU, the batched decode steps on CUDA).
MLX_LM_ATTENTION = "mlx-lm+attention"
# On request: mlx-lm's generator under enable() with the guard's row limit raised to the slots
# (the same A/B as ours-linear-all-rows).
MLX_LM_KERNEL_ALL_ROWS = "mlx-lm+kernel-linear-all-rows"
KERNEL_VARIANTS = (
    MLX_LM_KERNEL,
    MLX_LM_ATTENTION,
    MLX_LM_KERNEL_ALL_ROWS,
    MLX_LM_KERNEL_MANAGED,
)
DEFAULTS = {
    "gpu": dict(model="qwen3-4b", quantize="4bit", requests=32, prompt=(256, 2048), new=64),
    # A CPU prefills bf16 at ~5 tok/s (MLX's matmul, 2 vCPUs): short prompts keep a run to minutes.
    "cpu": dict(model="qwen3-0.6b", quantize="none", requests=8, prompt=(8, 32), new=8),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="built-in config, random weights: " + ", ".join(qwen3_model.CONFIGS),
    )
    p.add_argument(
        "--quantize",
        choices=["none", *qwen3_model.QUANTIZATIONS],
        help="the weights (default per device)",
    )
    p.add_argument("--requests", type=at_least(1), metavar="N", help="requests in the mix")
    p.add_argument("--prompt-min", type=at_least(1), metavar="N", help="shortest prompt (tokens)")
    p.add_argument("--prompt-max", type=at_least(1), metavar="N", help="longest prompt (tokens)")
    p.add_argument(
        "--new-tokens", type=at_least(2), metavar="N", help="tokens generated per request"
    )
    p.add_argument(
        "--slots",
        type=at_least(1),
        action="append",
        metavar="B",
        help="requests decoded at once (repeatable; default 8 and 32 on a GPU, 4 on a CPU)",
    )
    p.add_argument(
        "--variant",
        action="append",
        choices=[
            *VARIANTS,
            OURS_SWIGLU_APART,
            OURS_LINEAR_ALL_ROWS,
            OURS_MLX_GRAPHS,
            MLX_LM_ATTENTION,
            MLX_LM_KERNEL_ALL_ROWS,
            *MANAGED_VARIANTS,
        ],
        help="repeatable; default the first three (ours-swiglu-apart: ours with the MLP's "
        "SwiGLU as MLX's op before the down projection, not inside its CPU kernel; "
        "ours-linear-all-rows: ours with every decode step's projections through decode_linear, "
        "the guard's row limit raised to the slots; ours-mlx-graphs: ours on a stream with "
        "MLX's own CUDA graph limits (several graphs a step); mlx-lm+attention: "
        "enable(linear=False), mlx-lm's attention fused and its linear layers left to MLX; "
        "mlx-lm+kernel-linear-all-rows: enable() with that raised limit; ours-managed-outputs, "
        "mlx-lm+kernel-managed-outputs: our CUDA ops' outputs in MLX's managed memory, not the "
        "extension's device memory)",
    )
    p.add_argument("--rounds", type=at_least(1), default=2, metavar="N", help="timed rounds (2)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if bench.has_gpu() else "cpu")
    p.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        metavar="GB/s",
        help="memory read bandwidth for the floor (default: measured on a CPU, 4300 on an H200, "
        "the rate MLX's sum reads 1 GiB on another GPU)",
    )
    p.add_argument(
        "--anatomy",
        action="store_true",
        help="also time what a decode step of ours is made of, per batch size (see above)",
    )
    p.add_argument(
        "--anatomy-only",
        action="store_true",
        help="the anatomy alone, no serving runs (minutes less; e.g. under MLX's CUDA graph "
        "settings, MLX_USE_CUDA_GRAPHS / MLX_MAX_OPS_PER_BUFFER, one process each)",
    )
    p.add_argument(
        "--kernel-trace",
        action="store_true",
        help="each kernel of a few decode steps of ours per --slots, timed under Nsight Compute "
        "(see above)",
    )
    p.add_argument(
        "--trace-steps", type=at_least(1), default=2, metavar="N", help="steps traced (2)"
    )
    p.add_argument("--ncu", metavar="PATH", help="Nsight Compute's ncu (default: found)")
    p.add_argument("--trace-child", type=Path, help=argparse.SUPPRESS)  # the traced process
    p.add_argument(
        "--context",
        type=at_least(1),
        metavar="N",
        help="positions per row for --anatomy and --kernel-trace",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weights and prompts")
    add_record_args(p, help="the record's file (or a folder)", path_dest="output")
    p.add_argument("--no-record", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.device == "gpu" and not bench.has_gpu():
        p.error("--device gpu: this MLX has no GPU backend")
    d = DEFAULTS[args.device]
    args.model = args.model or d["model"]
    if args.model not in qwen3_model.CONFIGS:
        p.error(f"--model: unknown {args.model!r} (choose from {', '.join(qwen3_model.CONFIGS)})")
    args.quantize = args.quantize or d["quantize"]
    # None: not given (the types above refuse 0 and negatives)
    for name, value in (
        ("requests", d["requests"]),
        ("prompt_min", d["prompt"][0]),
        ("prompt_max", d["prompt"][1]),
        ("new_tokens", d["new"]),
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.slots = args.slots or ([8, 32] if args.device == "gpu" else [4])
    args.variant = list(dict.fromkeys(args.variant or VARIANTS))
    if args.prompt_min > args.prompt_max:
        p.error(f"--prompt-min {args.prompt_min} is above --prompt-max {args.prompt_max}")
    args.anatomy = args.anatomy or args.anatomy_only
    if args.kernel_trace and not args.trace_child:
        if args.device != "gpu" or not mx.cuda.is_available():
            p.error("--kernel-trace: needs MLX's CUDA backend (Nsight Compute times its kernels)")
        args.ncu = args.ncu or kernel_trace.ncu_path()
        if not args.ncu:
            p.error("--kernel-trace: no ncu on PATH or under /opt/nvidia; pass --ncu PATH")
    if args.output and args.output.is_file() and not args.force:
        p.error(f"--output {args.output} exists; pass --force to replace it")
    return args


def request_mix(args, vocab: int) -> list[list[int]]:
    key = mx.random.key(args.seed + 1)
    lengths = mx.random.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), key=key)
    return [
        bench.prompt_ids(vocab, int(n), mx.random.key(args.seed + 100 + i)).tolist()
        for i, n in enumerate(lengths.tolist())
    ]


class Drive:
    """One variant's generator over one request mix: next() as a server calls it, every call
    timed. Returns per call (seconds, prefilled?, [(uid, token)]), and the submission time."""

    def __init__(self, variant: str, model, twin, slots: int, new_tokens: int):
        self.variant, self.model, self.twin = variant, model, twin
        self.slots, self.new_tokens = slots, new_tokens

    def run(self, prompts: list[list[int]]):
        import attn_kernels.mlx_lm as kernel

        context = contextlib.ExitStack()
        if self.variant in KERNEL_VARIANTS:
            linear = False if self.variant == MLX_LM_ATTENTION else None
            context.enter_context(kernel.enabled(linear=linear))
        if self.variant in (OURS_LINEAR_ALL_ROWS, MLX_LM_KERNEL_ALL_ROWS):
            context.enter_context(linear_rows_up_to(self.slots))
        if self.variant in MANAGED_VARIANTS:
            context.enter_context(managed_outputs())
        copies = attention_step_cache_copies()
        mx.reset_peak_memory()
        with context:
            start = time.perf_counter()
            gen, step, uids = self._start(prompts)
            ours = self.variant in OUR_VARIANTS
            calls = []
            while True:
                t0 = time.perf_counter()
                before = host_times(gen) if ours else None
                prefilled, tokens = step(gen)
                # ours: where the call's time went (waiting for the step's tokens, building
                # and encoding the next step; the rest prefills or hands out tokens)
                parts = _deltas(before, host_times(gen)) if ours else None
                seconds = time.perf_counter() - t0
                # MLX's allocations and buffer cache after the call: where the cache drains, its
                # blocks were freed back to CUDA (a managed block's cudaFree waits for the device)
                memory = (mx.get_active_memory(), mx.get_cache_memory())
                calls.append((t0, seconds, prefilled, tokens, parts, memory))
                if not tokens and not prefilled:
                    break
            if self.variant not in OUR_VARIANTS:
                gen.close()
            fused = kernel.calls()["fused_step"] if self.variant in KERNEL_VARIANTS else None
        memory = {"peak_memory_gb": mx.get_peak_memory() / 1e9,
                  "buffer_cache_gb": mx.get_cache_memory() / 1e9}  # fmt: skip
        return start, uids, calls, fused, attention_step_cache_copies() - copies, memory

    def _start(self, prompts):
        if self.variant in OUR_VARIANTS:
            self.model.set_swiglu_in_linear(self.variant != OURS_SWIGLU_APART)
            # a stream of its own, made once, left at MLX's graph limits
            stream = own_stream("mlx-graphs") if self.variant == OURS_MLX_GRAPHS else None
            gen = qwen3_model.BatchGenerator(
                self.model, slots=self.slots, max_tokens=self.new_tokens, stream=stream
            )
            uids = gen.insert(prompts)

            def step(g):
                before = g.stats.prompt_tokens
                responses = g.next()
                return g.stats.prompt_tokens > before, [(r.uid, r.token) for r in responses]

            return gen, step, uids
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(
            self.twin,
            max_tokens=self.new_tokens,
            completion_batch_size=self.slots,
            prefill_batch_size=min(8, self.slots),
        )
        uids = gen.insert(prompts, max_tokens=[self.new_tokens] * len(prompts))

        def step(g):
            prompt_responses, responses = g.next()
            return bool(prompt_responses), [(r.uid, r.token) for r in responses]

        return gen, step, uids


def host_times(gen) -> dict[str, float]:
    """Our BatchGenerator's running totals: waiting for steps' tokens, building and encoding."""
    stats = gen.stats
    return {"waited_s": stats.decode_time, "built_s": stats.build_time,
            "encoded_s": stats.encode_time}  # fmt: skip


def _deltas(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


@contextlib.contextmanager
def linear_rows_up_to(rows: int):
    """The guard's decode_linear limits on this backend, their row limit raised to `rows`."""
    backend = guard.backend()
    saved = guard.LINEAR_LIMITS[backend]
    guard.LINEAR_LIMITS[backend] = (max(rows, saved[0]), saved[1])
    try:
        yield
    finally:
        guard.LINEAR_LIMITS[backend] = saved


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(run_result, prompts, weight_bytes: int, kv_per_position: int, bandwidth_gbs) -> dict:
    """One round of one variant: the samples and what they give (see the module doc)."""
    start, uids, calls, fused, copies, memory = run_result
    index = {uid: i for i, uid in enumerate(uids)}
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    stamps: dict[int, list[float]] = {uid: [] for uid in uids}
    decode_s = decode_tokens = floor_s = 0.0
    decode_steps = []
    for t0, seconds, prefilled, emitted, _, _ in calls:
        end = t0 + seconds
        kv_positions = 0
        for uid, token in emitted:
            tokens[uid].append(token)
            stamps[uid].append(end)
            kv_positions += len(prompts[index[uid]]) + len(tokens[uid])
        if emitted and not prefilled:
            decode_s += seconds
            decode_tokens += len(emitted)
            decode_steps.append(seconds)
            if bandwidth_gbs:
                floor_s += (weight_bytes + kv_positions * kv_per_position) / (bandwidth_gbs * 1e9)
    wall = calls[-1][0] + calls[-1][1] - start
    ttft = [stamps[u][0] - start for u in uids if stamps[u]]
    itl = [b - a for u in uids for a, b in zip(stamps[u], stamps[u][1:], strict=False)]
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens": [tokens[u] for u in uids],
        "calls": [
            {
                "seconds": s,
                "prefilled": p,
                "emitted": len(e),
                **(w or {"waited_s": None}),
                "active_gb": m[0] / 1e9,
                "cache_gb": m[1] / 1e9,
            }
            for _, s, p, e, w, m in calls
        ],
        "generated": generated,
        "wall_s": wall,
        "e2e_tok_s": generated / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "median_step_ms": statistics.median(decode_steps) * 1e3 if decode_steps else None,
        "mean_step_ms": statistics.fmean(decode_steps) * 1e3 if decode_steps else None,
        "ttft_ms": [t * 1e3 for t in ttft],
        "itl_ms_p50": (percentile(itl, 0.5) or 0) * 1e3,
        "itl_ms_p99": (percentile(itl, 0.99) or 0) * 1e3,
        "ttft_ms_p50": (percentile(ttft, 0.5) or 0) * 1e3,
        "ttft_ms_p99": (percentile(ttft, 0.99) or 0) * 1e3,
        "floor_fraction": floor_s / decode_s if decode_s and bandwidth_gbs else None,
        "floor_tok_s": decode_tokens / floor_s if floor_s else None,
        "fused_steps": fused,
        # caches the fused steps copied instead of writing in place (0 in a donating loop)
        "cache_copies": copies,
        # MLX's allocations at their peak during the run, and its buffer cache after it
        **memory,
    }


def summarise(samples: dict[str, list[dict]]) -> dict:
    out = {}
    for variant, rows in samples.items():
        m = {}
        for key in (
            "decode_tok_s", "e2e_tok_s", "median_step_ms", "mean_step_ms", "ttft_ms_p50",
            "ttft_ms_p99",
            "itl_ms_p50", "itl_ms_p99", "floor_fraction", "floor_tok_s",
        ):  # fmt: skip
            values = [r[key] for r in rows if r.get(key) is not None]
            m[key] = statistics.median(values) if values else None
        m["decode_tok_s_min"] = min(r["decode_tok_s"] or 0 for r in rows)
        m["decode_tok_s_max"] = max(r["decode_tok_s"] or 0 for r in rows)
        m["cache_copies"] = max(r["cache_copies"] for r in rows)
        out[variant] = m
    if MLX_LM in out:
        base = out[MLX_LM]["decode_tok_s"]
        for variant, m in out.items():
            m["vs_mlx_lm"] = m["decode_tok_s"] / base if base and m["decode_tok_s"] else None
            m["same_tokens_as_mlx_lm"] = [
                sum(a == b for a, b in zip(r["tokens"], mine["tokens"], strict=True))
                for r, mine in zip(samples[MLX_LM], samples[variant], strict=True)
            ]
    return out


def _powers_of_two_below(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i < n]


def _time(fn, repeats: int = 10, calls: int = 1) -> float:
    """Median seconds of one fn() call, `calls` of them evaluated together (a kernel's time, not
    an eval's), after two untimed rounds."""
    for _ in range(2):
        mx.eval([fn() for _ in range(calls)])
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def chain_ms(calls: list, x: mx.array) -> float:
    """Milliseconds of calls[0](x), ..., calls[-1] in one chain, each input computed from the
    previous output (chained_input), less the chaining kernels timed alone: what those calls cost
    a step. Independent calls in one evaluation run side by side on a GPU (and one layer's
    weights stay in its L2), which flatters a kernel that does not fill it (docs/serving-cuda.md)."""

    def chained(body):
        out, inp = None, x
        for call in calls:
            out = body(call, inp)
            inp = chained_input(x, out)
        return out

    total = _time(lambda: chained(lambda call, inp: call(inp)))
    glue = _time(lambda: chained(lambda call, inp: inp))
    return (total - glue) * 1e3


def step_phases(step, repeats: int = 12) -> dict:
    """Milliseconds of a synchronous step's host and device parts, medians: building the graph,
    encoding it (async_eval returns once MLX has encoded every op and launched its command
    graphs), waiting for the device; and a step pipelined as generate_step runs it (the next
    step built and encoded while this one runs): max(host, device) where the two overlap."""
    for _ in range(2):
        mx.eval(step())
    build, encode, wait = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = step()
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        wait.append(t3 - t2)
    y = step()
    mx.async_eval(y)
    start = time.perf_counter()
    for _ in range(repeats):
        following = step()
        mx.async_eval(following)
        mx.eval(y)
        y = following
    mx.eval(y)
    pipelined = (time.perf_counter() - start) / repeats
    return {
        "sync_build_ms": statistics.median(build) * 1e3,
        "sync_encode_ms": statistics.median(encode) * 1e3,
        "sync_wait_ms": statistics.median(wait) * 1e3,
        "pipelined_step_ms": pipelined * 1e3,
    }


def graph_ops(y: mx.array) -> dict[str, int]:
    """The primitives of the graph that computes y, by name (mx.export_to_dot's boxes), and their
    total: what the backend encodes each step."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "step.dot")
        mx.export_to_dot(str(path), y)
        names = collections.Counter(
            line.split('label ="')[1].split('"')[0]
            for line in path.read_text().splitlines()
            if "shape=rectangle" in line and 'label ="' in line
        )
    return {"total": sum(names.values()), **dict(names.most_common())}


def decode_fixture(model, rows: int, context: int):
    """A decode step of ours at `rows` rows of `context` positions, and its caches: a batch
    cache filled with random K/V, every row written at the same position each time, the rows'
    lengths on the device as BatchGenerator keeps them."""
    a = model.args
    lengths = [context] * rows
    on_device = DeviceLengths(lengths)
    cache = [qwen3_model.BatchKVCache(lengths, on_device) for _ in model.layers]
    shape = (rows, a.num_key_value_heads, context + 256, a.head_dim)
    for c in cache:
        c.keys = mx.random.normal(shape).astype(mx.bfloat16)
        c.values = mx.random.normal(shape).astype(mx.bfloat16)
    mx.eval([(c.keys, c.values) for c in cache])
    tokens = mx.random.randint(100, 1000, (rows, 1))

    def step():
        logits = model(tokens, cache)[:, -1, :]
        return mx.argmax(logits, axis=-1)

    return step, cache, lengths


def anatomy(model, rows: int, context: int) -> dict:
    """Milliseconds of one decode step's parts at `rows` rows of `context` positions (module
    doc)."""
    from attn_kernels import attention_step, decode_attention_custom

    a = model.args
    step, cache, lengths = decode_fixture(model, rows, context)
    out = {}
    copies = attention_step_cache_copies()
    for fold in (True, False):
        model.fold_rows = fold
        out["step_ms" if fold else "step_unfolded_ms"] = _time(step) * 1e3
    model.fold_rows = True
    start = time.perf_counter()
    built = [step() for _ in range(5)]
    out["host_build_ms"] = (time.perf_counter() - start) / 5 * 1e3
    mx.eval(built)
    out.update(step_phases(step))
    # Whole layers' caches the steps above copied instead of updating in place (0 expected).
    out["cache_copies"] = attention_step_cache_copies() - copies
    out["graph_ops"] = graph_ops(step())
    attn = model.layers[0].self_attn
    q = mx.random.normal((rows, 1, a.num_attention_heads * a.head_dim)).astype(mx.bfloat16)
    kv = mx.random.normal((rows, 1, a.num_key_value_heads * a.head_dim)).astype(mx.bfloat16)
    # As the model holds them: only the step's returned caches, updated in place (owned).
    held = [cache[0].keys, cache[0].values]
    cache[0].keys = cache[0].values = None
    on_device = cache[0].device_lengths.current()

    def attend(fold=None):
        out, held[0], held[1] = attention_step(
            q, kv, kv, attn.q_norm.weight, attn.k_norm.weight, *held, on_device,
            max_offset=max(lengths), eps=attn.eps, rope_base=attn.rope_base, scale=attn.scale,
            owned_caches=True, fold=fold,
        )  # fmt: skip
        return out

    def per_step_ms(fn):  # one layer's call, 20 to an eval, times the layers
        return _time(fn, calls=20) * 1e3 * len(model.layers)

    out["attention_ms"] = per_step_ms(attend)
    # The same step as two kernels (CUDA's fold off), and the attention op alone over the same
    # rows: what the step's preprocessing and cache write cost beside the attention itself.
    out["attention_unfolded_ms"] = per_step_ms(lambda: attend(fold=False))
    heads = mx.random.normal((rows, a.num_attention_heads, 1, a.head_dim)).astype(mx.bfloat16)
    ends = mx.array([n + 1 for n in lengths], dtype=mx.int32)
    out["attention_op_ms"] = per_step_ms(
        lambda: decode_attention_custom(heads, *held, scale=attn.scale, ends=ends)
    )
    # each projection over the layers, with its input width
    projections = {
        "qkv": (lambda layer: layer.self_attn.qkv, a.hidden_size),
        "o_proj": (lambda layer: layer.self_attn.o_proj, a.num_attention_heads * a.head_dim),
        "gate_up": (lambda layer: layer.mlp.gate_up, a.hidden_size),
        "down": (lambda layer: layer.mlp.down_proj, a.intermediate_size),
    }
    for name, (pick, width) in projections.items():
        layers = [pick(layer) for layer in model.layers]
        x = mx.random.normal((rows, 1, width)).astype(mx.bfloat16)
        # the same weights dequantised once, bf16 matmuls (what 4 times the bytes buys), and
        # through our kernel whatever the guard says (decode_linear / decode_linear_quantized)
        plain, ours = [], []
        for proj in layers:
            arrays = proj.arrays if hasattr(proj, "arrays") else proj
            w = arrays["weight"]
            if "scales" in arrays:
                s, b = arrays["scales"], arrays.get("biases")
                ours.append(lambda v, w=w, s=s, b=b, p=proj: decode_linear_quantized(
                    v, w, s, b, group_size=p.group_size, bits=p.bits))  # fmt: skip
                w = mx.dequantize(w, s, b, proj.group_size, proj.bits)
            else:
                ours.append(lambda v, w=w: decode_linear(v, w))
            plain.append(w)
        mx.eval(plain)
        out[f"{name}_ms"] = {
            "rows_as_batch": chain_ms(layers, x),
            "rows_as_positions": chain_ms(layers, x.reshape(1, rows, width)),
            "ours": chain_ms(ours, x.reshape(1, rows, width)),
            "bf16_weights": chain_ms(
                [lambda v, w=w: v @ w.T for w in plain], x.reshape(1, rows, width)
            ),
        }
        del plain
    x = mx.random.normal((rows, 1, a.hidden_size)).astype(mx.bfloat16)
    head = model.model.embed_tokens.as_linear if a.tie_word_embeddings else model.lm_head
    heads = 4  # one LM head a step: four chained calls, their mean
    out["lm_head_ms"] = {
        "rows_as_batch": chain_ms([head] * heads, x) / heads,
        "rows_as_positions": chain_ms([head] * heads, x.reshape(1, rows, -1)) / heads,
    }
    return out


def anatomy_context(args, prompts) -> int:
    """--context (else the mix's mean prompt) plus half the new tokens: a mid-decode step."""
    context = args.context or int(statistics.mean(len(p) for p in prompts))
    return context + args.new_tokens // 2


def trace_child(args) -> None:
    """Under ncu: time the step (outside the traced range), then trace --trace-steps of it."""
    import json

    mx.set_default_device(mx.gpu)
    model = qwen3_model.load(
        args.model, quantize=None if args.quantize == "none" else args.quantize, seed=args.seed
    )
    (rows,) = args.slots
    step, _, _ = decode_fixture(model, rows, args.context)
    timings = {
        "quantization": qwen3_model.describe_weights(model),
        "step_ms": _time(step) * 1e3,
        **step_phases(step),
    }
    with kernel_trace.profiled():
        for _ in range(args.trace_steps):
            mx.eval(step())
    args.trace_child.write_text(json.dumps(timings))


def trace_run(args, progress: Progress) -> dict:
    """One ncu child per batch size (module doc); the record of their kernels."""
    metadata = collect_metadata("gpu")
    prompts = request_mix(args, qwen3_model.CONFIGS[args.model].vocab_size)
    context = anatomy_context(args, prompts)
    results = {}
    progress.restart(len(args.slots))
    for slots in args.slots:

        def program(result, slots=slots):
            return [
                sys.executable, "-m", "llm_eval.serve", "--model", args.model,
                "--quantize", args.quantize, "--seed", str(args.seed), "--slots", str(slots),
                "--context", str(context), "--trace-steps", str(args.trace_steps),
                "--trace-child", str(result),
            ]  # fmt: skip

        kernels, timed = kernel_trace.run_traced(args.ncu, program, f"process at {slots} rows")
        results[f"slots={slots}"] = {
            "slots": slots,
            "context": context,
            "timed_under_ncu": timed,
            **kernel_trace.summarise(kernels, args.trace_steps),
        }
        progress.step(f"B={slots} traced")
    progress.close()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["mlx_environment"] = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    config["quantization"] = next(iter(results.values()))["timed_under_ncu"].pop("quantization")
    for series in results.values():
        series["timed_under_ncu"].pop("quantization", None)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "serve-kernel-trace",
        "metadata": metadata,
        "model_config": qwen3_model.CONFIGS[args.model].to_dict(),
        "config": config,
        "execution_order": [{"slots": s} for s in args.slots],
        "results": {"series": results},
    }


def format_trace(record: dict, top: int = 15) -> str:
    lines = []
    for series in record["results"]["series"].values():
        t = series["timed_under_ncu"]
        lines.append(
            f"{series['slots']} rows of {series['context']} positions: kernels "
            f"{series['kernel_ms_per_step']:.2f} ms a step ({series['kernels_per_step']:.0f} "
            f"kernels); the step {t['step_ms']:.2f} ms synchronous, "
            f"{t['pipelined_step_ms']:.2f} pipelined"
        )
        for k in series["by_name"][:top]:
            lines.append(
                f"  {k['ms_per_step']:7.3f} ms  {k['calls_per_step']:5.0f} x "
                f"{k['median_us']:8.1f} µs  {k['name'][:100]}"
            )
    return "\n".join(lines)


def run(args, progress: Progress | None = None) -> dict:
    progress = progress or Progress()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    metadata = collect_metadata(args.device)
    if args.bandwidth_gbs is None:
        if args.device == "cpu":
            progress.update("measuring the memory read bandwidth ...")
            args.bandwidth_gbs = _ext.measure_read_bandwidth(1 << 30, 3) / 1e9
        elif mx.cuda.is_available() and "H200" in bench.gpu_name():
            args.bandwidth_gbs = bench.H200_BANDWIDTH_GBS
        else:  # another GPU: the rate MLX's sum reads 1 GiB at
            args.bandwidth_gbs = bench.gpu_read_bandwidth() / 1e9
    progress.say(f"loading {args.model} (random weights, {args.quantize}) ...")
    model = qwen3_model.load(
        args.model, quantize=None if args.quantize == "none" else args.quantize, seed=args.seed
    )
    twin = bench.mlx_lm_twin(model)
    weight_bytes = qwen3_model.weight_bytes(model)
    kv_per_position = bench.kv_bytes_per_position(model)
    prompts = request_mix(args, model.args.vocab_size)
    # Every row count a run meets, once untimed: MLX's CUDA backend compiles a quantized matmul's
    # kernel the first time it meets a new tile of rows (seconds each; a first timed run once
    # spent 48 s there, and mlx-lm's batch shrinking to 16 and 8 rows at the end of the mix paid
    # 455 and 245 ms in a timed step). Full batches of each slot count and each power of two
    # below it cover the tiles of every count the batch shrinks through.
    progress.say("warming up")
    counts = sorted({n for slots in args.slots for n in (slots, *_powers_of_two_below(slots))})
    if args.anatomy_only:
        counts = []
    for rows in counts:
        warm = [p[:16] for p in (prompts * rows)[:rows]]
        for variant in args.variant:
            Drive(variant, model, twin, rows, 4).run(warm)
    results, order_log = {}, []
    rounds = 0 if args.anatomy_only else args.rounds
    progress.restart(len(args.slots) * max(rounds * len(args.variant), 1))
    for slots in args.slots:
        samples = {v: [] for v in args.variant} if rounds else {}
        for r in range(rounds):
            order = bench.variant_order(args.variant, r)
            order_log.append({"slots": slots, "round": r, "order": order})
            for variant in order:
                mx.clear_cache()
                done = Drive(variant, model, twin, slots, args.new_tokens).run(prompts)
                sample = measure(done, prompts, weight_bytes, kv_per_position, args.bandwidth_gbs)
                samples[variant].append({"round": r, **sample})
                progress.step(
                    f"B={slots} round {r + 1}/{args.rounds} {variant}: "
                    f"{sample['decode_tok_s'] or 0:.1f} decode tok/s"
                )
        results[f"slots={slots}"] = {
            "slots": slots,
            "samples": samples,
            "summary": summarise(samples),
        }
        if args.anatomy:
            context = anatomy_context(args, prompts)
            results[f"slots={slots}"]["anatomy"] = {
                "context": context,
                **anatomy(model, slots, context),
            }
            if args.anatomy_only:
                progress.step(f"B={slots} anatomy")
    progress.close()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["prompt_lengths"] = [len(p) for p in prompts]
    config["quantization"] = qwen3_model.describe_weights(model)
    # MLX's own settings (e.g. its CUDA graphs': MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER)
    config["mlx_environment"] = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "serve-bench",
        "metadata": metadata,
        "model_config": model.args.to_dict(),
        "config": config,
        "execution_order": order_log,
        "results": {
            "weight_bytes": weight_bytes,
            "kv_bytes_per_position": kv_per_position,
            "series": results,
        },
    }


def format_table(record: dict) -> str:
    head = (
        "| slots | variant | decode tok/s (min-max) | vs mlx-lm | ms/step median/mean | e2e tok/s "
        "| TTFT p50/p99 ms | ITL p50/p99 ms | floor tok/s | of floor | same tokens "
        "| cache copies |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for series in record["results"]["series"].values():
        for variant, m in series["summary"].items():
            ratio = f"{m['vs_mlx_lm']:.2f}x" if m.get("vs_mlx_lm") else "-"
            same = m.get("same_tokens_as_mlx_lm")
            n = record["config"]["requests"]
            lines.append(
                f"| {series['slots']} | {variant} | {m['decode_tok_s'] or 0:.1f} "
                f"({m['decode_tok_s_min']:.1f}-{m['decode_tok_s_max']:.1f}) | {ratio} | "
                f"{m['median_step_ms'] or 0:.1f} / {m.get('mean_step_ms') or 0:.1f} | "
                f"{m['e2e_tok_s'] or 0:.1f} | "
                f"{m['ttft_ms_p50'] or 0:.0f} / {m['ttft_ms_p99'] or 0:.0f} | "
                f"{m['itl_ms_p50'] or 0:.1f} / {m['itl_ms_p99'] or 0:.1f} | "
                f"{m['floor_tok_s'] or 0:.0f} | {100 * (m['floor_fraction'] or 0):.1f}% | "
                + (f"{min(same)}/{n}" if same else "-")
                + f" | {m['cache_copies']} |"
            )
    return "\n".join(lines)


def record_path(args, record: dict) -> Path:
    if args.output and args.output.suffix == ".json":
        return args.output
    folder = args.output or bench.find_results_dir()
    tag = record["config"]["quantization"].split()[0]
    stem = (
        f"{bench.machine_tag(args.device)}-{args.model}-{tag}-serve-{args.requests}x"
        f"{args.prompt_min}-{args.prompt_max}+{args.new_tokens}-mlx-{mx.__version__}"
    )
    if args.anatomy_only:
        stem = stem.replace("-serve-", "-serve-anatomy-")
    if args.kernel_trace:
        stem = stem.replace("-serve-", "-serve-kernel-trace-")
    return bench.unique_path(folder, stem)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.trace_child:
        return trace_child(args)
    if args.kernel_trace:
        record = trace_run(args, Progress())
        print(format_trace(record))
        if not args.no_record:
            path = write_record(record, record_path(args, record), force=args.force)
            print(f"wrote {path}")
        return
    record = run(args)
    c = record["config"]
    print(
        f"{args.device}, {args.model} ({c['quantization']}), {args.requests} requests of "
        f"{args.prompt_min}-{args.prompt_max} prompt tokens + {args.new_tokens}, "
        f"{args.rounds} rounds, floor at {args.bandwidth_gbs or 0:.0f} GB/s"
    )
    if not args.anatomy_only:
        print(format_table(record))
    for series in record["results"]["series"].values():
        if "anatomy" in series:
            parts = series["anatomy"]
            print(f"anatomy, {series['slots']} rows of {parts['context']} positions (ms):")
            for key, value in parts.items():
                if isinstance(value, dict):
                    value = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in value.items())  # fmt: skip
                elif isinstance(value, float):
                    value = f"{value:.2f}"
                print(f"  {key}: {value}")
    if not args.no_record:
        path = write_record(record, record_path(args, record), force=args.force)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
