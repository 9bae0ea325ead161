"""Where our greedy tokens part from mlx-lm's on the same random weights, and whether that step
was a near tie: both models (ours with the fused step, mlx-lm's Qwen3 holding the same arrays)
generate through mlx-lm's own `generate_step`; at the first token that differs, each side's two
most likely tokens and their log-probability gap are printed, with each side's log-probability
of the other side's choice. A gap of a few hundredths of a nat is a tie that bf16 rounding
(logits near 10 are spaced 1/16 apart) can flip either way.

    python3 tools/greedy_parting.py --model qwen3-4b --input-len 32 --output-len 97
    python3 tools/greedy_parting.py --model qwen3-tiny --device cpu --input-len 20 --output-len 30
"""

import argparse

import mlx.core as mx
import qwen3_model
from llm_eval import bench
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache


def greedy(model, cache, prompt, count):
    """Token ids and the log-probabilities (float32) behind each."""
    tokens, logprobs = [], []
    for token, lp in generate_step(prompt, model, max_tokens=count, prompt_cache=cache):
        tokens.append(int(token))
        logprobs.append(lp.astype(mx.float32))
    return tokens, logprobs


def top2(lp):
    order = mx.argsort(-lp)[:2].tolist()
    return [(i, lp[i].item()) for i in order]


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen3-4b", choices=sorted(qwen3_model.CONFIGS))
    p.add_argument("--quantize", choices=["none", "4bit"], default="none")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=97)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: the GPU where MLX has one")
    args = p.parse_args(argv)
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    quantize = None if args.quantize == "none" else args.quantize
    ours = qwen3_model.load(args.model, quantize=quantize, seed=args.seed)
    twin = bench.mlx_lm_twin(ours)
    prompt = bench.prompt_ids(ours.args.vocab_size, args.input_len, mx.random.key(args.seed))
    a, a_lp = greedy(ours, qwen3_model.make_cache(ours), prompt, args.output_len)
    b, b_lp = greedy(twin, make_prompt_cache(twin), prompt, args.output_len)
    label = f"{args.model} {args.quantize} {args.input_len}+{args.output_len}"
    parting = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if parting is None:
        print(f"{label}: all {len(a)} greedy tokens as mlx-lm's")
        return
    print(f"{label}: first differing generated token {parting + 1} of {len(a)}")
    for name, lp, other in (
        ("ours", a_lp[parting], b[parting]),
        ("mlx-lm", b_lp[parting], a[parting]),
    ):
        (t1, l1), (t2, l2) = top2(lp)
        print(
            f"  {name}: top {t1} ({l1:.4f}), second {t2} ({l2:.4f}), gap {l1 - l2:.4f} nat; "
            f"the other side's token {other} at {lp[other].item():.4f}"
        )
    gaps = [top2(lp) for lp in a_lp[:parting]]
    smallest = min(range(len(gaps)), key=lambda i: gaps[i][0][1] - gaps[i][1][1], default=None)
    if smallest is not None:
        (_, l1), (_, l2) = gaps[smallest]
        print(f"  before it, ours' smallest gap: {l1 - l2:.4f} nat at token {smallest + 1}")


if __name__ == "__main__":
    main()
