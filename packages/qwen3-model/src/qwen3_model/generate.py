"""generate: stream greedy text from a local Qwen3 checkpoint, offline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

from qwen3_model.cache import make_cache
from qwen3_model.loading import load
from qwen3_model.model import CHECKPOINTS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="generate", description=__doc__)
    p.add_argument(
        "--weights", type=Path, help="folder with config.json, *.safetensors, tokenizer.json"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="decode-attention")
    args = p.parse_args(argv)
    if args.weights is None:
        p.error(
            "pass --weights DIR: a local Qwen3 checkpoint (config.json, *.safetensors and "
            "tokenizer.json, e.g. a downloaded Qwen/Qwen3-0.6B or Qwen3-0.6B-MLX-4bit); "
            "nothing is downloaded"
        )
    tokenizer_file = args.weights / "tokenizer.json"
    if not tokenizer_file.exists():
        p.error(f"{args.weights} has no tokenizer.json")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    model = load(args.weights, checkpoint=args.checkpoint)
    cache = make_cache(model)
    tokens = mx.array([tokenizer.encode(args.prompt).ids])
    generated: list[int] = []
    printed = ""
    for _ in range(args.max_tokens):
        logits = model(tokens, cache)[:, -1, :]
        token = int(mx.argmax(logits, axis=-1).item())
        generated.append(token)
        text = tokenizer.decode(generated)
        sys.stdout.write(text[len(printed) :])
        sys.stdout.flush()
        printed = text
        if token in (tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")):
            break
        tokens = mx.array([[token]])
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
