"""plot: PNG charts from benchmark records (operator sweeps: µs vs context on log axes with the
K+V read floor; progressions: decode tok/s bars per variant with min–max; coverage sweeps: per
head dim and dtype, mx.fast / ours at each L and S, the lowest over groups, and the guard's
region outlined)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_operators(record: dict, out: Path) -> None:
    results = list(record["results"].values())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for length in sorted({r["query_length"] for r in results}):
        rows = sorted(
            (r for r in results if r["query_length"] == length), key=lambda r: r["context"]
        )
        contexts = [r["context"] for r in rows]
        for name in record["config"]["implementations"]:
            ax.plot(
                contexts,
                [r["summary"][name]["median_us"] for r in rows],
                marker="o",
                label=f"{name} (L={length})",
            )
        ax.plot(
            contexts,
            [max(r["floor_us"], 1e-3) for r in rows],
            "k--",
            lw=1,
            label=f"K+V read floor ({record['config']['bandwidth_gbs']:.0f} GB/s)"
            if length == min(r["query_length"] for r in results)
            else None,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached context S")
    calls = "chained calls" if record["config"].get("chain") else "independent calls"
    ax.set_ylabel(f"µs per call (median, {calls})")
    device = record["metadata"]["device"]
    ax.set_title(
        f"attention, {record['config']['dtype']}, Hq={record['config']['heads']}, "
        f"mask={record['config']['attention_mask']} — {device.get('gpu') or device.get('cpu')}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_progression(record: dict, out: Path) -> None:
    samples = record["results"]["samples"]
    medians = record["results"]["medians"]
    names = list(medians)
    values = [medians[n]["decode_tok_s"] for n in names]
    lows = [
        v - min(s["decode_tok_s"] for s in samples[n]) for n, v in zip(names, values, strict=True)
    ]
    highs = [
        max(s["decode_tok_s"] for s in samples[n]) - v for n, v in zip(names, values, strict=True)
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(
        names, values, yerr=[lows, highs], capsize=6, color=["#888", "#2a7", "#37c"][: len(names)]
    )
    cfg = record["config"]
    runs = (
        f"{cfg['repeats']} fresh processes"
        if record["kind"] == "progression"
        else f"{cfg['rounds']} rounds in one process"
    )
    ax.set_ylabel("decode tok/s (median, min–max)")
    ax.set_title(
        f"{cfg.get('model') or 'model'} {cfg.get('quantize') or ''}, {cfg['input_len']}+"
        f"{cfg['output_len']}, {runs}",
        fontsize=9,
    )
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_coverage(record: dict, out: Path) -> None:
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    from llm_eval.coverage import derive_regions, lowest_over_groups

    points = list(record["results"].values())
    regions = derive_regions(record["results"])  # the rule as it is now
    lowest = lowest_over_groups(points)
    dims = sorted({p["head_dim"] for p in points})
    dtypes = [t for t in ("bfloat16", "float16", "float32") if any(p["dtype"] == t for p in points)]
    lengths = sorted({p["query_length"] for p in points})
    contexts = sorted({p["context"] for p in points})
    ratios = [p["ratio"] for p in points]
    norm = LogNorm(vmin=min(min(ratios), 0.5), vmax=max(max(ratios), 2.0))
    fig, axes = plt.subplots(
        len(dtypes), len(dims), figsize=(2.3 * len(dims) + 1, 1.1 * len(dtypes) * len(lengths) + 1),
        squeeze=False,
    )  # fmt: skip
    for (row, dtype), (col, d) in itertools.product(enumerate(dtypes), enumerate(dims)):
        ax = axes[row][col]
        grid = [[float("nan")] * len(contexts) for _ in lengths]
        for i, q in enumerate(lengths):
            for j, s in enumerate(contexts):
                if (d, dtype, q, s) not in lowest:
                    continue
                grid[i][j], lost = lowest[(d, dtype, q, s)]
                ax.text(j, i, f"{grid[i][j]:.1f}" + ("*" if lost else ""), ha="center",
                        va="center", fontsize=6)  # fmt: skip
        image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
        for i, q in enumerate(lengths):  # each swept L's region: a box over its contexts
            lo, hi = regions.get((d, dtype, q), (0, 0))
            inside = [j for j, s in enumerate(contexts) if hi and lo <= s <= hi]
            if inside:  # inset a little so that the box shows against the panel's edges
                ax.add_patch(Rectangle((inside[0] - 0.45, i - 0.45), inside[-1] - inside[0] + 0.9,
                                       0.9, fill=False, lw=2, edgecolor="navy"))  # fmt: skip
        ax.set_xticks(range(len(contexts)), [f"{s // 1024}K" if s >= 1024 else str(s)
                                              for s in contexts], fontsize=6)  # fmt: skip
        ax.set_yticks(range(len(lengths)), [f"L={q}" for q in lengths], fontsize=6)
        ax.set_title(f"D={d} {dtype}", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="mx.fast / ours (lowest over groups)")
    device = record["metadata"].get("device", {})
    name = device.get("mlx_device_info", {}).get("device_name") or record["config"]["device"]
    if device.get("cpu_isa"):
        name += f" ({device.get('cpu_count')} CPUs, {'+'.join(device['cpu_isa'])})"
    fig.suptitle(
        f"coverage: {name}; * a group lost (a tie within 5% is no loss); box: the guard's region",
        fontsize=8,
    )
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot(path: Path, out_dir: Path | None = None) -> Path:
    record = json.loads(Path(path).read_text())
    out = (out_dir or Path(path).parent) / (Path(path).stem + ".png")
    kind = record.get("kind")
    if kind == "operator-sweep":
        plot_operators(record, out)
    elif kind in ("progression", "ab-decode", "model-bench"):  # one bar per variant
        plot_progression(record, out)
    elif kind == "coverage-sweep":
        plot_coverage(record, out)
    else:
        raise ValueError(f"{path}: no chart for records of kind {kind!r}")
    return out


def plot_coverage_together(paths: list[Path], out: Path) -> Path:
    """One chart of several coverage records (a sweep run a head dim per process)."""
    records = [json.loads(Path(path).read_text()) for path in paths]
    if any(r.get("kind") != "coverage-sweep" for r in records):
        raise ValueError("--together takes bench-coverage records only")
    merged = dict(records[0], results={k: v for r in records for k, v in r["results"].items()})
    plot_coverage(merged, out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="plot", description=__doc__)
    p.add_argument(
        "records",
        nargs="+",
        type=Path,
        help="JSON records from bench, bench-operators, progression, ab-decode or bench-coverage",
    )
    p.add_argument("--out-dir", type=Path, help="default: beside each record")
    p.add_argument(
        "--together",
        type=Path,
        metavar="PNG",
        help="one chart of every (coverage) record given, written to PNG",
    )
    args = p.parse_args(argv)
    missing = [str(path) for path in args.records if not path.is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    if args.together:
        try:
            print(f"wrote {plot_coverage_together(args.records, args.together)}")
        except ValueError as e:
            p.error(str(e))
        return
    written = 0
    for path in args.records:
        try:
            print(f"wrote {plot(path, args.out_dir)}")
            written += 1
        except json.JSONDecodeError as e:
            print(f"skipped {path}: not a JSON record ({e})")
        except ValueError as e:  # e.g. an unknown kind: nothing to chart
            print(f"skipped {e}")
    if not written:
        sys.exit("plot: error: no chart written")


if __name__ == "__main__":
    main()
