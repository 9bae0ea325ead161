"""bench: the main job. Qwen3 decoding with the fused decode-attention kernel, side by side with
the readable attention composition and with mlx-lm (its own Qwen3 and its own generate_step:
what an mlx-lm user gets), all three on the same weights in one process.

Each round runs one request per model, the order rotated every round; every sample is kept and
the table shows medians with their min-max. A request is a seeded random prompt (ids away from
Qwen3's special tokens) and greedy decoding, pipelined as mlx-lm does it (step n+1 queued before
step n's token is read). prefill tok/s: prompt tokens / time to the first token; decode tok/s:
the tokens after the first / the time after the first (both as mlx-lm reports them; on a CPU,
where mx.async_eval returns only when most of the step it queued has run, the time to the first
token includes the first decode step). GB/s: the bytes a decode step must read
(every weight once, plus the K/V cached so far) per second; "of floor": that rate over the
memory read bandwidth (measured here on a CPU; 4.3 TB/s on an H200; else --bandwidth-gbs).

Without --weights the weights are random, drawn in the shape of a published Qwen3 config: no
checkpoint can be downloaded here, and speed does not depend on the values. Records go to
benchmark_results/ (the nearest such folder from the current one upwards, else ./
benchmark_results), under a new name if one exists; --output names the file, --no-record skips.

    bench                                         # CPU: qwen3-0.6b bf16, 8 + 5 tokens, 3 rounds
    bench --input-len 1024 --output-len 33        # a longer context (CPU: several minutes)
    bench --model qwen3-4b --quantize 4bit --input-len 32 --output-len 97 --rounds 6   # a GPU
    bench --weights ~/models/Qwen3-0.6B           # a local checkpoint folder
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import re
import statistics
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import qwen3_model
from attn_kernels import SCHEDULES, _ext
from mlx.utils import tree_flatten
from qwen3_model import CheckpointError, describe_weights, generate_step, make_cache
from qwen3_model.generate import generation_stream as our_generation_stream

from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    positive_float,
    write_record,
)

VARIANTS = ("decode-attention", "composition", "mlx-lm")
# mlx-lm's model in our generate_step: with "mlx-lm" it splits a difference into model and loop.
# decode-attention-unfused: the checkpoint without its fused projections and AttentionStep
# (separate ops, then the DecodeAttention op per layer), for A/B measurements of that op.
# decode-attention-swiglu-apart: the MLP's SwiGLU as MLX's op before down_proj, not inside its
# decode_linear (the CPU; elsewhere the same as decode-attention): Model.set_swiglu_in_linear.
ALL_VARIANTS = (
    *VARIANTS,
    "mlx-lm-our-loop",
    "decode-attention-unfused",
    "decode-attention-swiglu-apart",
)
H200_BANDWIDTH_GBS = 4300.0  # measured copy rate (docs: the H200 notes)
# Embedded defaults: the chapter's workload on a GPU; on a CPU a size that finishes in a minute
# or two on two cores (MLX's bf16 CPU matmuls decode qwen3-0.6b at about a token a second).
DEFAULTS = {
    "gpu": dict(model="qwen3-4b", quantize="4bit", input_len=32, output_len=97, rounds=6),
    "cpu": dict(model="qwen3-0.6b", quantize="none", input_len=8, output_len=5, rounds=3),
}


def has_gpu() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


def variant_order(variants: list[str], repeat: int) -> list[str]:
    """Rotated by `repeat`, reversed in odd rounds of rotations: with two variants forward then
    reverse; with three, six repeats run all six orders."""
    shift = repeat % len(variants)
    order = list(variants[shift:]) + list(variants[:shift])
    return order[::-1] if (repeat // len(variants)) % 2 else order


def at_or_above(mine: list[dict], theirs: list[dict]) -> int:
    """Rounds (paired by position) in which `mine` decoded at least as fast as `theirs`."""
    return sum(a["decode_tok_s"] >= b["decode_tok_s"] for a, b in zip(mine, theirs, strict=True))


def mlx_lm_twin(model):
    """mlx-lm's Qwen3 holding exactly our weight arrays (names are the same; nothing copied)."""
    import mlx.nn as nn
    from mlx_lm.models import qwen3 as mlx_lm_qwen3

    twin = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs(**model.args.to_dict()))
    if getattr(model, "quantization", None):
        nn.quantize(twin, **model.quantization)
    twin.load_weights(list(tree_flatten(model.parameters())), strict=True)
    mx.eval(twin.parameters())
    return twin


