"""bench-step: whole-model decode of decode-attention (fused step), mlx-lm and composition in ONE
process on the same weights, every model driven by mlx-lm's own `generate_step` (pipelined with
mx.async_eval), rounds rotated; plus what a step is made of and, with --count-kernels, the
kernels each variant launches per decode step (counted in the CUDA graphs MLX writes with
MLX_SAVE_CUDA_GRAPHS_DOT_FILE).

    bench-step --quantize none 4bit --workloads 32+97 1024+65 8192+65 --rounds 3 \\
        --json-output benchmark_results/h200-qwen3-4b-step-bench-mlx-0.32.4.json
    bench-step --count-kernels DIR --quantize none --workloads 1024+9

Per request: prefill time (prompt through generate_step to its first token) and decode tok/s
(tokens after the first over the time between the first and the last). Per workload and
variant, the step anatomy (after one request's prefill, 16 steps): host time to build one
step's lazy graph (the model call and the argmax, no eval), the time of mx.eval of that graph
when nothing else is queued (host encoding plus GPU plus the wait), and the pipelined step
time (1 / decode tok/s), and the slowest pipelined step. attention_step_cache_copies() counts
caches the fused op had to copy (per request; 0 in a decode loop, docs/fused-step.md),
attention_step_folds() the steps it ran as one kernel (CUDA's fold: every layer's decode
steps under decode-attention-fold).

    bench-step --model qwen3-tiny --device cpu --workloads 20+6   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

if "--count-kernels" in sys.argv:  # read once by MLX at its first graph: before importing it
    folder = sys.argv[sys.argv.index("--count-kernels") + 1]
    os.makedirs(folder, exist_ok=True)
    os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = os.path.join(folder, "graph")

import glob
import itertools
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx
import qwen3_model
import qwen3_model.model as model_module
from attn_kernels import attention_step_cache_copies, attention_step_folds
from mlx_lm.generate import generate_step, generation_stream

from llm_eval import bench
from llm_eval.progress import Progress
from llm_eval.record import (
    SCHEMA_VERSION,
    add_record_args,
    collect_metadata,
    refuse_overwrite,
    write_record,
)

# decode-attention-unfused: the decode-attention checkpoint before the fused step (separate
# projections, norm/RoPE/slice-update ops, DecodeAttention): Model.set_fused_step(False).
# decode-attention-mlx-rule: the fused step with MLX's donation rule alone (owned_caches=False,
# the model before that argument): it copies a cache whose previous step is still running.
# decode-attention-addmm: the fused step with the residual adds inside o_proj's and down_proj's
# matmuls (Model.set_residual_in_matmul, an experiment on the kernel count).
# decode-attention-add-norm: the fused step with the residual add after attention and the
# post-attention norm in one kernel on CUDA (Model.set_add_norm, the same experiment).
# decode-attention-fold: the fused step as one kernel on CUDA (Model.set_fold_step(True):
# attention_step's fold, the preprocessing inside the attention's blocks); decode-attention
# leaves the fold to the process default (on unless ATTN_STEP_FOLD=0).
VARIANTS = [
    "decode-attention",
    "mlx-lm",
    "composition",
    "decode-attention-unfused",
    "decode-attention-mlx-rule",
    "decode-attention-addmm",
    "decode-attention-add-norm",
    "decode-attention-fold",
]
FUSED_STEP = model_module.attention_step


def step_under_mlx_rule(*args, **kwargs):
    return FUSED_STEP(*args, **{**kwargs, "owned_caches": False})


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench-step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="qwen3-4b",
        choices=list(qwen3_model.CONFIGS),
        help="built-in config, random weights (qwen3-tiny: a CPU smoke run; its head dim is "
        "outside the guard, so its decode-attention runs mx.fast)",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: the GPU where MLX has one")
    p.add_argument("--quantize", nargs="+", choices=["none", "4bit"], default=["none"])
    p.add_argument("--workloads", nargs="+", default=["32+97"], help="INPUT+OUTPUT tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS[:3])
    p.add_argument("--anatomy-steps", type=int, default=16)
    p.add_argument("--count-kernels", metavar="DIR", help="count kernels per step (graphs to DIR)")
    p.add_argument("--count-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    add_record_args(p)
    args = p.parse_args(argv)
    refuse_overwrite(p, args.json_output, args.force)
    try:
        args.workloads = [tuple(int(n) for n in w.split("+")) for w in args.workloads]
    except ValueError:
        p.error(f"--workloads: INPUT+OUTPUT token counts, e.g. 1024+65, got {args.workloads}")
    if any(len(w) != 2 or w[0] < 1 or w[1] < 2 for w in args.workloads):
        p.error(f"--workloads: INPUT >= 1 and OUTPUT >= 2 tokens, got {args.workloads}")
    if args.rounds < 1 or args.anatomy_steps < 1 or args.count_steps < 1:
        p.error("--rounds, --anatomy-steps and --count-steps must be >= 1")
    args.device = args.device or ("gpu" if bench.has_gpu() else "cpu")
    if args.device == "gpu" and not bench.has_gpu():
        p.error("--device gpu: this MLX has no GPU backend")
    return args


def build(args, quantize):
    """Our model (decode-attention by default; pick() switches it per variant) and mlx-lm's Qwen3
    holding the same weight arrays, each with its cache factory."""
    from mlx_lm.models.cache import make_prompt_cache

    model = qwen3_model.load(
        args.model, quantize=None if quantize == "none" else quantize, seed=args.seed
    )
    return model, qwen3_model.make_cache, bench.mlx_lm_twin(model), make_prompt_cache


def pick(variant, ours, make_ours, twin, make_twin):
    rule = variant == "decode-attention-mlx-rule"
    model_module.attention_step = step_under_mlx_rule if rule else FUSED_STEP
    if variant == "mlx-lm":
        return twin, make_twin
    ours.set_checkpoint("composition" if variant == "composition" else "decode-attention")
    ours.set_fused_step(variant != "decode-attention-unfused")
    ours.set_residual_in_matmul(variant == "decode-attention-addmm")
    ours.set_add_norm(variant == "decode-attention-add-norm")
    ours.set_fold_step(True if variant == "decode-attention-fold" else None)
    return ours, make_ours


def stream_for(device):
    """mlx-lm's generation stream (made on the default device when mlx-lm was imported), or a new
    one on `device` where that differs (--device cpu on a machine with a GPU)."""
    if generation_stream.device == device:
        return generation_stream
    return mx.new_stream(device)


def request(model, make_cache, prompt, output_len, stream) -> dict:
    cache = make_cache(model)
    copies, folds = attention_step_cache_copies(), attention_step_folds()
    start = time.perf_counter()
    times, token_ids = [], []
    steps = generate_step(prompt, model, max_tokens=output_len, prompt_cache=cache, stream=stream)
    for token, _ in steps:
        times.append(time.perf_counter())
        token_ids.append(int(token))
    decode_s = times[-1] - times[0]
    return {
        "prefill_s": times[0] - start,
        "decode_s": decode_s,
        "decode_tok_s": (len(times) - 1) / decode_s,
        "tokens": len(times),
        "step_ms": [(b - a) * 1e3 for a, b in itertools.pairwise(times)],
        "token_ids": token_ids,
        "cache_copies": attention_step_cache_copies() - copies,
        "folded_steps": attention_step_folds() - folds,
    }


def prefilled(model, make_cache, prompt, stream):
    """A cache holding the prompt and the next token, through generate_step's own prefill."""
    cache = make_cache(model)
    steps = generate_step(prompt, model, max_tokens=1, prompt_cache=cache, stream=stream)
    token, _ = next(steps)
    steps.close()
    return cache, mx.array([token])


