"""mlx-lm-decode: mlx-lm's own stream_generate, with and without attn_kernels.mlx_lm.enable(), in
ONE process on the same random weights: one request per variant per round, the order rotated
every round (progression's rotation), each workload on its own. Decode tok/s is (generated - 1) /
the time from the first generated token to the last (mlx-lm's own generation_tps, which counts
the first token too, is kept beside it).

    mlx-lm-decode --model qwen3-4b --model llama-3-8b --workload 32+97 --workload 8192+65 \\
        --rounds 6 --json-output 'h200-{model}-4bit-mlx-lm-decode-{workload}.json'

One record per model and workload; models run one after the other in the same process.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import qwen3_model
from mlx.utils import tree_flatten

from llm_eval.bench import GPU_BANDWIDTH_GBS, has_gpu, prompt_ids
from llm_eval.progress import Progress
from llm_eval.progression import at_or_above, variant_order
from llm_eval.record import SCHEMA_VERSION, collect_metadata, refuse_overwrite, write_record

VARIANTS = ["mlx-lm", "mlx-lm+kernel"]
# mlx-lm config.json values of the published checkpoints (random weights here).
MODELS = {
    "qwen3-4b": qwen3_model.CONFIGS["qwen3-4b"].to_dict(),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
}


def workload(text: str) -> tuple[int, int]:
    try:
        prompt, generated = (int(x) for x in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not PROMPT+GENERATED, e.g. 32+97") from None
    if prompt < 1 or generated < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: need a prompt >= 1 and >= 2 generated tokens")
    return prompt, generated


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mlx-lm-decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        action="append",
        help="config with random weights, repeatable (default qwen3-4b)",
    )
    p.add_argument("--quantize", choices=["none", "4bit"], default="4bit")
    p.add_argument(
        "--workload",
        type=workload,
        action="append",
        help="PROMPT+GENERATED tokens, repeatable (default 32+97)",
    )
    p.add_argument("--rounds", type=int, default=6, help="requests per variant and workload")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if has_gpu() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json-output",
        help="record path; {model} and {workload} (e.g. 32-97) are filled in, and must be there "
        "when there are several",
    )
    p.add_argument("--force", action="store_true", help="replace existing records")
    args = p.parse_args(argv)
    args.model = args.model or ["qwen3-4b"]
    args.workload = args.workload or [(32, 97)]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    for key, values in (("workload", args.workload), ("model", args.model)):
        if args.json_output and len(values) > 1 and f"{{{key}}}" not in args.json_output:
            p.error(f"--json-output: several {key}s need {{{key}}} in the path")
    for m in args.model:
        for w in args.workload:
            refuse_overwrite(p, output_path(args, m, w), args.force)
    return args


def output_path(args, model: str, w: tuple[int, int]) -> Path | None:
    if not args.json_output:
        return None
    return Path(args.json_output.replace("{workload}", f"{w[0]}-{w[1]}").replace("{model}", model))


def build(name: str, quantize: str, seed: int):
    """mlx-lm's own model class for the config, seeded random weights in bf16 (4-bit: mlx-lm's
    default quantization, group 64)."""
    config = MODELS[name]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if quantize == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over the whole vocabulary ("w0", "w1", ...), no EOS: random weights
    come without one, and nothing may stop a request early."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=words))


def run_request(model, tokenizer, prompt: mx.array, generated: int) -> dict:
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    stamps, tokens, last = [], [], None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=generated):
        stamps.append(time.perf_counter())
        tokens.append(response.token)
        last = response
    if len(stamps) != generated:
        raise RuntimeError(f"stream_generate yielded {len(stamps)} tokens, expected {generated}")
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    decode_s = stamps[-1] - stamps[0]
    return {
        "prefill_s": stamps[0] - start,
        "decode_s": decode_s,
        "step_s": steps,
        "decode_tok_s": (generated - 1) / decode_s,
        "mlx_lm_generation_tps": last.generation_tps,
        "mlx_lm_prompt_tps": last.prompt_tps,
        "peak_memory_gb": last.peak_memory,
        "tokens": tokens,
    }


def kv_bytes_per_token(config: dict, context: float) -> float:
    """K and V bytes one decode step reads at `context` positions (bf16, every layer)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_position = 2 * config["num_key_value_heads"] * head_dim * 2
    return config["num_hidden_layers"] * per_position * context


