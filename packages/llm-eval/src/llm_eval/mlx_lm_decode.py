"""mlx-lm-decode: mlx-lm's own model and stream_generate, with and without
attn_kernels.mlx_lm.enable(), in ONE process on the same random weights.

bench's protocol (its timing, reads and medians): per model and workload one warm-up request each,
then one request per variant per round, the order rotated every round, every sample kept. The
model is mlx-lm's own class for the config (random weights in its shape, bf16 or mlx-lm's default
4-bit quantization, group 64) and the tokenizer a word-level one over the whole vocabulary with no
EOS, so nothing stops a request early. Kernel requests keep their attention call counts.

    mlx-lm-decode --model qwen3-4b --model llama-3-8b --quantize 4bit \\
        --workload 32+97 --workload 8192+65 --rounds 6

The variants: mlx-lm (no kernel) and mlx-lm+kernel: attn_kernels.mlx_lm.enable(), whose decode
steps of mlx-lm's llama (mistral), qwen2, qwen3, qwen3_moe, gemma3_text and phi3 attention run as
one attention_step each (q/k norm where the model has it, RoPE, cache write, attention; other
architectures: the attention call alone). --attention-only adds a third,
mlx-lm+kernel-attention-only: enable(fused_step=False), the attention call alone through the fused
op (what enable() did before the fused step became its default). --linear-routing ROUTING
(repeatable) adds mlx-lm+kernel+linear-ROUTING: enable(linear=ROUTING), the linear layers' routing
set apart from the backend's default (all: every call asks the guard, batches: only batched
steps' calls, off: MLX's matmuls), so that a routing's effect is timed in the same rotation as
the default's. --one-graph-a-step adds
mlx-lm+one-graph and mlx-lm+kernel+one-graph: the same two with MLX's CUDA graph limits on
mlx-lm's generation stream raised for the request (attn_kernels.graph_limits,
guard.BATCH_GRAPH_LIMITS: a decode step as one graph, as serving's batch_stream() runs) and
restored after; on a CPU, where MLX builds no graphs, they run as the plain two.

--draft-layers N decodes speculatively, as `mlx_lm.generate --draft-model` does: the draft is the
model's first N layers (the same weights; random weights make a draft of fewer layers disagree
with the model on nearly every token, and one of all its layers agree on every one), proposing
--num-draft-tokens tokens a step that the model verifies in one call of that many + 1 positions
(causal); the record counts the tokens the draft proposed.

--kv-bits BITS (with --kv-group-size, default 64) decodes every variant over mlx-lm's own
QuantizedKVCache from the first token (stream_generate's kv_bits, quantized_kv_start 0): mlx-lm's
quantized attention against enable()'s quantized kernels and step where the guard admits them.

--kernel-trace STEPS replaces the timing (a GPU with Nsight Compute): per model, workload and
variant a child process under ncu decodes one request and profiles STEPS decode steps from its
middle kernel by kernel (llm_eval.kernel_trace): each kernel's device time, their sum per step
beside the variant's median step timed in this process without ncu (a process under ncu decodes
~15-20x slower even outside the profiled range), and the kernels by name. ncu times kernels one
at a time: their sum leaves out the gaps between kernels and any overlap of two.

One record per model and workload, under benchmark_results/ (the nearest such folder upwards) or
--output DIR, named like bench's records.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import qwen3_model
from attn_kernels import _ext
from mlx.utils import tree_flatten

from llm_eval import bench, kernel_trace
from llm_eval.progress import Progress
from llm_eval.record import SCHEMA_VERSION, collect_metadata, positive_float, write_record

BASELINE, KERNEL, ATTENTION_ONLY = "mlx-lm", "mlx-lm+kernel", "mlx-lm+kernel-attention-only"
VARIANTS = [BASELINE, KERNEL]
ONE_GRAPH = "+one-graph"  # suffix: the variant with a decode step as one CUDA graph
LINEAR = "+linear-"  # KERNEL + LINEAR + routing: enable(linear=routing)
# mlx-lm config.json values of the published checkpoints (random weights here).
MODELS = {
    **{name: config.to_dict() for name, config in qwen3_model.CONFIGS.items()},
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
    # issue 40's shapes: head dims 64, 256 and 96 (no GQA)
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "gemma-3-4b": dict(
        model_type="gemma3_text",
        hidden_size=2560,
        num_hidden_layers=34,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        rms_norm_eps=1e-6,
        vocab_size=262208,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=dict(factor=8.0, rope_type="linear"),
        query_pre_attn_scalar=256,
        sliding_window=1024,
        sliding_window_pattern=6,
        max_position_embeddings=131072,
    ),
    "phi-3-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        num_hidden_layers=32,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        vocab_size=32064,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
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
    p.add_argument("--quantize", choices=["none", "4bit", "8bit"], default="4bit")
    p.add_argument(
        "--workload",
        type=workload,
        action="append",
        metavar="PROMPT+GENERATED",
        help="tokens, repeatable (default 32+97)",
    )
    p.add_argument("--rounds", type=int, default=6, metavar="N", help="timed requests per variant")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu" if bench.has_gpu() else "cpu")
    p.add_argument(
        "--bandwidth-gbs", type=positive_float, help="for the read floor (see bench --help)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weights and prompts")
    p.add_argument("--output", type=Path, metavar="DIR", help="folder for the records")
    p.add_argument("--no-record", action="store_true", help="print the tables only")
    p.add_argument(
        "--attention-only",
        action="store_true",
        help=f"a third variant, {ATTENTION_ONLY}: attn_kernels.mlx_lm.enable(fused_step=False) "
        f"(the attention call alone through the fused op; {KERNEL} also fuses norms, RoPE and "
        "the cache write of the architectures it knows into one attention_step)",
    )
    p.add_argument(
        "--linear-routing",
        choices=["all", "batches", "off"],
        action="append",
        help=f"another variant each, {KERNEL}{LINEAR}ROUTING: enable(linear=ROUTING) (repeatable; "
        "the default's routing is the backend's: all on the CPU, batches on CUDA)",
    )
    p.add_argument(
        "--one-graph-a-step",
        action="store_true",
        help=f"two more variants, {BASELINE}{ONE_GRAPH} and {KERNEL}{ONE_GRAPH}: MLX's CUDA graph "
        "limits on mlx-lm's generation stream raised so that a decode step is one graph",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        metavar="N",
        help="speculative decoding with the model's first N layers as the draft model",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        metavar="K",
        help="tokens the draft proposes a step (default 3; mlx_lm.generate's default is 2)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="every variant decodes over mlx-lm's QuantizedKVCache of these bits, from the first "
        "token (mlx_lm.generate's --kv-bits with --quantized-kv-start 0)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=[32, 64, 128],
        default=64,
        help="the quantized cache's group size (default 64, mlx-lm's; it must divide the head dim)",
    )
    p.add_argument(
        "--kernel-trace",
        type=int,
        metavar="STEPS",
        help="instead of timing requests: each variant's STEPS decode steps under Nsight Compute, "
        "kernel by kernel (see above; MLX's CUDA backend and ncu)",
    )
    p.add_argument("--ncu", metavar="PATH", help="ncu for --kernel-trace (default: on PATH or "
                   "under /opt/nvidia)")  # fmt: skip
    p.add_argument("--trace-child", nargs=2, metavar=("VARIANT", "FILE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [*VARIANTS, ATTENTION_ONLY] if args.attention_only else list(VARIANTS)
    args.variants += [KERNEL + LINEAR + r for r in dict.fromkeys(args.linear_routing or [])]
    if args.one_graph_a_step:
        args.variants += [v + ONE_GRAPH for v in VARIANTS]
    args.model = list(dict.fromkeys(args.model or ["qwen3-4b"]))
    args.workload = list(dict.fromkeys(args.workload or [(32, 97)]))
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.draft_layers is not None and args.draft_layers < 1:
        p.error("--draft-layers must be >= 1")
    for name in args.model:
        if (args.draft_layers or 0) > MODELS[name]["num_hidden_layers"]:
            p.error(f"--draft-layers {args.draft_layers}: {name} has "
                    f"{MODELS[name]['num_hidden_layers']} layers")  # fmt: skip
    if args.num_draft_tokens < 1:
        p.error("--num-draft-tokens must be >= 1")
    for name in args.model:
        head_dim = config_head_dim(MODELS[name])
        if args.kv_bits and head_dim % args.kv_group_size:
            p.error(f"--kv-group-size {args.kv_group_size} does not divide {name}'s head dim "
                    f"{head_dim} (mlx-lm's QuantizedKVCache needs it to)")  # fmt: skip
    if args.kernel_trace is not None:
        if args.kernel_trace < 1:
            p.error(f"--kernel-trace: must be >= 1 steps, got {args.kernel_trace}")
        if args.linear_routing:
            p.error("--kernel-trace: not with --linear-routing (it traces mlx-lm and enable())")
        if args.device != "gpu" or not mx.cuda.is_available():
            p.error("--kernel-trace: needs MLX's CUDA backend (Nsight Compute times its kernels)")
        if any(generated < 2 * args.kernel_trace + 2 for _, generated in args.workload):
            p.error(f"--kernel-trace {args.kernel_trace}: each workload needs at least "
                    f"{2 * args.kernel_trace + 2} generated tokens (the steps from its middle)")  # fmt: skip
        if args.draft_layers is not None:
            p.error("--kernel-trace: not with --draft-layers")
        if args.kv_bits is not None:
            p.error("--kernel-trace: not with --kv-bits")
        args.ncu = args.ncu or kernel_trace.ncu_path()
        if not args.trace_child and not args.ncu:
            p.error("--kernel-trace: no ncu on PATH or under /opt/nvidia; pass --ncu PATH")
    if args.output and args.output.exists() and not args.output.is_dir():
        p.error(f"--output {args.output}: not a folder")
    return args


def build(name: str, quantize: str, seed: int):
    """mlx-lm's own model class for the config, seeded random weights in bf16 (4- or 8-bit:
    mlx-lm's default quantization, groups of 64)."""
    config = MODELS[name]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if quantize != "none":
        nn.quantize(model, group_size=64, bits=int(quantize.removesuffix("bit")))
    mx.eval(model.parameters())
    return model