def step_graph(model, cache, token, stream):
    with mx.stream(stream):
        logits = model(token[None], cache=cache)[:, -1, :]
        return mx.argmax(logits, axis=-1)


def anatomy(model, make_cache, prompt, steps, stream) -> dict:
    cache, token = prefilled(model, make_cache, prompt, stream)
    build_s, eval_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = step_graph(model, cache, token, stream)
        t1 = time.perf_counter()
        mx.eval(token)
        t2 = time.perf_counter()
        build_s.append(t1 - t0)
        eval_s.append(t2 - t1)
    return {
        "build_ms": [t * 1e3 for t in build_s],
        "eval_ms": [t * 1e3 for t in eval_s],
        "median_build_ms": statistics.median(build_s) * 1e3,
        "median_eval_ms": statistics.median(eval_s) * 1e3,
    }


NODE = re.compile(r'^"?(\w+_node_\d+)"?\s*\[(.*?)\];?\s*$', re.S | re.M)


def count_nodes(files) -> dict:
    """Nodes of the DOT files by kind: kernel, memcpy, memset, empty, other (CUDA's labels)."""
    counts: dict[str, int] = {}
    for f in files:
        text = Path(f).read_text()
        for match in re.finditer(r'"?\w+_node_\d+"?\s*\[([^\]]*)\]', text):
            attrs = match.group(1)
            label = re.search(r'label="([^"]*)"', attrs)
            text_label = (label.group(1) if label else attrs).upper()
            if "MEMCPY" in text_label:
                kind = "memcpy"
            elif "MEMSET" in text_label:
                kind = "memset"
            elif "EMPTY" in text_label:
                kind = "empty"
            elif "CHILD" in text_label or ("GRAPH" in text_label and "KERNEL" not in text_label):
                kind = "child_graph"
            elif "EVENT" in text_label or "HOST" in text_label:
                kind = "other"
            else:
                kind = "kernel"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def count_kernels(model, make_cache, prompt, steps, folder, label, stream) -> dict:
    cache, token = prefilled(model, make_cache, prompt, stream)
    token = step_graph(model, cache, token, stream)  # one step outside the count
    mx.eval(token)
    before = set(glob.glob(os.path.join(folder, "graph_*.dot")))
    for _ in range(steps):
        token = step_graph(model, cache, token, stream)
        mx.eval(token)
    files = sorted(set(glob.glob(os.path.join(folder, "graph_*.dot"))) - before)
    counts = count_nodes(files)
    kept = os.path.join(folder, "steps", label)  # the counted graphs, apart from the rest
    os.makedirs(kept, exist_ok=True)
    for f in files:
        os.replace(f, os.path.join(kept, os.path.basename(f)))
    return {
        "graphs_per_step": len(files) / steps,
        "nodes_per_step": {k: v / steps for k, v in counts.items()},
        "files": [os.path.basename(f) for f in files],
    }


