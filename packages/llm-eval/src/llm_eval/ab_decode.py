"""ab-decode: bench's in-process protocol at the chapter's H200 workload, with a fourth variant.

composition, decode-attention, mlx-lm (its model and its own generate_step: what an mlx-lm user
gets) and mlx-lm-our-loop (its model in our generate_step, which splits a difference between us
and mlx-lm into model and loop), all on the same weights in ONE process: one request each per
round, order rotated every round, every sample kept. All loops are pipelined (mx.async_eval), as
mlx-lm's generate_step is. The fresh-process protocol stays `progression`.

    ab-decode --model qwen3-4b --quantize none --input-len 128 --output-len 129 --rounds 12
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import mlx.core as mx
import qwen3_model
from qwen3_model import CheckpointError

from llm_eval import bench
from llm_eval.progress import Progress
from llm_eval.record import add_record_args, positive_float, refuse_overwrite, write_record

DEFAULT_VARIANTS = ["composition", "decode-attention", "mlx-lm", "mlx-lm-our-loop"]
# decode-attention-unfused (on request): the checkpoint without its fused projections and step,
# DecodeAttention per layer (an A/B of that op inside the model).
VARIANTS = [*DEFAULT_VARIANTS, "decode-attention-unfused"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ab-decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="built-in config, random weights (default qwen3-4b)")
    p.add_argument("--weights", type=Path, help="a local checkpoint folder instead of --model")
    p.add_argument("--quantize", choices=["none", *qwen3_model.QUANTIZATIONS], default="none")
    bench.add_kv_cache_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=129)
    p.add_argument("--rounds", type=int, default=12, help="requests per variant (default 12)")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated subset of " + ",".join(VARIANTS) + " (must include mlx-lm, the "
        "reference; long prompts: leave out composition, whose readable prefill needs O(L^2) "
        "memory)",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if bench.has_gpu() else "cpu")
    p.add_argument(
        "--bandwidth-gbs", type=positive_float, help="for the read floor (see bench --help)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_record_args(p)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if "mlx-lm" not in args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants: a subset of {','.join(VARIANTS)} that includes mlx-lm")
    for name, low in (("rounds", 1), ("input_len", 1), ("output_len", 2)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}")
    bench.check_kv_cache_args(p, args)
    bench.check_source(p, args, "qwen3-4b")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def bench_args(args) -> argparse.Namespace:
    return argparse.Namespace(
        **{k: v for k, v in vars(args).items() if k not in ("json_output", "force", "variants")},
        variant=list(args.variants),
        warmup=1,
        schedule="auto",
    )


def run(args) -> dict:
    return bench.run(bench_args(args), Progress(), kind="ab-decode")


def main(argv=None) -> None:
    args = parse_args(argv)
    if mx.distributed.init().rank() != 0:  # under mlx.launch: rank 0 reports for every rank
        bench.run(bench_args(args), Progress(stream=io.StringIO()), kind="ab-decode")
        return
    try:
        record = run(args)
    except (CheckpointError, FileNotFoundError) as e:
        sys.exit(f"ab-decode: error: {e}")
    print(bench.format_report(record))
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