def draft_of(model, layers: int):
    """The model's first `layers` layers as a model of its own, sharing the weights."""
    draft = copy.copy(model)
    draft.model = copy.copy(model.model)
    draft.model.layers = model.model.layers[:layers]
    return draft


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over the whole vocabulary ("w0", "w1", ...) and no EOS."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=words))


def config_head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def kv_bytes_per_position(config: dict, kv_bits: int | None = None, group_size: int = 64) -> int:
    """Keys and values of one position, all layers, in bf16 (the activations' dtype), or
    quantized (bench.kv_bytes)."""
    head = bench.kv_bytes(config_head_dim(config), 2, kv_bits, group_size)
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head


def noting_drafts(responses, proposed: list):
    """(token, None) of each response, as bench.timed takes them; whether the draft proposed it
    appended to `proposed`."""
    for r in responses:
        proposed.append(r.from_draft)
        yield r.token, None


def request(
    model,
    tokenizer,
    prompt: mx.array,
    generated: int,
    variant: str,
    draft=None,
    drafts: int = 3,
    kv: dict | None = None,
) -> dict:
    """One stream_generate request (speculative with a `draft` model; `kv`: generate_step's
    kv_bits, kv_group_size and quantized_kv_start), timed as bench times its loops."""
    import attn_kernels.mlx_lm as attention
    from mlx_lm.generate import generation_stream, stream_generate

    kernel = variant.startswith(KERNEL)
    routing = variant.split(LINEAR)[1] if LINEAR in variant else None
    mx.reset_peak_memory()
    context = (
        attention.enabled(fused_step=variant != ATTENTION_ONLY, linear=routing)
        if kernel
        else contextlib.nullcontext()
    )
    graphs = one_graph_a_step(generation_stream) if variant.endswith(ONE_GRAPH) else None
    speculative = {"draft_model": draft, "num_draft_tokens": drafts} if draft is not None else {}
    proposed = []
    with context, graphs or contextlib.nullcontext():
        responses = stream_generate(
            model, tokenizer, prompt, max_tokens=generated, **speculative, **(kv or {})
        )
        sample = bench.timed(noting_drafts(responses, proposed), prompt.size, generated,
                             (generation_stream,))  # fmt: skip
        if draft is not None:
            sample["tokens_from_draft"] = sum(proposed)
        if kernel:
            sample["attention_calls"] = attention.calls()
    return sample