def rotated(variants, r):
    k = r % len(variants)
    return variants[k:] + variants[:k]


def main(argv=None):
    try:
        run(parse_args(argv))
    finally:  # pick() swaps the model module's step op: leave the library's in place
        model_module.attention_step = FUSED_STEP


def run(args):
    device = args.device
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    stream = stream_for(mx.default_device())
    results = []
    order_log = []
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": "step-bench",
        "metadata": collect_metadata(device),
        "model_config": qwen3_model.CONFIGS[args.model].to_dict(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "attn_step_fold_default": os.environ.get("ATTN_STEP_FOLD") != "0",
        "execution_order": order_log,
        "results": results,
    }

    written = []  # after the first write, later ones replace this run's own record

    def save():  # after every workload: a run cut short keeps what it finished
        if args.json_output:
            written.append(write_record(record, args.json_output, args.force or bool(written)))
            return written[-1]

    per_workload = 1 if args.count_kernels else args.rounds * len(args.variants)
    progress = Progress(len(args.quantize) * len(args.workloads) * per_workload)
    for quantize in args.quantize:
        ours, make_ours, twin, make_twin = build(args, quantize)
        for input_len, output_len in args.workloads:
            prompt = bench.prompt_ids(ours.args.vocab_size, input_len, mx.random.key(args.seed))
            entry = {"quantize": quantize, "input_len": input_len, "output_len": output_len}
            if args.count_kernels:
                entry["kernels"] = {}
                for v in args.variants:
                    model, make = pick(v, ours, make_ours, twin, make_twin)
                    entry["kernels"][v] = count_kernels(
                        model,
                        make,
                        prompt,
                        args.count_steps,
                        args.count_kernels,
                        f"{quantize}-{input_len}-{v}",
                        stream,
                    )
                    print(quantize, input_len, v, entry["kernels"][v]["nodes_per_step"], flush=True)
                progress.step(f"{quantize} {input_len}+{output_len} kernels counted")
                results.append(entry)
                save()
                continue
            for v in args.variants:  # warm-up
                model, make = pick(v, ours, make_ours, twin, make_twin)
                request(model, make, prompt, 8, stream)
            samples = {v: [] for v in args.variants}
            for r in range(args.rounds):
                order = rotated(args.variants, r)
                order_log.append({"quantize": quantize, "input_len": input_len, "order": order})
                for v in order:
                    model, make = pick(v, ours, make_ours, twin, make_twin)
                    sample = request(model, make, prompt, output_len, stream)
                    samples[v].append({"round": r, **sample})
                    progress.step(f"{quantize} {input_len}+{output_len} round {r + 1} {v}")
            entry["samples"] = samples
            entry["medians"] = {
                v: {
                    "decode_tok_s": statistics.median(s["decode_tok_s"] for s in samples[v]),
                    "prefill_s": statistics.median(s["prefill_s"] for s in samples[v]),
                }
                for v in args.variants
            }
            entry["anatomy"] = {}
            for v in args.variants:
                model, make = pick(v, ours, make_ours, twin, make_twin)
                entry["anatomy"][v] = anatomy(model, make, prompt, args.anatomy_steps, stream)
            results.append(entry)
            progress.close()
            print(f"{quantize} {input_len}+{output_len}:", flush=True)
            reference = entry["medians"].get("mlx-lm", {}).get("decode_tok_s")
            theirs = [s["token_ids"] for s in samples.get("mlx-lm", [])]
            for v in args.variants:
                rounds = ", ".join(f"{s['decode_tok_s']:.1f}" for s in samples[v])
                rate = entry["medians"][v]["decode_tok_s"]
                ratio = f", {rate / reference:.2f}x mlx-lm" if reference else ""
                print(
                    f"  {v}: {rate:.1f} tok/s ({rounds}{ratio}); step"
                    f" build {entry['anatomy'][v]['median_build_ms']:.2f} ms, eval"
                    f" {entry['anatomy'][v]['median_eval_ms']:.2f} ms; slowest pipelined step"
                    f" {max(t for s in samples[v] for t in s['step_ms']):.1f} ms;"
                    f" cache copies {sum(s['cache_copies'] for s in samples[v])};"
                    f" folded steps {sum(s['folded_steps'] for s in samples[v])}"
                    f"; greedy tokens as mlx-lm's in"
                    f" {sum(s['token_ids'] in theirs for s in samples[v])}/{len(samples[v])}",
                    flush=True,
                )
            save()
        del ours, twin
        mx.clear_cache()
    if args.json_output:
        print(f"wrote {save()}")


if __name__ == "__main__":
    main()
