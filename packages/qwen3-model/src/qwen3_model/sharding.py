"""Tensor parallelism over mx.distributed, in mlx-lm's layout (its Qwen3 `Model.shard`).

Each rank keeps 1/N of the attention heads and of the MLP's hidden units: q/k/v and gate/up are
all-to-sharded (each rank computes its slice of the outputs), o_proj and down_proj are
sharded-to-all (each rank multiplies its slice and an all_sum joins them). Two all_sums per layer,
nothing else crosses ranks: attention, the KV cache and the fused decode kernel see only the
rank's own heads and run unchanged. bf16 and quantized layers alike (mlx.nn's shard_linear picks
the quantized forms).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import shard_linear


def _check_divisible(args, group_size: int) -> None:
    sizes = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "intermediate_size": args.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % group_size]
    if bad:
        raise ValueError(
            f"cannot shard over {group_size} ranks: {', '.join(bad)} not divisible by {group_size}"
        )


def shard(model, group: mx.distributed.Group | None = None) -> None:
    """Shard `model` in place over `group` (default: the group mx.distributed.init() gives)."""
    group = group or mx.distributed.init()
    n = group.size()
    if n == 1:
        return
    _check_divisible(model.args, n)
    quantization = getattr(model, "quantization", None)
    if quantization:
        # A sharded-to-all layer splits its input axis, which must keep whole quantization groups.
        per_rank = min(
            model.args.num_attention_heads * model.args.head_dim, model.args.intermediate_size
        )
        if (per_rank // n) % quantization["group_size"]:
            raise ValueError(
                f"cannot shard a model quantized with group_size {quantization['group_size']} "
                f"over {n} ranks: a rank's input slice ({per_rank // n}) splits a group"
            )
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    model.group = group
    mx.eval(model.parameters())