def prompt_ids(vocab: int, length: int, key) -> mx.array:
    """(length,) random ids well inside the ordinary vocabulary: Qwen3's special tokens sit at
    the top."""
    return mx.random.randint(min(100, vocab - 1), min(vocab - 1, 150000), (length,), key=key)


def timed(steps, prompt_len: int, count: int, streams=()) -> dict:
    """Take `count` tokens from a generate_step-style iterator, timing each as it is handed over.

    Every loop measured here has queued the step after the last token taken (mlx-lm's
    generate_step always queues one past its max_tokens; ours is asked for count + 1). That
    matters on a CPU, where mx.async_eval returns only when most of the queued step has run: a
    loop that queued nothing after its last token would end a step early.

    Peak memory (mx.get_peak_memory(), all allocations, weights included) is read twice: up to
    the first token (the prefill's) and after it (the decode steps'); call mx.reset_peak_memory()
    first."""
    start = time.perf_counter()
    stamps, tokens = [], []
    prefill_peak = None
    for token, _ in steps:
        stamps.append(time.perf_counter())
        tokens.append(token)
        if prefill_peak is None:
            prefill_peak = mx.get_peak_memory()
            mx.reset_peak_memory()
        if len(tokens) == count:
            break
    steps.close()
    for stream in streams:  # the step queued past the last token ends outside the timing
        mx.synchronize(stream)
    decode_peak = mx.get_peak_memory()
    prefill_s = stamps[0] - start
    step_s = [b - a for a, b in itertools.pairwise(stamps)]
    decode_s = stamps[-1] - stamps[0]
    return {
        "input_len": prompt_len,
        "output_len": len(tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "step_s": step_s,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": len(step_s) / decode_s if decode_s > 0 else None,
        "tokens": tokens,
        "prefill_peak_memory_bytes": prefill_peak,
        "decode_peak_memory_bytes": decode_peak,
        "peak_memory_bytes": max(prefill_peak, decode_peak),
    }


class Models:
    """The variants on one set of weight arrays. Ours: one model whose attention path is
    switched per request; mlx-lm: its model, its cache and its generate_step; mlx-lm-our-loop:
    its model and cache in our generate_step."""

    def __init__(
        self, model, schedule: str = "auto", kv_bits=None, kv_group_size: int = 64, peer_kv="same"
    ):
        from mlx_lm.generate import generate_step as mlx_lm_generate_step
        from mlx_lm.generate import generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.model.set_schedule(schedule)
        self.kv = (kv_bits, kv_group_size)
        # mlx-lm's cache: "same" as ours, or "none" (its full-precision KVCache).
        self.peer_kv = (kv_bits if peer_kv == "same" else None, kv_group_size)
        self.twin = mlx_lm_twin(model)
        self._mlx_lm_step, self._mlx_lm_cache = mlx_lm_generate_step, make_prompt_cache
        # mlx-lm makes its stream when imported, on the default device of that moment.
        device = mx.default_device()
        mlx_lm_stream = generation_stream if generation_stream.device == device else None
        mlx_lm_stream = mlx_lm_stream or mx.new_stream(device)
        self._mlx_lm_kw = {"stream": mlx_lm_stream}
        self.streams = (mlx_lm_stream, our_generation_stream())

    def steps(self, variant: str, prompt: mx.array, output_len: int):
        """The token iterator of `variant`, with the step after output_len tokens queued."""
        if variant.startswith("mlx-lm"):
            cache = self._twin_cache()
        if variant == "mlx-lm":
            return self._mlx_lm_step(
                prompt, self.twin, max_tokens=output_len, prompt_cache=cache, **self._mlx_lm_kw
            )
        if variant == "mlx-lm-our-loop":
            return generate_step(prompt, self.twin, max_tokens=output_len + 1, prompt_cache=cache)
        self.model.set_checkpoint("composition" if variant == "composition" else "decode-attention")
        self.model.set_fused_step(not variant.endswith("-unfused"))
        self.model.set_swiglu_in_linear(not variant.endswith("-swiglu-apart"))
        cache = make_cache(self.model, *self.kv) if self.kv[0] else make_cache(self.model)
        return generate_step(prompt, self.model, max_tokens=output_len + 1, prompt_cache=cache)

    def _twin_cache(self):
        """mlx-lm's cache: with --kv-bits its QuantizedKVCache (what mlx-lm's kv_bits gives)
        unless --mlx-lm-kv-bits none."""
        bits, group_size = self.peer_kv
        if bits:
            from mlx_lm.models.cache import QuantizedKVCache

            return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in self.twin.layers]
        return self._mlx_lm_cache(self.twin)

    def request(self, variant: str, prompt: mx.array, output_len: int) -> dict:
        mx.reset_peak_memory()
        steps = self.steps(variant, prompt, output_len)
        return timed(steps, prompt.size, output_len, self.streams)


