"""bench: decode throughput of one model in one configuration.

Seeded synthetic prompts (token ids away from Qwen3's special tokens), a fresh KV cache per
request, greedy decoding with one synchronisation per generated token. Prefill produces the
first token; decode tok/s is (generated - 1) / decode time. The weight-read limit is the tok/s at
which reading every weight once per token saturates memory bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import qwen3_model
from attn_kernels import SCHEDULES, _ext
from mlx.utils import tree_flatten

from llm_eval.record import SCHEMA_VERSION, collect_metadata, refuse_overwrite, write_record

CHECKPOINTS = ("composition", "decode-attention", "mlx-lm")
GPU_BANDWIDTH_GBS = 4300.0  # H200, measured copy rate (shared/gpu-kit/README.md)
# Embedded defaults: the chapter's workload on a GPU; on this 2-core CPU a size that finishes in
# under a minute (MLX's CPU matmuls decode Qwen3-0.6B at a few tok/s here).
DEFAULTS = {
    "gpu": dict(model="qwen3-4b", quantize="4bit", input_len=32, output_len=97, warmup=2),
    "cpu": dict(model="qwen3-0.6b", quantize="none", input_len=16, output_len=9, warmup=1),
}


def has_gpu() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


def build(args):
    """(model, make_cache, label) for the checkpoint; mlx-lm gets our exact weights."""
    quantize = None if args.quantize == "none" else args.quantize
    source = args.weights or args.model
    checkpoint = "composition" if args.checkpoint == "mlx-lm" else args.checkpoint
    model = qwen3_model.load(source, quantize=quantize, seed=args.seed, checkpoint=checkpoint)
    model.set_schedule(args.schedule)
    kv_bits, kv_group_size = getattr(args, "kv_bits", None), getattr(args, "kv_group_size", 64)
    if args.checkpoint != "mlx-lm":
        if kv_bits:  # a quantized cache in mlx-lm's layout
            return model, lambda m: qwen3_model.make_cache(m, kv_bits, kv_group_size)
        return model, qwen3_model.make_cache
    import mlx.nn as nn
    from mlx_lm.models import qwen3 as mlx_lm_qwen3
    from mlx_lm.models.cache import make_prompt_cache

    twin = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs(**model.args.to_dict()))
    if getattr(model, "quantization", None):
        nn.quantize(twin, **model.quantization)
    twin.load_weights(list(tree_flatten(model.parameters())), strict=True)
    mx.eval(twin.parameters())
    if kv_bits:
        from mlx_lm.models.cache import QuantizedKVCache

        return twin, lambda m: [QuantizedKVCache(kv_group_size, kv_bits) for _ in m.layers]
    return twin, make_prompt_cache


def forward(model, tokens, cache, last_only: bool):
    """Logits of the last position only (the chapter's --prefill-logits last) or of all."""
    if isinstance(model, qwen3_model.Model):
        hidden = model.model(tokens, cache)
    else:  # mlx-lm: same module layout
        hidden = model.model(tokens, cache=cache)
    if last_only:
        hidden = hidden[:, -1:]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def prompt_ids(vocab: int, length: int, key) -> mx.array:
    """(1, length) random ids well inside the ordinary vocabulary: Qwen3's special tokens sit at
    the top."""
    return mx.random.randint(min(100, vocab - 1), min(vocab - 1, 150000), (1, length), key=key)


def run_request(model, make_cache, prompt: mx.array, output_len: int, last_only: bool) -> dict:
    cache = make_cache(model)
    start = time.perf_counter()
    logits = forward(model, prompt, cache, last_only)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    prefill_s = time.perf_counter() - start
    steps = []
    for _ in range(output_len - 1):
        t = time.perf_counter()
        token = mx.argmax(forward(model, token[:, None], cache, True)[:, -1], axis=-1)
        mx.eval(token)
        steps.append(time.perf_counter() - t)
    decode_s = sum(steps)
    return {
        "input_len": prompt.shape[1],
        "output_len": output_len,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "step_s": steps,
        "prefill_tok_s": prompt.shape[1] / prefill_s,
        "decode_tok_s": (output_len - 1) / decode_s if decode_s > 0 else None,
        "output_tok_s": output_len / (prefill_s + decode_s),
    }


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    """--kv-bits / --kv-group-size as mlx-lm's generate takes them (bench and ab-decode)."""
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="quantize the KV cache (mlx-lm's QuantizedKVCache layout; mlx-lm gets its own)",
    )
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="built-in config: " + ", ".join(qwen3_model.CONFIGS))
    p.add_argument("--weights", type=Path, help="local checkpoint folder instead of --model")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="decode-attention")
    p.add_argument("--quantize", choices=["none", "4bit"])
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="auto",
        help="GPU kernel schedule of the decode-attention checkpoint (scheduling experiment)",
    )
    add_kv_cache_args(p)
    p.add_argument("--num-seqs", type=int, default=1)
    p.add_argument("--min-input-len", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--warmup", type=int, help="untimed requests first")
    p.add_argument("--prefill-logits", choices=["last", "all"], default="last")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if has_gpu() else "cpu")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="for the weight-read limit (default: measured on CPU, 4300 on GPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-output", type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing --json-output")
    args = p.parse_args(argv)
    if args.device == "gpu" and not has_gpu():
        p.error("--device gpu: this MLX has no GPU backend")
    d = DEFAULTS[args.device]
    if args.weights and args.model:
        p.error("pass --model or --weights, not both")
    if not args.weights:
        args.model = args.model or d["model"]
        if args.model not in qwen3_model.CONFIGS:
            p.error(
                f"--model: unknown {args.model!r} (choose from {', '.join(qwen3_model.CONFIGS)})"
            )
    args.quantize = args.quantize or ("none" if args.weights else d["quantize"])
    args.min_input_len = args.min_input_len or args.max_input_len or d["input_len"]
    args.max_input_len = args.max_input_len or args.min_input_len
    args.min_output_len = args.min_output_len or args.max_output_len or d["output_len"]
    args.max_output_len = args.max_output_len or args.min_output_len
    args.warmup = d["warmup"] if args.warmup is None else args.warmup
    if not 1 <= args.min_input_len <= args.max_input_len:
        p.error("--min-input-len/--max-input-len: need 1 <= min <= max")
    if not 2 <= args.min_output_len <= args.max_output_len:
        p.error(
            "--min-output-len/--max-output-len: need 2 <= min <= max (decode needs a second token)"
        )
    if args.num_seqs < 1 or args.warmup < 0:
        p.error("--num-seqs must be >= 1 and --warmup >= 0")
    refuse_overwrite(p, args.json_output, args.force)
    return args


