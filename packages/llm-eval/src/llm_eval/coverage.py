"""bench-coverage: our attention against mx.fast over the shapes other models use, and the guard
region that follows from it.

For every head dim D (--head-dim), dtype (--dtype), group G (query heads per KV head, --group;
Hq = --heads, Hkv = Hq / G), query length L (--query-length; causal) and context S (--context),
bench-operators' protocol times `decode_attention_custom` and `mx.fast.scaled_dot_product_attention`
interleaved (both orders equally often, passes forward then backward, every sample kept). One
record holds every point: both medians, the ratio, the passes ours won, GB/s and the fraction of
the read floor. Then, per (D, dtype) and swept L, the region the guard takes from it
(`derive_regions`): the longest run of swept contexts S_lo..S_hi where no group's point was lost
(the guard admits a length between two swept ones where both lengths' regions hold its S). A
point is lost unless ours won every pass or the two medians are within TIE (5%): at the per-call
floor (~7 µs on the H200) and at the memory floor both kernels wait on the same thing, and two
passes cannot order them. mx.fast gets the mask mlx-lm's decode passes: None at L = 1, "causal"
above (the same attention at L = 1, but on CUDA MLX 0.32.4 takes a slower path with "causal"
from S = 8192: 151 µs against 58 at D 96, S = 8192; records before this ran "causal" at every L,
benchmark_results/raw/h100-attention-L1-mask-none-vs-causal.txt). A region that starts at the
smallest swept S reaches down to S = 1. attn_kernels.guard.LIMITS names the record its regions
came from; llm-eval's tests check that they agree.

On a GPU the calls of a sample are chained by default (--chain: each call's query is the previous
call's output), as a decode step's layers wait on each other. Independent calls (--no-chain) run
concurrently on the GPU and read the same K/V through its L2, past the HBM floor (an H100 record
showed 6 TB/s at D = 256, S = 8192 against its 3.35): a throughput figure that favours whichever
kernel leaves more of the GPU free, not the latency the guard decides on.

    bench-coverage --device cpu --json-output benchmark_results/cpu-2core-attention-coverage-mlx-0.32.4.json
    bench-coverage --head-dim 96 --group 1 --context 8192 --query-length 1   # one question
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from attn_kernels import _ext

from llm_eval import operators
from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    refuse_overwrite,
    write_record,
)

HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
GROUPS = (1, 2, 4, 8)
QUERY_LENGTHS = (1, 4, 8)
CONTEXTS = (32, 128, 1024, 4096, 16384)
TIE = 0.05  # medians this close are a tie (module doc)


def show(values) -> str:
    return ", ".join(map(str, values))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-coverage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--head-dim", type=int, action="append", help=f"D, repeatable (default {show(HEAD_DIMS)})"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, action="append", help=f"repeatable (default {show(DTYPES)})"
    )
    p.add_argument(
        "--group", type=int, action="append", help=f"Hq / Hkv, repeatable (default {show(GROUPS)})"
    )
    p.add_argument(
        "--query-length",
        type=int,
        action="append",
        help=f"L, repeatable (default {show(QUERY_LENGTHS)})",
    )
    p.add_argument(
        "--context", type=int, action="append", help=f"S, repeatable (default {show(CONTEXTS)})"
    )
    p.add_argument("--heads", type=int, default=32, help="query heads Hq (default 32)")
    p.add_argument(
        "--passes", type=int, default=2, help="passes over each (D, dtype, group) (default 2)"
    )
    p.add_argument(
        "--iterations", type=int, default=2, help="samples per pass, both orders (default 2)"
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument(
        "--calls-per-eval",
        type=int,
        help="calls evaluated together per sample (default bench-operators': 1 on a CPU, 50 on a "
        "GPU); a decode step evaluates every layer's call in one eval, so on a CPU 8 shows the "
        "kernels without MLX's per-eval cost, which bounds the ratio at short contexts",
    )
    p.add_argument(
        "--chain",
        action=argparse.BooleanOptionalAction,
        help="chain each sample's calls (each query the previous output: a decode step's "
        "latency); default: chained on a GPU, independent on a CPU (one call per eval there)",
    )
    p.add_argument(
        "--schedule",
        choices=operators.SCHEDULES,
        default="auto",
        help="our kernel's GPU schedule (default auto; split-mma times the tensor-core kernel at "
        "head dims auto does not give it yet)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_record_args(p)
    args = p.parse_args(argv)
    args.head_dim = args.head_dim or list(HEAD_DIMS)
    args.dtype = args.dtype or list(DTYPES)
    args.group = args.group or list(GROUPS)
    args.query_length = sorted(args.query_length or QUERY_LENGTHS)
    args.context = sorted(args.context or CONTEXTS)
    if any(d < 1 or d > 256 for d in args.head_dim):
        p.error("--head-dim: 1 to 256 (the kernels' limit)")
    if any(g < 1 or args.heads % g for g in args.group):
        p.error(f"--group: each must divide --heads {args.heads}")
    if min(args.query_length) < 1 or min(args.context) < max(args.query_length):
        p.error("--query-length must be >= 1 and every --context >= every --query-length")
    if args.passes < 1 or args.iterations < 2 or args.iterations % 2:
        p.error("--passes >= 1, --iterations a positive multiple of 2 (both orders)")
    if args.calls_per_eval is None:
        args.calls_per_eval = operators.CALLS_PER_EVAL[args.device]
    if args.calls_per_eval < 1:
        p.error("--calls-per-eval must be >= 1")
    if args.chain is None:
        args.chain = args.device == "gpu"
    if args.device == "gpu" and mx.default_device() != mx.gpu:
        p.error("--device gpu: this MLX has no GPU backend")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def point_key(d: int, dtype: str, group: int, length: int, context: int) -> str:
    return f"D={d},{dtype},G={group},L={length},S={context}"


def mx_fast_mask(length: int) -> str:
    """The mask mlx-lm's decode gives mx.fast at L = length (module doc)."""
    return "none" if length == 1 else "causal"