def kv_bytes_per_position(model, kv_bits=None, kv_group_size: int = 64) -> int:
    """Keys and values of one position, all layers, in the cache's dtype (the activations'), or
    quantized (kv_bytes)."""
    a = model.args
    itemsize = model.model.norm.weight.dtype.size
    head = kv_bytes(a.head_dim, itemsize, kv_bits, kv_group_size)
    return 2 * a.num_hidden_layers * a.num_key_value_heads * head


def kv_bytes(head_dim: int, itemsize: int, kv_bits=None, kv_group_size: int = 64) -> int:
    """One head's key (or value) at one position: head_dim values of `itemsize` bytes, or
    quantized: packed codes plus a scale and a bias of `itemsize` bytes per group."""
    if kv_bits:
        return head_dim * kv_bits // 8 + 2 * (head_dim // kv_group_size) * itemsize
    return head_dim * itemsize


def add_reads(sample: dict, weight_bytes: int, kv_per_position: int, bandwidth_gbs) -> None:
    """GB/s of the reads the decode steps must make: step i (1-based) reads every weight and the
    K/V of input_len + i positions."""
    steps = sample["output_len"] - 1
    contexts = sum(sample["input_len"] + i for i in range(1, steps + 1))
    read = steps * weight_bytes + contexts * kv_per_position
    sample["read_bytes"] = read
    sample["read_gbs"] = read / sample["decode_s"] / 1e9 if sample["decode_s"] > 0 else None
    sample["floor_fraction"] = (
        sample["read_gbs"] / bandwidth_gbs if bandwidth_gbs and sample["read_gbs"] else None
    )


def summarise(samples: dict[str, list[dict]]) -> dict:
    """Per variant: medians (and min/max of the tok/s), ratios to mlx-lm where it ran."""
    out = {}
    for v, rows in samples.items():
        m = {}
        for key in ("prefill_tok_s", "decode_tok_s"):
            values = [r[key] for r in rows]
            m[key], m[key + "_min"], m[key + "_max"] = (
                statistics.median(values),
                min(values),
                max(values),
            )
        m["output_tok_s"] = statistics.median(
            r["output_len"] / (r["prefill_s"] + r["decode_s"]) for r in rows
        )
        m["median_step_ms"] = statistics.median(t for r in rows for t in r["step_s"]) * 1e3
        for key in ("peak_memory_bytes", "prefill_peak_memory_bytes", "decode_peak_memory_bytes"):
            m[key] = statistics.median(r[key] for r in rows)
        for key in ("read_gbs", "floor_fraction"):
            values = [r[key] for r in rows if r.get(key) is not None]
            m[key] = statistics.median(values) if values else None
        out[v] = m
    if "mlx-lm" in out:
        for v, m in out.items():
            m["vs_mlx_lm"] = m["decode_tok_s"] / out["mlx-lm"]["decode_tok_s"]
            m["rounds_at_or_above_mlx_lm"] = at_or_above(samples[v], samples["mlx-lm"])
    return out


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def find_results_dir(start: Path | None = None) -> Path:
    """benchmark_results/ in the current folder or the nearest one above that has it."""
    start = (start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "benchmark_results").is_dir():
            return folder / "benchmark_results"
    return start / "benchmark_results"


