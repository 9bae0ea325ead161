"""Host time to build one call of mlx-lm's Qwen3 attention module (its projections, the attention
and o_proj; nothing evaluated): mlx-lm as it is, with attn_kernels.mlx_lm.enable(fused_step=False)
(the attention call alone) and with enable() (the fused step) (docs/mlx-lm.md). A decode step of mlx-lm is bound by the host on the
H200, so this is the part the fused step is meant to shorten.

One Qwen3-4B-shaped attention layer (hidden 2560, 32 query heads, 8 KV heads, D=128, bf16), one
token at offset --context in a KVCache whose buffers are evaluated. Each sample is the mean over
--calls calls (the cache's buffers and offset reset before each call, outside the timing).
Rounds rotate the variants' order; every sample is kept, medians and p10/p90 printed.

    python3 tools/mlx_lm_step_host_cost.py [--context 1000] [--rounds 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import attn_kernels.mlx_lm as kernel
import mlx.core as mx
import qwen3_model
from llm_eval.operators import implementation_orders
from llm_eval.record import SCHEMA_VERSION, collect_metadata, write_record
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

VARIANTS = {
    "mlx-lm": contextlib.nullcontext,
    "mlx-lm+kernel-attention-only": lambda: kernel.enabled(fused_step=False),
    "mlx-lm+kernel": kernel.enabled,
}
# One Qwen3-4B layer (the built-in config; the vocabulary does not matter here).
QWEN3_4B_LAYER = {**qwen3_model.CONFIGS["qwen3-4b"].to_dict(), "num_hidden_layers": 1}


def build_sample(attn, x, cache, buffers, context: int, calls: int) -> float:
    """Mean seconds to build one attention call (the cache reset outside the timing)."""
    total = 0.0
    for _ in range(calls):
        cache.keys, cache.values = buffers
        cache.offset = context
        start = time.perf_counter()
        out = attn(x, mask=None, cache=cache)
        total += time.perf_counter() - start
        del out
    return total / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=1000, help="the cache's offset (default 1000)")
    p.add_argument("--rounds", type=int, default=20, help="rotated rounds (default 20)")
    p.add_argument("--calls", type=int, default=100, help="calls per sample (default 100)")
    p.add_argument("--json", help="write the record (every sample) here")
    args = p.parse_args()
    if args.context < 1 or args.rounds < 1 or args.calls < 1:
        p.error("--context, --rounds and --calls must be >= 1")
    attn = qwen3.Attention(qwen3.ModelArgs.from_dict(QWEN3_4B_LAYER))
    attn.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 1, QWEN3_4B_LAYER["hidden_size"])).astype(mx.bfloat16)
    cache = KVCache()
    zeros = mx.zeros((1, QWEN3_4B_LAYER["num_key_value_heads"], args.context, 128), mx.bfloat16)
    cache.update_and_fetch(zeros, zeros)
    buffers = (cache.keys, cache.values)
    mx.eval(attn.parameters(), x, *buffers)
    samples = {v: [] for v in VARIANTS}
    orders = implementation_orders(list(VARIANTS))
    execution = []
    warmup_calls = {}
    for name, context in VARIANTS.items():  # warm-up, and the proof each variant ran its path
        with context():
            build_sample(attn, x, cache, buffers, args.context, args.calls)
            calls = kernel.calls() if name != "mlx-lm" else None
        print(f"{name}: attention calls in the warm-up {calls}")
        path = {"mlx-lm+kernel-attention-only": "fused", "mlx-lm+kernel": "fused_step"}.get(name)
        if path and not calls[path]:
            raise SystemExit(f"{name} did not take its path (calls {calls}): outside the guard?")
        warmup_calls[name] = calls
    for r in range(args.rounds):
        order = list(orders[r % len(orders)])
        execution.append({"round": r, "order": order})
        for name in order:
            with VARIANTS[name]():
                samples[name].append(
                    build_sample(attn, x, cache, buffers, args.context, args.calls) * 1e6
                )
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    results = {}
    for name, s in samples.items():
        deciles = statistics.quantiles(s, n=10) if len(s) > 1 else [s[0]] * 9
        results[name] = {
            "median_us": statistics.median(s),
            "p10_us": deciles[0],
            "p90_us": deciles[-1],
            "n": len(s),
            "samples_us": s,
        }
        t = results[name]
        print(
            f"{name:20} build median {t['median_us']:7.2f} us per attention call "
            f"(p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f}, n {t['n']})"
        )
    if args.json:
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "mlx-lm-step-host-cost",
            "metadata": collect_metadata(device),
            "config": {
                **vars(args),
                "layer": QWEN3_4B_LAYER,
                "dtype": "bfloat16",
                "L": 1,
                "warmup_calls": warmup_calls,
            },
            "execution_order": execution,
            "results": results,
        }
        print(f"wrote {write_record(record, args.json, force=True)}")


if __name__ == "__main__":
    main()