@contextlib.contextmanager
def one_graph_a_step(stream):
    """MLX's CUDA graph limits on `stream` (an mx.Stream or mlx-lm's mx.ThreadLocalStream: this
    thread's) raised to guard.BATCH_GRAPH_LIMITS, then restored."""
    from attn_kernels import graph_limits, guard

    with mx.stream(stream):  # the mx.Stream it stands for in this thread
        stream = mx.default_stream(mx.default_device())
    before = graph_limits(stream, *guard.BATCH_GRAPH_LIMITS)
    try:
        yield
    finally:
        if before is not None:
            graph_limits(stream, *before)


def run_workload(args, name, model, tokenizer, w, progress: Progress, draft=None) -> dict:
    prompt_len, generated = w
    kv = (
        {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": 0}
        if args.kv_bits
        else None
    )
    options = {"draft": draft, "drafts": args.num_draft_tokens, "kv": kv}
    prompt = bench.prompt_ids(model.args.vocab_size, prompt_len, mx.random.key(args.seed))
    config = MODELS[name]
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    kv_per_position = kv_bytes_per_position(config, args.kv_bits, args.kv_group_size)
    variants = args.variants
    progress.restart(len(variants))
    for v in variants:  # compilation, allocator: the prompt and one decode step
        request(model, tokenizer, prompt, 2, v, **options)
        progress.step(f"{name} {prompt_len}+{generated} warm-up {v}")
    samples = {v: [] for v in variants}
    order_log = []
    progress.restart(args.rounds * len(variants))
    for r in range(args.rounds):
        order = bench.variant_order(variants, r)
        order_log.append({"round": r, "order": order})
        for v in order:
            sample = {"round": r, **request(model, tokenizer, prompt, generated, v, **options)}
            bench.add_reads(sample, weight_bytes, kv_per_position, args.bandwidth_gbs)
            samples[v].append(sample)
            progress.step(
                f"{name} {prompt_len}+{generated} round {r + 1}/{args.rounds} {v}: "
                f"{sample['decode_tok_s']:.2f} tok/s"
            )
    divergence = {v: first_divergence(samples[BASELINE][0], samples[v][0]) for v in variants[1:]}
    results = {}
    if ATTENTION_ONLY in divergence:
        results["first_divergence_attention_only"] = divergence[ATTENTION_ONLY]
    linear = {v.split(LINEAR)[1]: d for v, d in divergence.items() if LINEAR in v}
    if linear:  # --linear-routing's variants, by routing
        results["first_divergence_linear"] = linear
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "mlx-lm-decode",
        "metadata": collect_metadata(args.device),
        "model_config": config,
        "config": {
            "model": name,
            "quantize": args.quantize,
            "weights_origin": f"random (seed {args.seed}) in the shape of the published {name} "
            "config, mlx-lm's own model class",
            "input_len": prompt_len,
            "output_len": generated,
            "rounds": args.rounds,
            "warmup": 1,
            "device": args.device,
            "bandwidth_gbs": args.bandwidth_gbs,
            "variants": variants,
            "loop": "mlx_lm.stream_generate (greedy; tokenizer: word-level, no EOS)",
            "draft_layers": args.draft_layers,
            "num_draft_tokens": args.num_draft_tokens if draft is not None else None,
            "kv_bits": args.kv_bits,
            "kv_group_size": args.kv_group_size if args.kv_bits else None,
        },
        "execution_order": order_log,
        "results": {
            "weight_bytes": weight_bytes,
            "kv_bytes_per_position": kv_per_position,
            "samples": samples,
            "medians": bench.summarise(samples),
            # Greedy tokens of the first round, mlx-lm against mlx-lm+kernel (and against
            # --attention-only's and --linear-routing's variants): the attention paths round
            # differently in bf16, so a near-tie can flip on random weights.
            "first_divergence": divergence[KERNEL],
            **results,
        },
    }