def sweep_one(args, d: int, dtype: str, group: int, bandwidth: float | None) -> dict:
    """bench-operators over (L, S) for one (D, dtype, group): its records' results. mx.fast gets
    the mask mlx-lm passes: None at L = 1, "causal" above (module doc)."""
    argv = ["--device", args.device, "--implementations", "custom,mlx", "--dtype", dtype]
    if args.schedule != "auto":  # the implementation becomes custom:SCHEDULE
        argv += ["--schedule", args.schedule]
    argv += ["--head-dim", str(d), "--heads", str(args.heads), "--gqa-ratio", str(group)]
    argv += ["--seed", str(args.seed)]
    argv += ["--context-repeats", str(args.passes), "--iterations", str(args.iterations)]
    argv += ["--calls-per-eval", str(args.calls_per_eval)] + (["--chain"] if args.chain else [])
    argv += [f"--context={s}" for s in args.context]
    if bandwidth:
        argv += ["--bandwidth-gbs", str(bandwidth)]
    results = {}
    for mask in dict.fromkeys(mx_fast_mask(q) for q in args.query_length):
        lengths = [f"--query-length={q}" for q in args.query_length if mx_fast_mask(q) == mask]
        masked = [*argv, "--attention-mask", mask, *lengths]
        results.update(operators.run(operators.parse_args(masked))["results"])
    return results


def summarize_point(entry: dict) -> dict:
    name = next(n for n in entry["summary"] if n.startswith("custom"))  # custom[:schedule]
    ours, theirs = entry["summary"][name], entry["summary"]["mlx"]
    wins = sum(p["median_us"][name] < p["median_us"]["mlx"] for p in entry["passes"])
    return {
        "ours_us": ours["median_us"],
        "mx_fast_us": theirs["median_us"],
        "ratio": theirs["median_us"] / ours["median_us"],
        "passes_won": wins,
        "passes": len(entry["passes"]),
        "ours_gbs": ours["gbs"],
        "ours_floor_fraction": ours["floor_fraction"],
        # "custom" whatever the schedule (the record's config names it)
        "samples_us": {("custom" if n == name else n): v for n, v in entry["samples_us"].items()},
    }


def admitted(point: dict) -> bool:
    """Ours won every pass, or the medians tie (within TIE)."""
    return point["passes_won"] == point["passes"] or point["ratio"] >= 1 - TIE


def derive_regions(points: dict) -> dict[tuple[int, str, int], tuple[int, int]]:
    """Per (D, dtype, L) swept: (min S, max S), the longest run of swept contexts where every
    group's point was admitted (of two as long, the one reaching further); min S = 1 where it
    starts at the smallest swept S; (0, 0) where none. Points are summarize_point()'s, keyed by
    point_key's fields."""
    rows: dict[tuple[int, str, int], dict[int, bool]] = {}
    for p in points.values():
        row = rows.setdefault((p["head_dim"], p["dtype"], p["query_length"]), {})
        row[p["context"]] = row.get(p["context"], True) and admitted(p)
    regions = {}
    for key, row in rows.items():
        contexts = sorted(row)
        runs = [  # (first, last) index of each run of admitted contexts
            (i, j)
            for i in range(len(contexts))
            for j in range(i, len(contexts))
            if all(row[s] for s in contexts[i : j + 1])
        ]
        if not runs:
            regions[key] = (0, 0)
            continue
        first, last = max(runs, key=lambda r: (r[1] - r[0], r[1]))
        regions[key] = (1 if first == 0 else contexts[first], contexts[last])
    return regions