def run_workload(args, name: str, model, tokenizer, w: tuple[int, int]) -> dict:
    import attn_kernels.mlx_lm as kernel

    prompt_len, generated = w
    prompt = prompt_ids(model.args.vocab_size, prompt_len, mx.random.key(args.seed))[0]

    def request(variant):
        if variant == "mlx-lm":
            return run_request(model, tokenizer, prompt, generated)
        with kernel.enabled():
            result = run_request(model, tokenizer, prompt, generated)
            result["attention_calls"] = kernel.calls()
        return result

    # Warm-up (kernels, allocator), which also records each variant's greedy tokens.
    tokens = {}
    for v in VARIANTS:
        result = request(v)
        tokens[v] = result.pop("tokens")
        print(
            f"{name} {prompt_len}+{generated} warm-up {v}: {result['decode_tok_s']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    same = [a == b for a, b in zip(tokens["mlx-lm"], tokens["mlx-lm+kernel"], strict=True)]
    samples = {v: [] for v in VARIANTS}
    order_log = []
    progress = Progress(args.rounds * len(VARIANTS))
    for r in range(args.rounds):
        order = variant_order(VARIANTS, r)
        order_log.append({"round": r, "order": order})
        for v in order:
            result = request(v)
            result["same_tokens"] = result.pop("tokens") == tokens[v]
            samples[v].append({"round": r, **result})
            progress.step(f"{prompt_len}+{generated} round {r} {v}")

    config = MODELS[name]
    weight_bytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    # Per decode step: every weight once, and K/V at the mean context of the decode steps.
    step_bytes = weight_bytes + kv_bytes_per_token(config, prompt_len + generated / 2)
    limit = GPU_BANDWIDTH_GBS * 1e9 / step_bytes if args.device == "gpu" else None
    medians = {}
    for v in VARIANTS:
        tok_s = statistics.median(s["decode_tok_s"] for s in samples[v])
        medians[v] = {
            "decode_tok_s": tok_s,
            "mlx_lm_generation_tps": statistics.median(
                s["mlx_lm_generation_tps"] for s in samples[v]
            ),
            "median_step_ms": statistics.median(t for s in samples[v] for t in s["step_s"]) * 1e3,
            "prefill_s": statistics.median(s["prefill_s"] for s in samples[v]),
            "bytes_read_gbs": tok_s * step_bytes / 1e9,
            "limit_fraction": tok_s / limit if limit else None,
        }
    base = medians["mlx-lm"]["decode_tok_s"]
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "mlx-lm-decode",
        "metadata": collect_metadata(args.device),
        "model_config": config,
        "config": {
            "model": name,
            "quantize": args.quantize,
            "input_len": prompt_len,
            "output_len": generated,
            "rounds": args.rounds,
            "device": args.device,
            "seed": args.seed,
            "variants": VARIANTS,
            "bandwidth_gbs": GPU_BANDWIDTH_GBS if args.device == "gpu" else None,
        },
        "execution_order": order_log,
        "results": {
            "samples": samples,
            "medians": medians,
            "speedup": medians["mlx-lm+kernel"]["decode_tok_s"] / base,
            "rounds_at_or_above": at_or_above(samples["mlx-lm+kernel"], samples["mlx-lm"]),
            "weight_bytes": weight_bytes,
            "step_bytes": step_bytes,
            "weight_read_limit_tok_s": limit,
            "tokens": tokens,
            # Greedy tokens of the two variants (bf16 rounding differs between the attention
            # paths, so a near-tie can flip on random weights): None where all agree.
            "first_divergence": None if all(same) else same.index(False),
        },
    }


def format_table(record: dict) -> str:
    c, res = record["config"], record["results"]
    lines = [
        f"{c['model']} {c['quantize']} {c['input_len']}+{c['output_len']}, {c['rounds']} rounds",
        "| variant | decode tok/s (min–max) | median step ms | mlx-lm's generation_tps |",
        "|---|---|---|---|",
    ]
    for v, m in res["medians"].items():
        tok_s = [s["decode_tok_s"] for s in res["samples"][v]]
        lines.append(
            f"| {v} | {m['decode_tok_s']:.2f} ({min(tok_s):.2f}–{max(tok_s):.2f}) | "
            f"{m['median_step_ms']:.2f} | {m['mlx_lm_generation_tps']:.2f} |"
        )
    lines.append(
        f"kernel / mlx-lm: {res['speedup']:.3f}x, at or above in "
        f"{res['rounds_at_or_above']}/{c['rounds']} rounds; greedy tokens "
        + (
            "identical"
            if res["first_divergence"] is None
            else f"diverge at token {res['first_divergence']}"
        )
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    for name in args.model:
        model = build(name, args.quantize, args.seed)
        tokenizer = word_tokenizer(model.args.vocab_size)
        for w in args.workload:
            record = run_workload(args, name, model, tokenizer, w)
            print(format_table(record), flush=True)
            path = output_path(args, name, w)
            if path:
                print(f"wrote {write_record(record, path, force=args.force)}", flush=True)
        del model, tokenizer
        mx.clear_cache()


if __name__ == "__main__":
    main()
