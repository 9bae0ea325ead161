"""Qwen3 on MLX. MLX's own blocks everywhere except attention, which is where the checkpoints
differ: "composition" always runs the readable grouped attention (the chapter's baseline);
"decode-attention" runs the fused DecodeAttention kernel inside its measured region
(attn_kernels.guard) and mx.fast.scaled_dot_product_attention outside it and for prefill."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from attn_kernels import (
    SCHEDULES,
    decode_attention_custom,
    decode_attention_quantized,
    dequantize_kv,
    scaled_dot_product_attention,
)
from attn_kernels.guard import use_fused, use_fused_quantized

from qwen3_model.configs import ModelArgs
from qwen3_model.sharding import shard

CHECKPOINTS = ("composition", "decode-attention")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.checkpoint = checkpoint
        self.schedule = "auto"  # the GPU kernel schedule (experiments; see Model.set_schedule)
        dim, head_dim = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(head_dim, traditional=False, base=args.rope_theta)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, length, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(b, length, self.n_kv_heads, -1)).transpose(
            0, 2, 1, 3
        )
        v = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if isinstance(k, tuple):  # a QuantizedKVCache: (codes, scales, biases) triples
            out = self._attend_quantized(q, k, v, mask, cache)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

        # The dispatch guard: the fused kernel only where it was measured to beat mx.fast, the
        # fallback (the readable path is the composition checkpoint's, the baseline).
        if self.checkpoint == "composition":
            out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        elif use_fused(length, k.shape[2], q.shape[-1], mask, dtype=q.dtype):
            out = decode_attention_custom(
                q, k, v, scale=self.scale, mask=mask, schedule=self.schedule
            )
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def _attend_quantized(self, q, k, v, mask, cache) -> mx.array:
        """The guard over a quantized cache. Fallback: the cache dequantised, then mx.fast
        (composition: the readable path, the baseline)."""
        settings = dict(group_size=cache.group_size, bits=cache.bits)
        if self.checkpoint == "decode-attention" and use_fused_quantized(
            q.shape[2], k[0].shape[2], mask
        ):
            return decode_attention_quantized(q, k, v, scale=self.scale, mask=mask, **settings)
        keys, values = (dequantize_kv(t, **settings).astype(q.dtype) for t in (k, v))
        if self.checkpoint == "composition":
            return scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)


@mx.compile
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """One fused op instead of three (as mlx-lm does), so checkpoints differ only in attention."""
    return nn.silu(gate) * x


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str):
        super().__init__()
        self.self_attn = Attention(args, checkpoint)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, checkpoint) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        h = self.embed_tokens(inputs)
        if mask is None and h.shape[1] > 1:
            mask = "causal"
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    """Parameter names follow the Hugging Face / mlx-lm layout (model.layers.{i}.self_attn...).

    mask: None (causal for several tokens), "causal", or an additive/boolean array broadcastable
    to (B, Hq, L, S), e.g. per-request padding masks of a batch (the fused kernel where
    attn_kernels.guard measured it to win, mx.fast elsewhere).
    """

    def __init__(self, args: ModelArgs, checkpoint: str = "decode-attention"):
        super().__init__()
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"unknown checkpoint {checkpoint!r}: use one of {CHECKPOINTS}")
        self.args = args
        self.model = Qwen3Model(args, checkpoint)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        out = self.model(inputs, cache, mask)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    @property
    def layers(self):
        return self.model.layers

    @property
    def checkpoint(self) -> str:
        return self.layers[0].self_attn.checkpoint

    def set_checkpoint(self, checkpoint: str) -> None:
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"unknown checkpoint {checkpoint!r}: use one of {CHECKPOINTS}")
        for layer in self.layers:
            layer.self_attn.checkpoint = checkpoint

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor-parallel in place over `group` (mlx-lm's layout; see sharding.py)."""
        shard(self, group)

    def set_schedule(self, schedule: str) -> None:
        """The fused kernel's GPU schedule inside the guard (for the scheduling experiment)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
        for layer in self.layers:
            layer.self_attn.schedule = schedule