def trace_child(args) -> None:
    """Under ncu (--trace-child VARIANT FILE): a warm-up request, then one with --kernel-trace
    steps from its middle in ncu's range; FILE says how many tokens it decoded."""
    import attn_kernels.mlx_lm as attention
    from mlx_lm.generate import stream_generate

    variant, out = args.trace_child
    (name,), ((prompt_len, generated),) = args.model, args.workload
    model = build(name, args.quantize, args.seed)
    tokenizer = word_tokenizer(model.args.vocab_size)
    prompt = bench.prompt_ids(model.args.vocab_size, prompt_len, mx.random.key(args.seed))
    request(model, tokenizer, prompt, 2, variant)
    context = attention.enabled() if variant == KERNEL else contextlib.nullcontext()
    # ncu's range from the middle token for --kernel-trace tokens: the decode steps launched
    # meanwhile (generate_step launches a step before it yields the previous one's token).
    first = (generated - args.kernel_trace) // 2
    with context, contextlib.ExitStack() as window:
        responses = stream_generate(model, tokenizer, prompt, max_tokens=generated)
        tokens = 0
        for tokens, _ in enumerate(responses, 1):
            if tokens - 1 == first:
                window.enter_context(kernel_trace.profiled())
            elif tokens - 1 == first + args.kernel_trace:
                window.close()
    Path(out).write_text(json.dumps({"tokens": tokens}))