def run(args) -> dict:
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = (
            GPU_BANDWIDTH_GBS
            if args.device == "gpu"
            else _ext.measure_read_bandwidth(1 << 30, 3) / 1e9
        )
    print(
        f"loading {args.weights or args.model} ({args.quantize}, {args.checkpoint}) ...",
        file=sys.stderr,
    )
    model, make_cache = build(args)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    vocab = model.args.vocab_size
    key = mx.random.key(args.seed)
    lengths_key, tokens_key = mx.random.split(key)
    n = args.warmup + args.num_seqs
    in_lens = mx.random.randint(
        args.min_input_len, args.max_input_len + 1, (n,), key=lengths_key
    ).tolist()
    out_lens = mx.random.randint(
        args.min_output_len, args.max_output_len + 1, (n,), key=mx.random.split(lengths_key)[0]
    ).tolist()
    prompt_keys = mx.random.split(tokens_key, n)
    requests = []
    for i in range(n):
        prompt = prompt_ids(vocab, in_lens[i], prompt_keys[i])
        label = "warmup" if i < args.warmup else f"request {i - args.warmup + 1}/{args.num_seqs}"
        print(
            f"  {label}: {in_lens[i]} prompt + {out_lens[i]} generated", file=sys.stderr, flush=True
        )
        result = run_request(model, make_cache, prompt, out_lens[i], args.prefill_logits == "last")
        if i >= args.warmup:
            requests.append(result)
    peak = mx.get_peak_memory()
    prefill_tokens = sum(r["input_len"] for r in requests)
    decode_tokens = sum(r["output_len"] - 1 for r in requests)
    prefill_s = sum(r["prefill_s"] for r in requests)
    decode_s = sum(r["decode_s"] for r in requests)
    limit = args.bandwidth_gbs * 1e9 / weight_bytes
    summary = {
        "prefill_tok_s": prefill_tokens / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        "output_tok_s": sum(r["output_len"] for r in requests) / (prefill_s + decode_s),
        "median_step_ms": statistics.median(s for r in requests for s in r["step_s"]) * 1e3,
        "peak_memory_bytes": peak,
        "weight_bytes": weight_bytes,
        "weight_read_limit_tok_s": limit,
        "limit_fraction": decode_tokens / decode_s / limit,
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "model-bench",
        "metadata": collect_metadata(args.device),
        "model_config": model.args.to_dict()
        if hasattr(model.args, "to_dict")
        else vars(model.args),
        "config": config,
        "execution_order": [f"warmup x{args.warmup}", f"requests x{args.num_seqs}"],
        "results": {"requests": requests, "summary": summary},
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    record = run(args)
    s = record["results"]["summary"]
    print(
        f"{args.weights or args.model} {args.quantize} {args.checkpoint} on {args.device}: "
        f"prefill {s['prefill_tok_s']:.1f} tok/s, decode {s['decode_tok_s']:.2f} tok/s "
        f"({s['median_step_ms']:.1f} ms/token), output {s['output_tok_s']:.2f} tok/s, "
        f"peak memory {s['peak_memory_bytes'] / 2**30:.2f} GiB; weight-read limit "
        f"{s['weight_read_limit_tok_s']:.1f} tok/s ({s['weight_bytes'] / 2**30:.2f} GiB at "
        f"{args.bandwidth_gbs:.0f} GB/s), reached {100 * s['limit_fraction']:.1f}%"
    )
    if args.json_output:
        print(f"wrote {write_record(record, args.json_output, force=args.force)}")


if __name__ == "__main__":
    main()
