"""ab-decode: whole-model decode of composition, decode-attention and mlx-lm in ONE process on the
same weights: one request each per round, order rotated every round (progression's rotation), so
the attention path is compared without process-to-process noise (+-20% between fresh processes on
the H200). The fresh-process protocol stays `progression`; this is its in-process companion.

    ab-decode --model qwen3-4b --quantize none --input-len 128 --output-len 129 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import mlx.core as mx

from llm_eval import bench
from llm_eval.progress import Progress
from llm_eval.progression import at_or_above, variant_order
from llm_eval.record import SCHEMA_VERSION, collect_metadata, refuse_overwrite, write_record

VARIANTS = list(bench.CHECKPOINTS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ab-decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen3-4b", help="built-in config (random weights)")
    p.add_argument("--weights", type=Path, help="a local checkpoint folder instead of --model")
    p.add_argument("--quantize", choices=["none", "4bit"], default="none")
    bench.add_kv_cache_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=129)
    p.add_argument("--rounds", type=int, default=12, help="requests per variant (default 12)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if bench.has_gpu() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-output", type=Path)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.input_len < 1 or args.output_len < 2:
        p.error("--rounds and --input-len must be >= 1, --output-len >= 2")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def run(args) -> dict:
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)

    def build(checkpoint):
        ns = argparse.Namespace(**{**vars(args), "checkpoint": checkpoint, "schedule": "auto"})
        return bench.build(ns)

    ours, make_ours = build("decode-attention")  # composition: the same model, other checkpoint
    twin, make_twin = build("mlx-lm")
    prompt = bench.prompt_ids(ours.args.vocab_size, args.input_len, mx.random.key(args.seed))

    def request(variant):
        if variant == "mlx-lm":
            return bench.run_request(twin, make_twin, prompt, args.output_len, True)
        ours.set_checkpoint(variant)
        return bench.run_request(ours, make_ours, prompt, args.output_len, True)

    for v in VARIANTS:  # warm-up: compilation, allocator
        request(v)
    samples = {v: [] for v in VARIANTS}
    order_log = []
    progress = Progress(args.rounds * len(VARIANTS))
    for r in range(args.rounds):
        order = variant_order(VARIANTS, r)
        order_log.append({"round": r, "order": order})
        for v in order:
            result = request(v)
            samples[v].append({"round": r, **result})
            progress.step(f"round {r} {v}")
    medians = {
        v: {
            "decode_tok_s": statistics.median(s["decode_tok_s"] for s in samples[v]),
            "prefill_tok_s": statistics.median(s["prefill_tok_s"] for s in samples[v]),
            "median_step_ms": statistics.median(t for s in samples[v] for t in s["step_s"]) * 1e3,
        }
        for v in VARIANTS
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "ab-decode",
        "metadata": collect_metadata(args.device),
        "model_config": ours.args.to_dict(),
        "config": config,
        "execution_order": order_log,
        "results": {"samples": samples, "medians": medians},
    }


def format_table(record: dict) -> str:
    samples, medians = record["results"]["samples"], record["results"]["medians"]
    lines = [
        "| variant | decode tok/s (min–max) | median step ms | prefill tok/s | vs mlx-lm "
        "(rounds at or above) |",
        "|---|---|---|---|---|",
    ]
    for v, m in medians.items():
        decode = [s["decode_tok_s"] for s in samples[v]]
        wins = at_or_above(samples[v], samples["mlx-lm"])
        ratio = m["decode_tok_s"] / medians["mlx-lm"]["decode_tok_s"]
        lines.append(
            f"| {v} | {m['decode_tok_s']:.2f} ({min(decode):.2f}–{max(decode):.2f}) | "
            f"{m['median_step_ms']:.2f} | {m['prefill_tok_s']:.1f} | {ratio:.3f}x "
            f"({wins}/{len(decode)}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    print(format_table(record))
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