def wall_step_ms(args, name, w) -> dict:
    """Each variant's median decode step in this process, outside ncu (a process under ncu runs
    its steps ~15-20x slower even outside the profiled range): one warm-up and one request."""
    prompt_len, generated = w
    model = build(name, args.quantize, args.seed)
    tokenizer = word_tokenizer(model.args.vocab_size)
    prompt = bench.prompt_ids(model.args.vocab_size, prompt_len, mx.random.key(args.seed))
    wall = {}
    for variant in VARIANTS:
        request(model, tokenizer, prompt, 2, variant)
        step_s = request(model, tokenizer, prompt, generated, variant)["step_s"]
        wall[variant] = statistics.median(step_s) * 1e3  # as bench.summarise's median_step_ms
    del model
    mx.clear_cache()
    return wall


def trace_workload(args, name, w, progress: Progress) -> dict:
    """One ncu child per variant (module doc); the record of their kernels."""
    prompt_len, generated = w
    wall = wall_step_ms(args, name, w)
    results = {}
    progress.restart(len(VARIANTS))
    for variant in VARIANTS:

        def program(result, variant=variant):
            return [
                sys.executable, "-m", "llm_eval.mlx_lm_decode", "--model", name,
                "--quantize", args.quantize, "--workload", f"{prompt_len}+{generated}",
                "--seed", str(args.seed), "--kernel-trace", str(args.kernel_trace),
                "--trace-child", variant, str(result),
            ]  # fmt: skip

        kernels, child = kernel_trace.run_traced(args.ncu, program, f"{variant} process")
        if child["tokens"] != generated:
            raise RuntimeError(f"the traced {variant} request stopped early")
        results[variant] = {
            "wall_ms_per_step": wall[variant],
            **kernel_trace.summarise(kernels, args.kernel_trace),
        }
        progress.step(f"{name} {prompt_len}+{generated} {variant} traced")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "mlx-lm-decode-kernel-trace",
        "metadata": collect_metadata(args.device),
        "model_config": MODELS[name],
        "config": {
            "model": name,
            "quantize": args.quantize,
            "input_len": prompt_len,
            "output_len": generated,
            "traced_steps": args.kernel_trace,
            "seed": args.seed,
            "variants": VARIANTS,
            "ncu": args.ncu,
        },
        "execution_order": [{"variant": v} for v in VARIANTS],
        "results": results,
    }


def format_trace(record: dict) -> str:
    c = record["config"]
    lines = [
        f"{c['model']} {c['quantize']} {c['input_len']}+{c['output_len']}: "
        f"{c['traced_steps']} decode steps under ncu",
        "| variant | wall ms/step (no ncu) | kernel ms/step | kernels/step | largest kernels "
        "(ms/step) |",
        "|---|---|---|---|---|",
    ]
    for v, r in record["results"].items():
        top = ", ".join(f"{k['name'][:40]} {k['ms_per_step']:.3f}" for k in r["by_name"][:4])
        lines.append(
            f"| {v} | {r['wall_ms_per_step']:.3f} | {r['kernel_ms_per_step']:.3f} | "
            f"{r['kernels_per_step']:.1f} | {top} |"
        )
    return "\n".join(lines)


def first_divergence(theirs: dict, ours: dict) -> int | None:
    """The first position where two requests' greedy tokens differ (None: identical)."""
    pairs = enumerate(zip(theirs["tokens"], ours["tokens"], strict=True))
    return next((i for i, (a, b) in pairs if a != b), None)


