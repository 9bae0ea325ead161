"""In-process A/B of whole-model decode: composition, decode-attention and mlx-lm on the same
weights in one process, one request each per round, order rotated every round (progression's
rotation). Fresh processes (llm_eval.progression) vary by +-20% on the H200; this separates the
attention path from process-to-process noise.

    python3 tools/ab_decode.py --model qwen3-4b --quantize none --input-len 128 --output-len 129 \
        --rounds 12 --json-output $OUT/ab.json
"""

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
from llm_eval import bench
from llm_eval.progression import variant_order
from llm_eval.record import collect_metadata

VARIANTS = ["composition", "decode-attention", "mlx-lm"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--quantize", choices=["none", "4bit"], default="none")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=129)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--json-output", type=Path)
    args = p.parse_args()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)

    def build(checkpoint):
        ns = argparse.Namespace(
            quantize=args.quantize, weights=None, model=args.model, seed=0,
            checkpoint=checkpoint, schedule="auto",
        )  # fmt: skip
        return bench.build(ns)

    ours, make_ours = build("decode-attention")
    twin, make_twin = build("mlx-lm")
    prompt = mx.random.randint(100, 150000, (1, args.input_len), key=mx.random.key(1))

    def request(variant):
        if variant == "mlx-lm":
            return bench.run_request(twin, make_twin, prompt, args.output_len, True)
        ours.set_checkpoint(variant)
        return bench.run_request(ours, make_ours, prompt, args.output_len, True)

    for v in VARIANTS:  # warm-up: compile, allocate
        request(v)
    samples = {v: [] for v in VARIANTS}
    order_log = []
    for r in range(args.rounds):
        order = variant_order(VARIANTS, r)
        order_log.append({"round": r, "order": order})
        for v in order:
            result = request(v)
            samples[v].append({k: result[k] for k in ("decode_tok_s", "prefill_tok_s", "step_s")})
        line = " ".join(f"{v}={samples[v][-1]['decode_tok_s']:.1f}" for v in order)
        print(f"round {r + 1}/{args.rounds}: {line}", flush=True)
    medians = {v: statistics.median(s["decode_tok_s"] for s in samples[v]) for v in VARIANTS}
    for v in VARIANTS:
        decode = [s["decode_tok_s"] for s in samples[v]]
        step = statistics.median(t for s in samples[v] for t in s["step_s"]) * 1e3
        wins = sum(
            a["decode_tok_s"] >= b["decode_tok_s"]
            for a, b in zip(samples[v], samples["mlx-lm"], strict=True)
        )
        print(
            f"{v}: decode {medians[v]:.1f} tok/s ({min(decode):.1f}-{max(decode):.1f}), "
            f"median step {step:.2f} ms, vs mlx-lm {medians[v] / medians['mlx-lm']:.3f}x "
            f"(at or above in {wins}/{args.rounds} rounds)"
        )
    if args.json_output:
        record = {
            "kind": "ab-decode",
            "metadata": collect_metadata(args.device),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "execution_order": order_log,
            "results": {"samples": samples, "medians": medians},
        }
        args.json_output.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