def in_region(point: dict, region: dict) -> bool:
    """Whether a swept point lies in a record's region entry (min_context absent: 1)."""
    same = all(region[k] == point[k] for k in ("head_dim", "dtype", "query_length"))
    return same and region.get("min_context", 1) <= point["context"] <= region["max_context"]


def run(args) -> dict:
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    rates = [] if args.device == "gpu" else [_ext.measure_read_bandwidth(1 << 30, 5) / 1e9]
    configs = list(itertools.product(args.head_dim, args.dtype, args.group))
    progress = Progress(len(configs))
    points, order = {}, []
    for d, dtype, group in configs:
        results = sweep_one(args, d, dtype, group, max(rates) if rates else None)
        order.append({"head_dim": d, "dtype": dtype, "group": group})
        for entry in results.values():
            key = point_key(d, dtype, group, entry["query_length"], entry["context"])
            points[key] = {
                "head_dim": d,
                "dtype": dtype,
                "group": group,
                "query_length": entry["query_length"],
                "context": entry["context"],
                **summarize_point(entry),
            }
        progress.step(f"D={d} {dtype} G={group}")
    if rates:
        rates.append(_ext.measure_read_bandwidth(1 << 30, 5) / 1e9)
    regions = derive_regions(points)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["read_rates_gbs"] = rates
    # records without it: "causal" at every L
    config["mx_fast_masks"] = {"1": mx_fast_mask(1), "2-8": mx_fast_mask(2)}
    if args.device == "cpu":
        config["cpu_kernel_path"], config["cpu_threads"] = _ext.cpu_path(), _ext.cpu_threads()
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "coverage-sweep",
        "metadata": collect_metadata(args.device),
        "config": config,
        "execution_order": order,
        "results": points,
        "regions": [
            {"head_dim": d, "dtype": t, "query_length": q, "min_context": lo, "max_context": hi}
            for (d, t, q), (lo, hi) in sorted(regions.items())
            if hi
        ],
    }


def lowest_over_groups(points) -> dict[tuple[int, str, int, int], tuple[float, bool]]:
    """Per (D, dtype, L, S): the lowest ratio mx.fast / ours over the groups, and whether some
    group's point is lost (admitted())."""
    cells: dict[tuple[int, str, int, int], list[dict]] = {}
    for p in points:
        key = (p["head_dim"], p["dtype"], p["query_length"], p["context"])
        cells.setdefault(key, []).append(p)
    return {
        key: (min(p["ratio"] for p in at), not all(admitted(p) for p in at))
        for key, at in cells.items()
    }


def format_tables(record: dict) -> str:
    """Per (D, dtype): the ratio mx.fast / ours at each (L, S), the lowest over groups, with an
    asterisk where some group's point is lost (admitted()); then the regions."""
    points = record["results"].values()
    lengths = sorted({p["query_length"] for p in points})
    contexts = sorted({p["context"] for p in points})
    lines = ["| D | dtype | L | " + " | ".join(f"S={s}" for s in contexts) + " |"]
    lines.append("|---:|---|---:|" + "---:|" * len(contexts))
    shapes = sorted({(p["head_dim"], p["dtype"]) for p in points})
    lowest = lowest_over_groups(points)
    for (d, dtype), q in itertools.product(shapes, lengths):
        cells = []
        for s in contexts:
            ratio, lost = lowest.get((d, dtype, q, s), (None, False))
            cells.append("" if ratio is None else f"{ratio:.1f}x" + ("*" if lost else ""))
        lines.append(f"| {d} | {dtype} | {q} | " + " | ".join(cells) + " |")
    ratios = [p["ratio"] for p in points]
    inside = [p for p in points for r in record["regions"] if in_region(p, r)]
    lines.append("")
    # Records before --chain timed independent calls.
    mode = "chained" if record["config"].get("chain") else "independent"
    lines.append(
        f"{len(ratios)} points ({mode} calls); mx.fast / ours median {statistics.median(ratios):.1f}x, "
        f"lowest {min(ratios):.2f}x; the regions cover {len(inside)} "
        f"({len(inside) / len(ratios):.0%}), lowest there "
        f"{min((p['ratio'] for p in inside), default=float('nan')):.2f}x"
    )
    for r in record["regions"]:
        lines.append(
            f"region D={r['head_dim']} {r['dtype']}: L = {r['query_length']}, "
            f"{r.get('min_context', 1)} <= S <= {r['max_context']}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    print(format_tables(record))
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
