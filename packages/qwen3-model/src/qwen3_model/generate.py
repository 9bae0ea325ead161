"""generate: text from a local Qwen3 checkpoint, offline, as mlx-lm's generate does it.

Python: generate_step (token ids), stream_generate (GenerationResponse per token) and generate
(the whole text; verbose prints it as it comes and the speeds at the end), with mlx-lm's
signatures. Decoding is pipelined as in mlx_lm.generate.generate_step: step n+1 is built and
queued (mx.async_eval) before step n's token is read, so the host builds the next graph while
the device runs the current one.

    generate --weights ~/models/Qwen3-0.6B --prompt "The capital of France is" -m 40
    generate --weights ~/models/Qwen3-0.6B -p "Once upon a time" --temp 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from qwen3_model.cache import make_cache
from qwen3_model.configs import CONFIGS
from qwen3_model.loading import CheckpointError, load
from qwen3_model.model import CHECKPOINTS
from qwen3_model.tokenizer import Tokenizer

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the most likely tokens whose probabilities first sum to at least top_p (the nucleus,
    of the untempered distribution as in mlx-lm); the rest get -inf."""
    order = mx.argsort(-logprobs, axis=-1)
    ranked = mx.take_along_axis(logprobs, order, axis=-1)
    probs = mx.exp(ranked.astype(mx.float32))
    mass_before = mx.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p * probs.sum(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ranked, kept - 1, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def make_sampler(temp: float = 0.0, top_p: float = 1.0) -> Sampler:
    """mlx-lm's make_sampler for the two knobs we offer: temp 0 is greedy (argmax); otherwise a
    draw from softmax(logprobs / temp) over the top-p nucleus. Seed with mx.random.seed."""
    if temp < 0:
        raise ValueError(f"temp must be >= 0, got {temp}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temp == 0:
        return greedy

    def sample(logprobs: mx.array) -> mx.array:
        if top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temp), axis=-1)

    return sample


_streams: dict = {}


def own_stream(
    purpose: str = "generate", setup: Callable[[mx.Stream], object] | None = None
) -> mx.Stream:
    """A stream of the default device for `purpose`, made (and passed to `setup`) on first use,
    so it lands on the device the caller chose."""
    key = (purpose, str(mx.default_device()))
    if key not in _streams:
        stream = mx.new_stream(mx.default_device())
        if setup is not None:
            setup(stream)
        _streams[key] = stream
    return _streams[key]


def generation_stream() -> mx.Stream:
    """A stream of its own on the default device, as mlx-lm generates on one."""
    return own_stream()


def generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 2048,
    stream: mx.Stream | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yields (token, logprobs) for up to max_tokens tokens (-1: no limit) after the 1-D prompt.

    All of the prompt but its last token runs in chunks of prefill_step_size, evaluating only the
    cache (no logits); the last token's step gives the first token. From then on step n+1 is
    queued before step n's token is read."""
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt: a non-empty 1-D array of token ids, got shape {prompt.shape}")
    if max_tokens == 0 or max_tokens < -1:
        raise ValueError(f"max_tokens must be >= 1 or -1 (no limit), got {max_tokens}")
    cache = make_cache(model) if prompt_cache is None else prompt_cache
    sampler = sampler or greedy
    stream = stream or generation_stream()

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(stream):
            logits = model(tokens[None], cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    with mx.stream(stream):
        while prompt.size > 1:
            n = min(prefill_step_size, prompt.size - 1)
            model(prompt[None, :n], cache)
            mx.eval([(c.keys, c.values) for c in cache])
            prompt = prompt[n:]
    token, logprobs = step(prompt)
    mx.async_eval(token, logprobs)
    n = 0
    while True:
        last = n + 1 == max_tokens
        if not last:
            next_token, next_logprobs = step(token)
            mx.async_eval(next_token, next_logprobs)
        yield token.item(), logprobs
        if last:
            return
        if n % 256 == 255:
            mx.clear_cache()
        token, logprobs = next_token, next_logprobs
        n += 1


@dataclass
class GenerationResponse:
    """One step of stream_generate (mlx-lm's fields). text: the new piece of text (may be empty);
    prompt_tps: prompt tokens / time to the first token; generation_tps: tokens after the first
    / time since the first (0 for the first); peak_memory in GB; finish_reason: None, "stop"
    (an end-of-sequence token, not in the text) or "length"."""

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None


def stream_generate(
    model, tokenizer, prompt: str | list[int] | mx.array, max_tokens: int = 256, **kwargs
) -> Iterator[GenerationResponse]:
    """Text as it is generated; kwargs go to generate_step (sampler, prompt_cache, ...).
    tokenizer: a qwen3_model Tokenizer or a tokenizers.Tokenizer."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer(tokenizer)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    if not isinstance(prompt, mx.array):
        prompt = mx.array(prompt)
    detokenizer = tokenizer.detokenizer()
    start = time.perf_counter()
    steps = generate_step(prompt, model, max_tokens=max_tokens, **kwargs)
    for n, (token, logprobs) in enumerate(steps):
        now = time.perf_counter()
        if n == 0:
            prompt_tps, first = prompt.size / (now - start), now
        stop = token in tokenizer.eos_token_ids
        last = stop or n + 1 == max_tokens
        text = "" if stop else detokenizer.add_token(token)
        if last:
            text += detokenizer.finalize()
        yield GenerationResponse(
            text=text,
            token=token,
            logprobs=logprobs,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=n / (now - first) if n else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if stop else "length" if last else None,
        )
        if last:
            return


def generate(model, tokenizer, prompt: str | list[int], verbose: bool = False, **kwargs) -> str:
    """The whole generated text. verbose: print it as it comes, then the prompt and generation
    speeds and the peak memory (mlx-lm's report)."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


WEIGHTS_HELP = (
    "a local Qwen3 checkpoint folder (config.json, *.safetensors and tokenizer.json, e.g. a "
    "downloaded Qwen/Qwen3-0.6B or Qwen3-0.6B-MLX-4bit); nothing is downloaded"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        if "required" in message and "--weights" in message:
            message += f"\n  --weights DIR: {WEIGHTS_HELP}"
        super().error(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        prog="generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--weights", type=Path, required=True, metavar="DIR", help=WEIGHTS_HELP)
    p.add_argument(
        "--prompt", "-p", required=True, metavar="TEXT", help="the prompt text; '-' reads stdin"
    )
    p.add_argument("--max-tokens", "-m", type=int, default=100, metavar="N", help="default 100")
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 (default) is greedy",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling mass (default 1: off)",
    )
    p.add_argument(
        "--seed", type=int, metavar="N", help="random seed for sampling (mx.random.seed)"
    )
    p.add_argument(
        "--checkpoint",
        choices=CHECKPOINTS,
        default="decode-attention",
        help="attention path (default decode-attention: the fused kernel inside its measured region)",
    )
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temp < 0:
        p.error(f"--temp must be >= 0, got {args.temp}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.weights.exists():
        hint = (
            " (built-in configs are random weights for llm-eval's bench --model; generate needs a "
            "checkpoint folder)"
            if str(args.weights) in CONFIGS
            else ""
        )
        p.error(f"--weights {args.weights}: no such folder{hint}")
    if not args.weights.is_dir():
        p.error(f"--weights {args.weights}: not a folder")
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if not args.prompt:
        p.error("--prompt is empty")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        tokenizer = Tokenizer.from_folder(args.weights)
        model = load(args.weights, checkpoint=args.checkpoint)
    except (CheckpointError, FileNotFoundError) as e:
        sys.exit(f"generate: error: {e}")
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p)
    generate(
        model, tokenizer, args.prompt, verbose=True, max_tokens=args.max_tokens, sampler=sampler
    )


if __name__ == "__main__":
    main()
