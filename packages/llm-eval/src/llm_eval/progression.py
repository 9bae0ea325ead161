"""progression: the chapter's acceptance protocol, fresh processes.

Every sample is a new Python process running `bench --rounds 1` for one variant, so nothing
(compiled kernels, allocator caches, warm weights) carries over between variants. Variant order
rotates by one per repeat, reversed in every second round of rotations, so each variant takes
each position equally often after 2 x (number of variants) repeats (three variants: 6 repeats
run every order once). Reports medians, the ratio of each variant to composition and to mlx-lm,
and in how many repeats decode-attention was at least as fast as each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import qwen3_model
from attn_kernels import SCHEDULES

from llm_eval.bench import ALL_VARIANTS, VARIANTS, at_or_above, has_gpu, variant_order
from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    at_least,
    collect_metadata,
    refuse_overwrite,
    write_record,
)

METRICS = ("decode_tok_s", "prefill_tok_s", "output_tok_s", "peak_memory_bytes")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="progression",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--variant",
        action="append",
        choices=ALL_VARIANTS,
        help="repeatable (default: bench's three)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="fresh processes per variant; 2 x variants repeats balance the order (default 4)",
    )
    p.add_argument("--model", choices=qwen3_model.CONFIGS, help="built-in config (bench's default)")
    p.add_argument("--quantize", choices=["none", *qwen3_model.QUANTIZATIONS], default=None)
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="auto",
        help="GPU kernel schedule of the decode-attention variant (scheduling experiment)",
    )
    p.add_argument("--input-len", type=at_least(1), required=True)
    p.add_argument("--output-len", type=at_least(2), required=True, help="decode needs 2 or more")
    p.add_argument("--warmup", type=at_least(0), default=2)
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if has_gpu() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    add_record_args(p)
    args = p.parse_args(argv)
    args.variant = args.variant or list(VARIANTS)
    if args.repeats < 2:
        p.error("--repeats must be at least 2: orders alternate")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def bench_command(args, variant: str, output: Path) -> list[str]:
    cmd = [sys.executable, "-m", "llm_eval.bench", "--variant", variant, "--rounds", "1"]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--warmup", str(args.warmup), "--device", args.device, "--seed", str(args.seed)]
    cmd += ["--schedule", args.schedule, "--output", str(output)]
    if args.model:
        cmd += ["--model", args.model]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    return cmd


def run_sample(args, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "sample.json"
        proc = subprocess.run(bench_command(args, variant, output), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench for {variant} failed:\n{proc.stderr[-2000:]}")
        return json.loads(output.read_text())


def run(args) -> dict:
    samples = {v: [] for v in args.variant}
    order_log = []
    progress = Progress(args.repeats * len(args.variant))
    model_config = None
    for rep in range(args.repeats):
        order = variant_order(args.variant, rep)
        order_log.append({"repeat": rep, "order": list(order)})
        for variant in order:
            record = run_sample(args, variant)
            model_config = record["model_config"]
            samples[variant].append({"repeat": rep, **record["results"]["medians"][variant]})
            progress.step(f"repeat {rep} {variant}")
    medians = {
        v: {m: statistics.median(s[m] for s in samples[v]) for m in METRICS} for v in samples
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "progression",
        "metadata": collect_metadata(args.device),
        "model_config": model_config,
        "config": config,
        "execution_order": order_log,
        "results": {"samples": samples, "medians": medians},
    }


def format_table(record: dict) -> str:
    medians = record["results"]["medians"]
    samples = record["results"]["samples"]
    refs = [r for r in ("composition", "mlx-lm") if r in medians]
    head = "| variant | decode tok/s (min–max) | prefill tok/s | peak GiB |" + "".join(
        f" decode vs {r} (repeats at or above) |" for r in refs
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for v, m in medians.items():
        decode = [s["decode_tok_s"] for s in samples[v]]
        row = (
            f"| {v} | {m['decode_tok_s']:.2f} ({min(decode):.2f}–{max(decode):.2f}) | "
            f"{m['prefill_tok_s']:.1f} | {m['peak_memory_bytes'] / 2**30:.2f} |"
        )
        for r in refs:
            wins = at_or_above(samples[v], samples[r])
            ratio = m["decode_tok_s"] / medians[r]["decode_tok_s"]
            row += f" {ratio:.3f}x" + ("" if v == r else f" ({wins}/{len(decode)})") + " |"
        lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    cfg = record["config"]
    print(
        f"{record['model_config'].get('hidden_size')}-wide model, {cfg['input_len']} + "
        f"{cfg['output_len']} tokens, {cfg['repeats']} fresh-process repeats, medians"
    )
    print(format_table(record))
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
