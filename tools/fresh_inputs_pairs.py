"""Split a bench-operators --fresh-inputs record's samples by the call before each one.

MLX's CUDA backend keys its cache of instantiated graphs by the graph's shape; one call per
mx.eval makes a one-kernel graph for either op, so consecutive calls of different ops share one
cached graph and each switch updates its kernel node (cudaGraphExecUpdate). With two
implementations in rotated order, half of each one's samples follow the other op: the samples
are bimodal (H200: ~3-5 µs apart at S <= 128), and a median of all samples sits between the
modes. This prints, per S and for first and repeat use, each implementation's median after a
call of the same op and after a call of another, and custom / other for each (docs/host-cost.md).

    python3 tools/fresh_inputs_pairs.py benchmark_results/h200-qwen3-4b-attention-fresh-inputs-short-mlx-0.32.4.json
"""

from __future__ import annotations

import json
import statistics
import sys


def split_by_previous(record: dict, key: str, kind: str) -> dict:
    """{name: {"same": [...], "other": [...]}}; the first call of a pass (whose predecessor is a
    warm-up) is left out."""
    entry = record["results"][key]
    orders = [e for e in record["execution_order"] if e["shape"] == key]
    seen = {name: 0 for name in entry[kind]}
    out = {name: {"same": [], "other": []} for name in entry[kind]}
    previous, last_pass = None, None
    for e in orders:
        if e["pass"] != last_pass:
            previous, last_pass = None, e["pass"]
        for name in e["order"]:
            sample = entry[kind][name][seen[name]]
            seen[name] += 1
            if previous is not None:
                out[name]["same" if previous == name else "other"].append(sample)
            previous = name
    return out


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        record = json.load(f)
    if not record["config"].get("fresh_inputs"):
        sys.exit("not a --fresh-inputs record")
    names = record["config"]["implementations"]
    print("| S | use | " + " | ".join(f"{n} after same / after other" for n in names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for key, entry in record["results"].items():
        for kind, label in (("samples_us", "first"), ("repeat_samples_us", "repeat")):
            # Repeat use ran in the same orders as first use.
            parts = split_by_previous(record, key, kind)
            cells = []
            for n in names:
                same, other = parts[n]["same"], parts[n]["other"]
                cells.append(
                    f"{statistics.median(same):.1f} / {statistics.median(other):.1f} "
                    f"(n {len(same)}/{len(other)})"
                )
            print(f"| {entry['context']} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