def format_table(record: dict) -> str:
    c, res = record["config"], record["results"]
    lines = [
        f"{c['model']} {c['quantize']} {c['input_len']}+{c['output_len']}"
        + (
            f", speculative ({c['draft_layers']}-layer draft, "
            f"{c['num_draft_tokens']} tokens a step)"
            if c.get("draft_layers")
            else ""
        )
        + (f", a {c['kv_bits']}-bit cache (group {c['kv_group_size']})" if c.get("kv_bits") else "")
        + f": medians of {c['rounds']} rounds (min–max)",
        "| variant | decode tok/s | vs mlx-lm (rounds ≥) | median step ms | weight+KV GB/s |",
        "|---|---|---|---|---|",
    ]
    for v, m in res["medians"].items():
        gbs = "—" if m["read_gbs"] is None else f"{m['read_gbs']:.1f}"
        if m["floor_fraction"] is not None:
            gbs += f" ({100 * m['floor_fraction']:.1f}% of floor)"
        lines.append(
            f"| {v} | {m['decode_tok_s']:.2f} ({m['decode_tok_s_min']:.2f}–"
            f"{m['decode_tok_s_max']:.2f}) | {m['vs_mlx_lm']:.3f}x "
            f"({m['rounds_at_or_above_mlx_lm']}/{c['rounds']}) | {m['median_step_ms']:.2f} | "
            f"{gbs} |"
        )
    divergences = {KERNEL: res["first_divergence"]}
    if "first_divergence_attention_only" in res:
        divergences[ATTENTION_ONLY] = res["first_divergence_attention_only"]
    for routing, divergence in res.get("first_divergence_linear", {}).items():
        divergences[KERNEL + LINEAR + routing] = divergence
    for v, divergence in divergences.items():
        calls = {tuple(s["attention_calls"].items()) for s in res["samples"][v]}
        lines.append(
            f"{v}: calls per request (attention, linear layers): "
            + "; ".join(", ".join(f"{k} {n}" for k, n in c) for c in sorted(calls))
            + "; greedy tokens "
            + (
                "identical to mlx-lm's"
                if divergence is None
                else f"differ from mlx-lm's at token {divergence}"
            )
        )
    return "\n".join(lines)


def kv_tag(config: dict) -> str:
    """-kv4 / -kv8 (and the group where it is not 64) in a quantized cache's record name."""
    bits, group = config.get("kv_bits"), config.get("kv_group_size")
    return f"-kv{bits}{'' if group == 64 else f'-group-{group}'}" if bits else ""


def record_path(args, record: dict) -> Path:
    c = record["config"]
    kind = "-kernel-trace" if record["kind"].endswith("kernel-trace") else ""
    stem = (
        f"{bench.machine_tag(args.device)}-{c['model']}-{c['quantize'].replace('none', 'bf16')}"
        f"{kv_tag(c)}-mlx-lm-decode{'-speculative' if c.get('draft_layers') else ''}{kind}-"
        f"{c['input_len']}+{c['output_len']}-mlx-{mx.__version__}"
    )
    return bench.unique_path(args.output or bench.find_results_dir(), stem)


def main(argv=None) -> None:
    args = parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    if args.trace_child:
        trace_child(args)
        return
    progress = Progress()
    if args.kernel_trace:
        for name in args.model:
            for w in args.workload:
                record = trace_workload(args, name, w, progress)
                progress.close()
                print(format_trace(record), flush=True)
                if not args.no_record:
                    print(f"record {write_record(record, record_path(args, record))}", flush=True)
        return
    if args.bandwidth_gbs is None:
        if args.device == "cpu":
            progress.say("measuring the memory read bandwidth ...")
            args.bandwidth_gbs = _ext.measure_read_bandwidth(1 << 30, 3) / 1e9
        elif mx.cuda.is_available() and "H200" in bench.gpu_name():
            args.bandwidth_gbs = bench.H200_BANDWIDTH_GBS
    for name in args.model:
        started = time.perf_counter()
        model = build(name, args.quantize, args.seed)
        tokenizer = word_tokenizer(model.args.vocab_size)
        draft = draft_of(model, args.draft_layers) if args.draft_layers else None
        progress.say(f"{name} ({args.quantize}) built in {time.perf_counter() - started:.1f} s")
        for w in args.workload:
            record = run_workload(args, name, model, tokenizer, w, progress, draft)
            progress.close()
            print(format_table(record), flush=True)
            if not args.no_record:
                print(f"record {write_record(record, record_path(args, record))}", flush=True)
        del model, tokenizer
        mx.clear_cache()


if __name__ == "__main__":
    main()
