"""plot: PNG charts from benchmark records (operator sweeps: µs vs context on log axes with the
K+V read floor; progressions: decode tok/s bars per variant with min–max)."""

from __future__ import annotations

import argparse
import json
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


def plot(path: Path, out_dir: Path | None = None) -> Path:
    record = json.loads(Path(path).read_text())
    out = (out_dir or Path(path).parent) / (Path(path).stem + ".png")
    kind = record.get("kind")
    if kind == "operator-sweep":
        plot_operators(record, out)
    elif kind in ("progression", "ab-decode", "model-bench"):  # one bar per variant
        plot_progression(record, out)
    else:
        raise ValueError(f"{path}: no chart for records of kind {kind!r}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="plot", description=__doc__)
    p.add_argument(
        "records",
        nargs="+",
        type=Path,
        help="JSON records from bench, bench-operators, progression or ab-decode",
    )
    p.add_argument("--out-dir", type=Path, help="default: beside each record")
    args = p.parse_args(argv)
    for path in args.records:
        try:
            print(f"wrote {plot(path, args.out_dir)}")
        except ValueError as e:  # e.g. an unknown kind: nothing to chart
            print(f"skipped {e}")


if __name__ == "__main__":
    main()
