"""Where a CPU call's time goes through MLX: per-eval costs measured side by side in one process.

Cases (each sample is one mx.eval timed on the calling thread, as bench-operators times one):
  synchronize   mx.synchronize(mx.cpu): a round trip to the CPU stream's thread, no op
  add x1, x8    one or 8 independent `x + 1` (32 x 128 bf16) per eval: MLX's own per-eval cost
  custom ...    decode_attention_custom on Qwen3-4B shapes (bf16, Hq=32, Hkv=8, D=128, L=1, K/V
                hot), per --context, --calls per eval, --path (ATTN_KERNELS_CPU_PATH) and
                --spin-us (ATTN_KERNELS_POOL_SPIN_US: how long the pool's workers poll for the
                next call before they sleep; 0 is the previous pool, "default" the built-in),
                --prewake-us (ATTN_KERNELS_POOL_PREWAKE_US: wake the workers when the op is
                evaluated, before the stream's thread runs it, and poll that long; 0: off);
                with --matmul-between N also with a float32 matmul between the calls of an eval;
                --call-threads (ATTN_KERNELS_CALL_THREADS: the pool threads one call uses) and
                --units-per-thread (ATTN_KERNELS_CPU_UNITS_PER_THREAD: the context split's
                target) sweep the work split; --kv cold rotates copies of K/V totalling
                --cold-mib, so every call reads K/V no call has read for that many MiB (past
                the last-level cache, as a decode step's layers do), against hot: one set reused
Both variables are read when an op is evaluated, so they are set between evals. A round runs
every case in a rotated order (round r starts at case r), each as a block of --block evals of
which the first is dropped (it follows another case); every other eval is kept. Prints medians
and p10-p90 per eval and per call; --json-output writes them with every sample and the metadata
of llm-eval's records. --busy-companion keeps one other process spinning throughout (on a VM
whose idle vCPUs halt, part of a wake-up is the hypervisor's). Usage (repository root):

    uv run --package llm-eval bench-eval-overhead [--rounds 12] [--block 5] \\
        [--context 1024 ...] [--calls 1 --calls 8] [--spin-us 0 --spin-us 50] \\
        [--path avx512 ...] [--call-threads 8 ...] [--units-per-thread 4 ...] \\
        [--kv hot --kv cold] [--json-output FILE]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from llm_eval.record import add_record_args

SPIN_VARIABLE = "ATTN_KERNELS_POOL_SPIN_US"
PREWAKE_VARIABLE = "ATTN_KERNELS_POOL_PREWAKE_US"
PATH_VARIABLE = "ATTN_KERNELS_CPU_PATH"
THREADS_VARIABLE = "ATTN_KERNELS_CALL_THREADS"
UNITS_VARIABLE = "ATTN_KERNELS_CPU_UNITS_PER_THREAD"
# Each case's environment: case key -> variable ("default": unset, the built-in).
CASE_VARIABLES = {
    "path": PATH_VARIABLE,
    "spin_us": SPIN_VARIABLE,
    "prewake_us": PREWAKE_VARIABLE,
    "call_threads": THREADS_VARIABLE,
    "units_per_thread": UNITS_VARIABLE,
}


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def make_cases(args) -> list[dict]:
    """Each case: a name, what it sets in the environment, and a function doing one eval."""
    from attn_kernels import decode_attention_custom

    scale = 128**-0.5
    x = mx.ones((32, 128), dtype=mx.bfloat16)
    n = args.matmul_between or 128
    w = mx.random.normal((n, n), key=mx.random.key(1)) * (n**-0.5)  # float32
    mx.eval(x, w)
    cases = [
        {"name": "synchronize", "calls": 1, "fn": lambda: mx.synchronize(mx.cpu)},
        {"name": "add x1", "calls": 1, "fn": lambda: mx.eval(mx.add(x, 1))},
        {"name": "add x8", "calls": 8, "fn": lambda: mx.eval([mx.add(x, 1) for _ in range(8)])},
    ]
    for context in args.context:
        keys = mx.random.split(mx.random.key(context), 3)
        q = mx.random.normal((1, 32, 1, 128), key=keys[0]).astype(mx.bfloat16)
        k = mx.random.normal((1, 8, context, 128), key=keys[1]).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, context, 128), key=keys[2]).astype(mx.bfloat16)
        mx.eval(q, k, v)
        kv_sources = {"hot": lambda k=k, v=v: (k, v)}
        if "cold" in args.kv:  # copies in buffers of their own, handed out in turn by every case
            count = max(2, -(-args.cold_mib * 2**20 // (2 * k.nbytes)))
            copies = [(k * 1, v * 1) for _ in range(count)]
            mx.eval(copies)
            kv_sources["cold"] = itertools.cycle(copies).__next__
        for path, spin_us, prewake_us, threads, units, kv in itertools.product(
            args.path,
            args.spin_us,
            args.prewake_us,
            args.call_threads,
            args.units_per_thread,
            args.kv,
        ):
            settings = (
                f"{path} spin={spin_us}"
                + (f" prewake={prewake_us}" if prewake_us != "0" else "")
                + (f" threads={threads}" if threads != "default" else "")
                + (f" units={units}" if units != "default" else "")
                + (f" {kv}" if kv != "hot" else "")
            )
            kv_for = kv_sources[kv]
            for calls in args.calls:

                def fn(q=q, kv_for=kv_for, calls=calls):
                    mx.eval(
                        [decode_attention_custom(q, *kv_for(), scale=scale) for _ in range(calls)]
                    )

                def chained(q=q, kv_for=kv_for, calls=calls):
                    for _ in range(calls):  # each call's query from a matmul of the last output
                        out = decode_attention_custom(q, *kv_for(), scale=scale)
                        q = (out.reshape(-1, n).astype(mx.float32) @ w).reshape(q.shape)
                        q = q.astype(mx.bfloat16)
                    mx.eval(q)

                variants = [("", fn)]
                if args.matmul_between and calls > 1:
                    variants.append((" +matmul", chained))
                for suffix, f in variants:
                    cases.append(
                        {
                            "name": f"custom S={context} x{calls} {settings}{suffix}",
                            "context": context,
                            "kv_bytes": 2 * k.nbytes,
                            "calls": calls,
                            "path": path,
                            "spin_us": spin_us,
                            "prewake_us": prewake_us,
                            "call_threads": threads,
                            "units_per_thread": units,
                            "kv": kv,
                            "matmul_between": bool(suffix),
                            "fn": f,
                        }
                    )
    return cases


def read_rate_gbs() -> float:
    from attn_kernels import _ext

    return _ext.measure_read_bandwidth(1 << 30, 5) / 1e9


def run(args) -> dict:
    mx.set_default_device(mx.cpu)
    cases = make_cases(args)
    rates = [read_rate_gbs()]
    samples = {c["name"]: [] for c in cases}
    order = []
    began = time.perf_counter()
    for r in range(args.rounds):
        if r > 0 and args.max_seconds and time.perf_counter() - began > args.max_seconds:
            print(f"--max-seconds {args.max_seconds}: stopping after {r} rounds", file=sys.stderr)
            break
        for i in range(len(cases)):
            case = cases[(i + r) % len(cases)]
            order.append({"round": r, "case": case["name"]})
            for key, name in CASE_VARIABLES.items():
                value = case.get(key, "default")
                set_env(name, None if value in ("default", "auto") else value)
            for b in range(args.block):
                start = time.perf_counter()
                case["fn"]()
                elapsed = time.perf_counter() - start
                if b > 0:
                    samples[case["name"]].append(elapsed * 1e6)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    rates.append(read_rate_gbs())
    for name in CASE_VARIABLES.values():
        set_env(name, None)
    results = {}
    for case in cases:
        s = sorted(samples[case["name"]])
        n = len(s)
        entry = {k: v for k, v in case.items() if k not in ("fn", "name")}
        entry.update(
            median_us=statistics.median(s),
            p10_us=s[n // 10],
            p90_us=s[9 * n // 10],
            per_call_us=statistics.median(s) / case["calls"],
            samples_us=samples[case["name"]],
        )
        if "kv_bytes" in case:  # the floor: K+V at the best read rate measured in the run
            entry["floor_fraction"] = case["kv_bytes"] / (max(rates) * 1e3) / entry["per_call_us"]
        results[case["name"]] = entry
    return results, order, rates


def format_table(results: dict) -> str:
    lines = [
        "| case | per eval µs (p10-p90) | per call µs | K+V GB/s per call (floor %) |",
        "|---|---:|---:|---:|",
    ]
    for name, e in results.items():
        gbs = ""
        if "kv_bytes" in e:
            gbs = f"{e['kv_bytes'] / (e['per_call_us'] * 1e3):.1f} ({e['floor_fraction']:.0%})"
        lines.append(
            f"| {name} | {e['median_us']:.1f} ({e['p10_us']:.1f}-{e['p90_us']:.1f}) "
            f"| {e['per_call_us']:.1f} | {gbs} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="bench-eval-overhead",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=12, help="rotations over every case (default 12)")
    p.add_argument("--block", type=int, default=5, help="evals per case and round (default 5)")
    p.add_argument("--context", type=int, action="append", help="S (default 1024, 4096, 16384)")
    p.add_argument("--calls", type=int, action="append", help="calls per eval (default 1 and 8)")
    p.add_argument(
        "--spin-us",
        action="append",
        help=f"{SPIN_VARIABLE} values: microseconds or 'default' (default: 0 and default)",
    )
    p.add_argument(
        "--prewake-us",
        action="append",
        help=f"{PREWAKE_VARIABLE} values: how long workers woken when the op is evaluated (before "
        "the CPU stream's thread runs it) poll for it; 0: no prewake (default: 0)",
    )
    p.add_argument("--path", action="append", help=f"{PATH_VARIABLE} values (default: auto)")
    p.add_argument(
        "--call-threads",
        action="append",
        help=f"{THREADS_VARIABLE} values: threads one call uses, 1 to the pool's size, or "
        "'default' (all of them; the default)",
    )
    p.add_argument(
        "--units-per-thread",
        action="append",
        help=f"{UNITS_VARIABLE} values: (KV head x context chunk) units per thread the context "
        "split aims at, 1 to 64, or 'default' (the built-in; the default)",
    )
    p.add_argument(
        "--kv",
        action="append",
        choices=["hot", "cold"],
        help="hot: every call reads one K/V set (cache-resident when it fits); cold: calls take "
        "copies in turn, --cold-mib in all (default: hot)",
    )
    p.add_argument(
        "--cold-mib",
        type=int,
        default=1024,
        help="MiB of K/V copies per context for --kv cold (default 1024: past a 300 MiB L3)",
    )
    p.add_argument(
        "--matmul-between",
        type=int,
        metavar="N",
        help="also time each --calls > 1 case with a float32 matmul between the calls: the "
        "output as (4096 / N, N) @ (N, N) gives the next query (other work between calls, as "
        "in a decode step; N = 128: a small op, N = 4096: 64 MB of weights)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        help="stop after the round that passes this many seconds (at least one round; the "
        "record's execution_order says how many ran)",
    )
    p.add_argument("--busy-companion", action="store_true", help="one other process spins")
    add_record_args(p)
    args = p.parse_args(argv)
    args.context = args.context or [1024, 4096, 16384]
    args.calls = args.calls or [1, 8]
    args.spin_us = args.spin_us or ["0", "50"]
    args.prewake_us = args.prewake_us or ["0"]
    args.path = args.path or ["auto"]
    args.call_threads = args.call_threads or ["default"]
    args.units_per_thread = args.units_per_thread or ["default"]
    args.kv = args.kv or ["hot"]
    if args.rounds < 1 or args.block < 2:
        p.error("--rounds must be >= 1 and --block >= 2 (a block's first eval is dropped)")
    if any(c < 1 for c in args.context + args.calls):
        p.error("--context and --calls must be >= 1")
    if args.matmul_between is not None and (args.matmul_between < 1 or 4096 % args.matmul_between):
        p.error("--matmul-between N: N must divide 4096 (the query's 32 x 128 values)")
    for option, values in (("--spin-us", args.spin_us), ("--prewake-us", args.prewake_us)):
        for value in values:
            if value != "default":
                try:
                    ok = 0 <= float(value) <= 1e6
                except ValueError:
                    ok = False
                if not ok:
                    p.error(f"{option} {value!r}: microseconds in [0, 1e6] or 'default'")
    for value in args.call_threads:
        if value != "default" and not (value.isdigit() and int(value) >= 1):
            p.error(f"--call-threads {value!r}: an integer >= 1 or 'default'")
    for value in args.units_per_thread:
        if value != "default" and not (value.isdigit() and 1 <= int(value) <= 64):
            p.error(f"--units-per-thread {value!r}: an integer in [1, 64] or 'default'")
    if args.cold_mib < 1:
        p.error("--cold-mib must be >= 1")
    if args.json_output and args.json_output.exists() and not args.force:
        p.error(f"{args.json_output} exists; pass --force to replace it")

    from attn_kernels import _ext

    for path in args.path:
        if path != "auto" and path not in _ext.cpu_paths():
            p.error(f"--path {path}: this CPU runs {', '.join(_ext.cpu_paths())}")
    for threads in args.call_threads:
        if threads != "default" and int(threads) > _ext.cpu_threads():
            p.error(f"--call-threads {threads}: the pool has {_ext.cpu_threads()} threads")
    companion = None
    if args.busy_companion:
        companion = multiprocessing.Process(target=spin, args=(3600.0,), daemon=True)
        companion.start()
        time.sleep(0.3)
    try:
        results, order, rates = run(args)
    finally:
        if companion is not None:
            companion.terminate()
            companion.join()
    header = (
        f"MLX {mx.__version__}, pool threads {_ext.cpu_threads()}, paths {_ext.cpu_paths()}, "
        f"{order[-1]['round'] + 1} rounds x {args.block - 1} evals per case, read rate "
        f"{' / '.join(f'{r:.1f}' for r in rates)} GB/s (before / after; the floor takes the best)"
        + (", busy companion" if args.busy_companion else "")
        + (f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "")
    )
    print(header)
    print(format_table(results))
    if args.json_output:
        from llm_eval.record import SCHEMA_VERSION, collect_metadata, write_record

        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        config["cpu_threads"] = _ext.cpu_threads()
        config["read_rates_gbs"] = rates
        config["bandwidth_gbs"] = max(rates)
        config["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "cpu-eval-overhead",
            "metadata": collect_metadata("cpu"),
            "config": config,
            "execution_order": order,
            "results": results,
        }
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
