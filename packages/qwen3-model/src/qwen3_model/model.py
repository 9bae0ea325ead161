"""Qwen3 on MLX. MLX's own blocks everywhere except attention, which is where the checkpoints
differ: "composition" always runs the readable grouped attention; "decode-attention" runs the
fused DecodeAttention kernel inside its measured region (the guard in Attention.__call__)."""

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

from qwen3_model.configs import ModelArgs

CHECKPOINTS = ("composition", "decode-attention")

# The fused kernel's measured region, per backend: query length L and cached context S (after
# this step's tokens are appended). Each is the largest measured point where the custom kernel
# beat the readable path (the fallback) in every pass, for every measured query length up to
# MAX_QUERY; nothing past the largest measured context.
#   cpu: benchmark_results/cpu-2core-qwen3-4b-attention-L1-mlx-0.32.4.json and
#        cpu-2core-qwen3-4b-attention-L2-L8-causal-mlx-0.32.4.json: wins at every S <= 16384
#        (the largest measured) for L = 1, 2, 4 and 8; the 6-pass query and context sweeps
#        (cpu-2core-qwen3-4b-attention-query-sweep, -context-sweep) agree.
#   cuda: benchmark_results/h200-qwen3-4b-attention-L1-mlx-0.32.4.json (L=1, every schedule)
#        and h200-qwen3-4b-attention-L2-L8-causal-mlx-0.32.4.json (L = 2, 4, 8), both of 52e6f6d:
#        wins at every S <= 131072, the largest measured; so do the short-context runs of the
#        same build (-L1-short-independent/-chained, -L2-L8-short) and the chapter's grid,
#        context and query sweeps (-grid-*, -context-sweep, -query-sweep; f214fee, whose plans
#        for those shapes 52e6f6d keeps).
#   metal: no record of ours yet (no Mac here): the chapter's M4 Pro evidence, L <= 2, S <= 256.
MAX_QUERY = {"cpu": 8, "cuda": 8, "metal": 2}
MAX_CONTEXT = {"cpu": 16384, "cuda": 131072, "metal": 256}
# The same for a quantized cache (make_cache(kv_bits=...)): decode_attention_quantized where
# measured, else the readable path over the dequantised cache.
#   cpu: benchmark_results/cpu-2core-qwen3-4b-attention-quantized-{8,4}-bit-mlx-0.32.4.json: L=1,
#        S = 1024..32768, every pass won against this fallback (readable-quantized: 7.4-23x),
#        mlx-lm's quantized path (22-36x) and mx.fast on bf16 K/V (4.7-8.2x); L > 1 not measured.
#   cuda, metal: no record yet (tools/h200_quantized.sh writes the H200's).
QUANTIZED_MAX_QUERY = {"cpu": 1, "cuda": 0, "metal": 0}
QUANTIZED_MAX_CONTEXT = {"cpu": 32768, "cuda": 0, "metal": 0}


def backend() -> str:
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


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

        # The dispatch guard: the fused kernel only where it was measured to win.
        context, where = k.shape[2], backend()
        if (
            self.checkpoint == "decode-attention"
            and length <= MAX_QUERY[where]
            and context <= MAX_CONTEXT[where]
            and (mask is None or (isinstance(mask, str) and mask == "causal"))
        ):
            out = decode_attention_custom(
                q, k, v, scale=self.scale, mask=mask, schedule=self.schedule
            )
        else:
            out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def _attend_quantized(self, q, k, v, mask, cache) -> mx.array:
        """The guard over a quantized cache; the fallback dequantises and runs the readable path."""
        length, context, where = q.shape[2], k[0].shape[2], backend()
        settings = dict(group_size=cache.group_size, bits=cache.bits)
        if (
            self.checkpoint == "decode-attention"
            and length <= QUANTIZED_MAX_QUERY[where]
            and context <= QUANTIZED_MAX_CONTEXT[where]
            and (mask is None or (isinstance(mask, str) and mask == "causal"))
        ):
            return decode_attention_quantized(q, k, v, scale=self.scale, mask=mask, **settings)
        keys, values = (dequantize_kv(t, **settings).astype(q.dtype) for t in (k, v))
        return scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)


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
    to (B, Hq, L, S), e.g. per-request padding masks of a batch (always the readable path).
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

    def set_schedule(self, schedule: str) -> None:
        """The fused kernel's GPU schedule inside the guard (for the scheduling experiment)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
        for layer in self.layers:
            layer.self_attn.schedule = schedule