def gpu_read_bandwidth() -> float:
    """Bytes per second MLX's sum reads a 1 GiB array at on the GPU (best of 6)."""
    a = mx.ones((1 << 28,), mx.float32)
    mx.eval(a)
    best = 0.0
    for _ in range(6):
        start = time.perf_counter()
        mx.eval(a.sum())
        best = max(best, a.nbytes / (time.perf_counter() - start))
    return best


def machine_tag(device: str) -> str:
    if device == "cpu":
        return f"cpu-{os.cpu_count()}core"
    if mx.cuda.is_available():
        name = gpu_name()
        return next((tag for tag in ("h200", "h100") if tag.upper() in name), "cuda")
    return "metal"


def gpu_name() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip()
    except OSError:
        return ""


def record_name(args, weights_tag: str) -> str:
    model = args.model or re.sub(r"[^A-Za-z0-9._-]+", "-", Path(args.weights).resolve().name)
    return (
        f"{machine_tag(args.device)}-{model}-{weights_tag}-bench-"
        f"{args.input_len}+{args.output_len}-mlx-{mx.__version__}"
    )


def unique_path(folder: Path, stem: str) -> Path:
    """folder/stem.json, or stem-2.json, stem-3.json ... : an existing record is never replaced."""
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def check_source(p: argparse.ArgumentParser, args, default_model: str) -> None:
    """--model (a built-in config) or --weights (a local folder), not both; --model defaults to
    default_model where neither is given."""
    if args.weights and args.model:
        p.error("pass --model or --weights, not both")
    if args.weights:
        if not args.weights.exists():
            p.error(f"--weights {args.weights}: no such folder")
        if not args.weights.is_dir():
            p.error(f"--weights {args.weights}: not a folder")
        return
    args.model = args.model or default_model
    if args.model not in qwen3_model.CONFIGS:
        p.error(f"--model: unknown {args.model!r} (choose from {', '.join(qwen3_model.CONFIGS)})")


def check_kv_cache_args(p: argparse.ArgumentParser, args) -> None:
    if args.mlx_lm_kv_bits != "same" and not args.kv_bits:
        p.error("--mlx-lm-kv-bits none needs --kv-bits (without it both caches are full precision)")


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    """--kv-bits / --kv-group-size as mlx-lm's generate takes them (bench and ab-decode)."""
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="quantize the KV cache (mlx-lm's QuantizedKVCache layout, in every model)",
    )
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument(
        "--mlx-lm-kv-bits",
        choices=["same", "none"],
        default="same",
        help="mlx-lm's cache with --kv-bits: the same quantized cache (default) or none, its "
        "full-precision KVCache: the peer where mlx-lm's QuantizedKVCache does not run (MLX "
        "0.32.4's CUDA quantized_matmul takes no view of a growing cache)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="built-in config, random weights: " + ", ".join(qwen3_model.CONFIGS),
    )
    p.add_argument("--weights", type=Path, metavar="DIR", help="a local checkpoint folder")
    p.add_argument(
        "--quantize",
        choices=["none", *qwen3_model.QUANTIZATIONS],
        help="quantize the weights as loaded (random ones, or a --weights float checkpoint); "
        "default: none with --weights, else none on a CPU and 4bit on a GPU",
    )
    p.add_argument(
        "--variant",
        action="append",
        choices=ALL_VARIANTS,
        help="repeatable; default the first three (mlx-lm-our-loop: mlx-lm's model in our loop; "
        "decode-attention-unfused: without the fused projections and step, DecodeAttention per "
        "layer; decode-attention-swiglu-apart: the MLP's SwiGLU as MLX's op, not inside the "
        "down projection's CPU kernel)",
    )
    p.add_argument("--input-len", type=int, metavar="N", help="prompt tokens")
    p.add_argument("--output-len", type=int, metavar="N", help="generated tokens (>= 2)")
    p.add_argument("--rounds", type=int, metavar="N", help="timed requests per model")
    p.add_argument(
        "--warmup", type=int, default=1, metavar="N", help="untimed requests per model (1)"
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if has_gpu() else "cpu")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="auto",
        help="GPU kernel schedule of decode-attention (scheduling experiment)",
    )
    add_kv_cache_args(p)
    p.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        metavar="GB/s",
        help="memory read bandwidth for the floor (default: measured on a CPU, 4300 on an H200)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="weights and prompts (default 0)"
    )
    add_record_args(
        p,
        help="the record's file (or a folder for the default name)",
        path_dest="output",
        force_dest="overwrite",
    )
    p.add_argument("--no-record", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.device == "gpu" and not has_gpu():
        p.error("--device gpu: this MLX has no GPU backend")
    d = DEFAULTS[args.device]
    check_source(p, args, d["model"])
    args.quantize = args.quantize or ("none" if args.weights else d["quantize"])
    for key in ("input_len", "output_len", "rounds"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    args.variant = list(dict.fromkeys(args.variant or VARIANTS))
    if args.input_len < 1:
        p.error("--input-len must be >= 1")
    check_kv_cache_args(p, args)
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (decode needs a second token)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.output and args.output.is_file() and not args.overwrite:
        p.error(f"--output {args.output} exists; pass --overwrite to replace it")
    return args


def describe_origin(args) -> str:
    if args.weights:
        files = sorted(Path(args.weights).glob("*.safetensors"))
        return f"{args.weights} (config.json + {len(files)} safetensors file(s))"
    return (
        f"random (seed {args.seed}), in the shape of the published {args.model} config: no "
        "checkpoint can be downloaded here, and speed does not depend on the values; "
        "--weights DIR runs a local one"
    )


def run(args, progress: Progress | None = None, kind: str = "model-bench") -> dict:
    progress = progress or Progress()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    metadata = collect_metadata(args.device)
    load_start = load_average()
    if args.bandwidth_gbs is None:
        if args.device == "cpu":
            progress.update("measuring the memory read bandwidth ...")
            args.bandwidth_gbs = _ext.measure_read_bandwidth(1 << 30, 3) / 1e9
        elif mx.cuda.is_available() and "H200" in gpu_name():
            args.bandwidth_gbs = H200_BANDWIDTH_GBS
    source = args.weights or args.model
    progress.say(f"loading {source} ...")
    started = time.perf_counter()
    model = qwen3_model.load(
        source,
        quantize=None if args.quantize == "none" else args.quantize,
        seed=args.seed,
        progress=lambda done, total: progress.update(f"loading {source}: layer {done}/{total}"),
    )
    kv = (getattr(args, "kv_bits", None), getattr(args, "kv_group_size", 64))
    models = Models(model, args.schedule, *kv, peer_kv=getattr(args, "mlx_lm_kv_bits", "same"))
    group = mx.distributed.init()
    if group.size() > 1:  # under mlx.launch: tensor parallel, mlx-lm's layout in both models
        progress.say(f"sharding over {group.size()} ranks")
        model.shard(group)
        models.twin.shard(group)
    progress.say(f"loaded in {time.perf_counter() - started:.1f} s; warming up")
    weight_bytes = qwen3_model.weight_bytes(model)  # this rank's share
    kv_per_position = kv_bytes_per_position(model, *kv)
    peer_kv_per_position = kv_bytes_per_position(model, *models.peer_kv)
    prompt = prompt_ids(model.args.vocab_size, args.input_len, mx.random.key(args.seed))

    progress.restart(args.warmup * len(args.variant))
    for _ in range(args.warmup):  # compilation, allocator: the prompt and one decode step
        for v in args.variant:
            models.request(v, prompt, 2)
            progress.step(f"warm-up {v}")
    samples = {v: [] for v in args.variant}
    order_log = []
    progress.restart(args.rounds * len(args.variant))
    for r in range(args.rounds):
        order = variant_order(args.variant, r)
        order_log.append({"round": r, "order": order})
        for v in order:
            sample = {"round": r, **models.request(v, prompt, args.output_len)}
            kv_read = peer_kv_per_position if v.startswith("mlx-lm") else kv_per_position
            add_reads(sample, weight_bytes, kv_read, args.bandwidth_gbs)
            samples[v].append(sample)
            progress.step(f"round {r + 1}/{args.rounds} {v}: {sample['decode_tok_s']:.2f} tok/s")
    progress.close()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["ranks"] = group.size()
    config["weights_origin"] = describe_origin(args)
    config["quantization"] = describe_weights(model)
    q = getattr(model, "quantization", None)
    config["weights_tag"] = f"{q['bits']}bit" if q else config["quantization"].split()[0]
    if kv[0]:
        config["weights_tag"] += f"-kv{kv[0]}bit"
        config["quantization"] += f"; KV cache {kv[0]}-bit, group {kv[1]}"
        if not models.peer_kv[0]:
            config["quantization"] += " (mlx-lm's: full precision)"
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "metadata": metadata,
        "model_config": model.args.to_dict(),
        "config": config,
        "execution_order": order_log,
        "results": {
            "weight_bytes": weight_bytes,
            "kv_bytes_per_position": kv_per_position,
            "mlx_lm_kv_bytes_per_position": peer_kv_per_position,
            "samples": samples,
            "medians": summarise(samples),
            "per_rank": gather_ranks(samples, group),
            # 1-minute load averages: other work on a shared machine shows up here.
            "load_average": {"start": load_start, "end": load_average()},
        },
    }


def gather_ranks(samples: dict[str, list[dict]], group) -> list[dict] | None:
    """Every rank's prefill and decode tok/s per variant (rank 0 writes the record; the ranks
    run in lock-step, two all_sums a layer, so their times differ only by their own host work)."""
    if group.size() == 1:
        return None
    keys = ("prefill_tok_s", "decode_tok_s")
    mine = mx.array([[r[k] for k in keys] for v in samples for r in samples[v]], mx.float32)
    every = mx.distributed.all_gather(mine[None], group=group).tolist()
    out = []
    for rank, rows in enumerate(every):
        per_variant, i = {}, 0
        for v in samples:
            n = len(samples[v])
            per_variant[v] = {k: [row[j] for row in rows[i : i + n]] for j, k in enumerate(keys)}
            i += n
        out.append({"rank": rank, **per_variant})
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def peak_gib(medians: dict, phase: str) -> str:
    """The phase's median peak memory in GiB ("?" in records made before it was kept)."""
    value = medians.get(f"{phase}_peak_memory_bytes")
    return "?" if value is None else f"{value / 2**30:.2f}"


def format_report(record: dict) -> str:
    cfg, res, meta = record["config"], record["results"], record["metadata"]
    medians, samples = res["medians"], res["samples"]
    device = meta["device"]
    if device.get("cpu"):
        isa = ", ".join(device.get("cpu_isa") or []) or "ISA unknown"
        machine = f"CPU {device['cpu']} ({isa}), {device.get('cpu_count')} cores"
    else:
        machine = f"GPU {device.get('gpu') or device.get('mlx_device_info', {}).get('device_name')}"
    bandwidth = cfg.get("bandwidth_gbs")
    bandwidth_text = (
        f"read bandwidth {bandwidth:.1f} GB/s" if bandwidth else "read bandwidth unknown"
    )
    steps = cfg["output_len"] - 1

    def item(label: str, text: str) -> str:
        return textwrap.fill(
            text, width=100, initial_indent=f"{label:<10}", subsequent_indent=" " * 10
        )

    lines = [
        item("weights", cfg["weights_origin"]),
        item(
            "",
            f"{cfg['quantization']}, {res['weight_bytes'] / 2**30:.2f} GiB; the same arrays in "
            "every model",
        ),
        item(
            "machine",
            f"{machine}; {bandwidth_text}; MLX {meta['versions']['mlx']}, mlx-lm "
            f"{meta['versions']['mlx_lm']}",
        ),
        item(
            "workload",
            f"{cfg['input_len']}-token prompt + {cfg['output_len']} generated ({steps} decode "
            f"steps), greedy, pipelined; {cfg['rounds']} rounds, order rotated; "
            f"{cfg['warmup']} warm-up request(s) each"
            + (
                f"; tensor parallel over {cfg['ranks']} ranks (rank 0's times below, every "
                "rank's in the record)"
                if cfg.get("ranks", 1) > 1
                else ""
            ),
        ),
        "",
        f"medians over {cfg['rounds']} rounds (min–max):",
        "",
    ]
    has_ref = "mlx-lm" in medians
    head = "| model | prefill tok/s | decode tok/s |"
    head += " vs mlx-lm (rounds ≥) |" if has_ref else ""
    head += " weight+KV reads GB/s | of read floor | peak GiB, prefill / decode |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for v, m in medians.items():
        name = {
            "mlx-lm": "mlx-lm (its generate_step)",
            "mlx-lm-our-loop": "mlx-lm model, our loop",
        }.get(v, v)
        row = (
            f"| {name} | {m['prefill_tok_s']:.1f} ({m['prefill_tok_s_min']:.1f}–"
            f"{m['prefill_tok_s_max']:.1f}) | {m['decode_tok_s']:.2f} ({m['decode_tok_s_min']:.2f}–"
            f"{m['decode_tok_s_max']:.2f}) |"
        )
        if has_ref:
            row += f" {m['vs_mlx_lm']:.3f}x ({m['rounds_at_or_above_mlx_lm']}/{len(samples[v])}) |"
        frac = m["floor_fraction"]
        row += f" {_fmt(m['read_gbs'], '.2f')} | {_fmt(frac and 100 * frac, '.1f', '%')} |"
        row += f" {peak_gib(m, 'prefill')} / {peak_gib(m, 'decode')} |"
        lines.append(row)
    loads = [x for x in (res.get("load_average") or {}).values() if x is not None]
    cores = device.get("cpu_count") or os.cpu_count()
    if loads and max(loads) > cores:
        lines += [
            "",
            item(
                "busy",
                f"the machine's load average was {min(loads):.1f}–{max(loads):.1f} on {cores} "
                "cores while this ran: other work shared the CPU, so read the min–max before "
                "the medians",
            ),
        ]
    token_sets = {tuple(s["tokens"]) for rows in samples.values() for s in rows}
    lines += [
        "",
        "greedy tokens: "
        + (
            "identical in every model and round"
            if len(token_sets) == 1
            else f"{len(token_sets)} different sequences (bf16 rounding can flip a near-tie)"
        ),
    ]
    return "\n".join(lines)


NEXT_STEPS = """\
bigger runs  bench --input-len 1024 --output-len 33 --rounds 6   (a longer context: attention's
             share grows; several minutes on 2 CPU cores)
             bench --model qwen3-4b --quantize 4bit --input-len 32 --output-len 97   (a GPU's default)
             bench --weights DIR   (a local Qwen3 checkpoint); bench --help for the rest"""


def main(argv=None) -> None:
    args = parse_args(argv)
    if mx.distributed.init().rank() != 0:  # under mlx.launch: rank 0 reports for every rank
        run(args, Progress(stream=io.StringIO()))
        return
    print(
        "bench: Qwen3 decode, fused decode attention against the readable composition and "
        "mlx-lm, same weights\n",
        flush=True,
    )
    try:
        record = run(args, Progress())
    except (CheckpointError, FileNotFoundError) as e:
        sys.exit(f"bench: error: {e}")
    print(format_report(record))
    if not args.no_record:
        if args.output and not args.output.is_dir():
            path = write_record(record, args.output, force=args.overwrite)
        else:
            folder = args.output or find_results_dir()
            stem = record_name(args, record["config"]["weights_tag"])
            path = write_record(record, unique_path(folder, stem))
        print(f"\nrecord       {path}")
    print(NEXT_STEPS if args.device == "cpu" else "\nbench --help for the options")


if __name__ == "__main__":
    main()
