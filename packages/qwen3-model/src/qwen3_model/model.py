"""Qwen3 on MLX. MLX's own blocks everywhere except attention, which is where the checkpoints
differ: "composition" always runs the readable grouped attention with the checkpoint's separate
projections (the chapter's baseline); "decode-attention" runs, inside the fused kernel's
measured region (attn_kernels.guard, asked in Attention.__call__), one AttentionStep per layer
(q/k norm, RoPE, the cache write and attention in one op) on fused q/k/v and gate/up projections
(Model.fuse_projections, done at load; docs/fused-step.md), and outside it, and for prefill,
mx.fast.scaled_dot_product_attention. A quantized cache goes through one AttentionStepQuantized
per layer in decode (the new position quantized inside the step) and decode_attention_quantized
elsewhere where measured, else the dequantised cache through mx.fast."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from attn_kernels import (
    SCHEDULES,
    attention_step,
    attention_step_quantized,
    decode_attention_custom,
    decode_attention_quantized,
    dequantize_kv,
    guard,
    range_mask,
    scaled_dot_product_attention,
)
from attn_kernels.guard import use_fused, use_fused_quantized, use_step, use_step_quantized
from attn_kernels.linear import LayerWeights, guarded_linear, layer_weights, linear_rows_routed

from qwen3_model.add_norm import add_rms_norm
from qwen3_model.batch import BatchKVCache
from qwen3_model.cache import KVCache
from qwen3_model.configs import ModelArgs
from qwen3_model.quantized_cache import QuantizedKVCache
from qwen3_model.sharding import shard

CHECKPOINTS = ("composition", "decode-attention")
# Inputs of at most this many positions are decode steps: only they take the fused projections
# and the step's other fusions. A prompt's chunks keep separate matmuls, as fast there (H200,
# 32768-token prompt: 12.8 k tok/s either way) and 1.8 GB lower in peak memory
# (docs/quantized-kv-cuda.md, "The whole model with a 4-bit cache").
DECODE_POSITIONS = 8


class FusedLinear:
    """Bias-free linear layers of one input as one matmul: weights (and a quantized layer's scales
    and biases) concatenated by rows. A plain object, not an nn.Module: parameters() keep the
    checkpoint's separate names, which become row views of the fused arrays (no second copy)."""

    def __init__(self, layers: list[nn.Module]):
        first = layers[0]
        self.quantized = isinstance(first, nn.QuantizedLinear)
        if any("bias" in layer for layer in layers) or any(
            isinstance(layer, nn.QuantizedLinear) != self.quantized for layer in layers
        ):
            raise ValueError("FusedLinear fuses bias-free layers of one kind")
        self.sizes = [layer.weight.shape[0] for layer in layers]
        names = ("weight", "scales", "biases") if self.quantized else ("weight",)
        self.arrays = {}
        for name in names:
            if first.get(name) is None:
                continue
            fused = mx.concatenate([layer[name] for layer in layers], axis=0)
            mx.eval(fused)
            self.arrays[name] = fused
            start = 0
            for layer, size in zip(layers, self.sizes, strict=True):
                layer[name] = fused[start : start + size]
                start += size
            mx.eval([layer[name] for layer in layers])
        if self.quantized:
            self.group_size, self.bits, self.mode = first.group_size, first.bits, first.mode
        self.sources = [layer.weight for layer in layers]

    def fuses(self, layers) -> bool:
        """Whether the layers still hold the views made here (not weights loaded since)."""
        return all(layer.weight is w for layer, w in zip(layers, self.sources, strict=True))

    def __call__(self, x: mx.array, decode: bool = False) -> mx.array:
        """x through every fused layer; a decode step's through `linear` (the guard's kernels)."""
        return linear(self, x, decode) if decode else self.matmul(x)

    def matmul(self, x: mx.array) -> mx.array:
        """MLX's own (quantized) matmul of the fused arrays."""
        if self.quantized:
            return mx.quantized_matmul(
                x,
                self.arrays["weight"],
                scales=self.arrays["scales"],
                biases=self.arrays.get("biases"),
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
        return x @ self.arrays["weight"].T


def _weights(layer) -> LayerWeights | None:
    """The arrays of a linear layer: FusedLinear's fused ones, else attn_kernels' layer_weights
    (mlx.nn's Linear, QuantizedLinear, and an Embedding as the tied LM head)."""
    if not isinstance(layer, FusedLinear):
        return layer_weights(layer)
    a = layer.arrays
    if not layer.quantized:
        return a["weight"], None, None, None, 0, 0
    if layer.mode != "affine" or "biases" not in a:
        return None
    return a["weight"], a["scales"], a["biases"], None, layer.group_size, layer.bits


def linear(layer, x: mx.array, decode: bool, gate: mx.array | None = None) -> mx.array:
    """layer(x) for a linear layer (or an embedding as the LM head: its as_linear); with a gate,
    layer(swiglu(gate, x)). In a decode step (`decode`: the decode-attention checkpoint,
    decode-sized x) decode_linear reads the weights where attn_kernels.guard measured it to beat
    MLX's matmul (the CPU; CUDA at 2-32 rows of 4- and 8-bit codes), on the CPU with the SwiGLU
    inside it: MLX's own op there runs its exp lane by lane (docs/cpu-linear.md, "The SwiGLU
    inside the down projection")."""
    # The rows first, the full question (the layer's arrays, the formats) only where the backend
    # runs decode_linear for that many rows: asked on every call of a one-row step on CUDA, it
    # added 8-20% to a 28-layer step's graph building (this CPU).
    routed = decode and linear_rows_routed(x)
    out = guarded_linear(x, _weights(layer), gate) if routed else None
    if out is not None:
        return out
    if gate is not None:
        x = swiglu(gate, x)
    if isinstance(layer, nn.Embedding | nn.QuantizedEmbedding):
        return layer.as_linear(x)
    if isinstance(layer, FusedLinear):
        return layer.matmul(x)
    return layer(x)


def project_out(
    layer: nn.Module,
    x: mx.array,
    residual: mx.array | None,
    in_matmul: bool,
    decode: bool = False,
    gate: mx.array | None = None,
):
    """residual + layer(x) (layer through `linear`, with `decode` and `gate`); with in_matmul,
    for a plain bf16/float Linear and a decode-sized x (at most 8 positions), one mx.addmm: the
    add rides in the matmul (one kernel fewer; an experiment, Model.set_residual_in_matmul)."""
    if residual is None:
        return linear(layer, x, decode, gate)
    if (
        in_matmul
        and type(layer) is nn.Linear
        and "bias" not in layer
        and x.shape[-2] <= DECODE_POSITIONS
    ):
        return mx.addmm(residual, x if gate is None else swiglu(gate, x), layer.weight.T)
    return residual + linear(layer, x, decode, gate)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.head_dim = args.head_dim
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
        self.rope_base = args.rope_theta
        self.eps = args.rms_norm_eps
        self.qkv = None  # FusedLinear of q/k/v (fuse_projections)
        self.fused_step = True  # decode-attention: fused projections and AttentionStep
        self.residual_in_matmul = False  # with the step: o_proj and down_proj as mx.addmm
        self.add_norm = False  # with the step: residual add + post-attention norm in one kernel
        self.fold_step = None  # the step as one kernel on CUDA (None: the process default)

    def fuse_projections(self) -> None:
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def project(self, x: mx.array, fused: bool) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as (B, L, heads·D): one matmul (a decode step's: `linear`) and three views
        when fused."""
        projections = [self.q_proj, self.k_proj, self.v_proj]
        if fused and self.qkv is not None and self.qkv.fuses(projections):
            nq, nk, _ = self.qkv.sizes
            # One Split op (three views): a quarter of three slices' host time.
            q, k, v = mx.split(self.qkv(x, decode=True), [nq, nq + nk], axis=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x: mx.array, mask=None, cache=None, residual=None) -> mx.array:
        """Attention's output after o_proj, plus `residual` when given."""
        b, length, _ = x.shape
        decode = self.checkpoint == "decode-attention"
        step = decode and self.fused_step
        where = guard.backend()  # once per call: both of the guard's questions need it
        if isinstance(cache, BatchKVCache):
            # The rows of a batch cache; x may hold them as positions of one row (Model's fold).
            q, k, v = self.project(x, step)
            rows = len(cache.lengths)
            q, k, v = (t.reshape(rows, -1, t.shape[-1]) for t in (q, k, v))
            out = self._attend_rows(q, k, v, cache, where).reshape(*x.shape[:-1], -1)
            return project_out(self.o_proj, out, residual, False, decode=step)
        q, k, v = self.project(x, step and length <= DECODE_POSITIONS)
        offset = cache.offset if cache is not None else 0
        # The dispatch guard: the fused kernels only where they were measured to beat mx.fast;
        # with a KVCache (or a QuantizedKVCache) on a backend with a step kernel, one
        # AttentionStep (AttentionStepQuantized) per layer (guard.use_step, use_step_quantized).
        quantized = isinstance(cache, QuantizedKVCache)
        if step and (
            (
                isinstance(cache, KVCache)
                and use_step(length, offset + length, self.head_dim, mask, where, dtype=q.dtype)
            )
            or (
                quantized
                and use_step_quantized(
                    length,
                    offset + length,
                    self.head_dim,
                    mask,
                    where,
                    dtype=q.dtype,
                    group_size=cache.group_size,
                )
            )
        ):
            # Norms, RoPE, the cache write (quantized: as mx.quantize) and attention in one op.
            keys, values = cache.reserve(k.dtype, b, self.n_kv_heads, length, self.head_dim)
            args = (q, k, v, self.q_norm.weight, self.k_norm.weight, keys, values, offset)
            # The cache holds only the returned buffers and reads [0, offset) of them, so they
            # stay in place while the previous step still runs (pipelined generation).
            options = dict(
                eps=self.eps, rope_base=self.rope_base, scale=self.scale, owned_caches=True
            )
            if quantized:
                out, keys, values = attention_step_quantized(
                    *args, group_size=cache.group_size, bits=cache.bits, **options
                )
            else:
                out, keys, values = attention_step(
                    *args, schedule=self.schedule, fold=self.fold_step, **options
                )
            cache.advance(keys, values, length)
            return project_out(self.o_proj, out, residual, self.residual_in_matmul, decode=True)
        plain_cache = cache is None or isinstance(cache, KVCache)
        fused = (
            decode
            and plain_cache
            and use_fused(length, offset + length, self.head_dim, mask, where, dtype=q.dtype)
        )
        q = self.q_norm(q.reshape(b, length, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(b, length, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if isinstance(k, tuple):  # a QuantizedKVCache: (codes, scales, biases) triples
            out = self._attend_quantized(q, k, v, mask, cache)
        elif self.checkpoint == "composition":
            out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        elif fused:
            out = decode_attention_custom(
                q, k, v, scale=self.scale, mask=mask, schedule=self.schedule
            )
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(b, length, -1)
        return project_out(self.o_proj, out, residual, False)

    def _attend_rows(self, q, k, v, cache, where: str) -> mx.array:
        """Every row of a batch cache at its own length (batched generation): causal attention of
        each row's new tokens over its own positions, the rows' new K/V written at their lengths.
        Inside the guard one AttentionStep (per-row offsets); elsewhere the same in MLX ops (RoPE
        at each row's offset, the writes per row, attention over each row's range). Returns
        (B, L, Hq·D)."""
        b, length, _ = q.shape
        offsets = list(cache.lengths)
        context = max(offsets) + length
        keys, values = cache.reserve(k.dtype, b, self.n_kv_heads, length, self.head_dim)
        decode = self.checkpoint == "decode-attention"
        if (
            decode
            and self.fused_step
            and use_step(length, context, self.head_dim, "causal", where, dtype=q.dtype, batch=b)
        ):
            # The rows' lengths as the generator keeps them on the device (DeviceLengths: an
            # array made from the list here waited for the step in flight), with their largest.
            lengths = cache.device_lengths.current() if cache.device_lengths else offsets
            out, keys, values = attention_step(
                q, k, v, self.q_norm.weight, self.k_norm.weight, keys, values, lengths,
                max_offset=context - length if cache.device_lengths else None,
                eps=self.eps, rope_base=self.rope_base, scale=self.scale, owned_caches=True,
                schedule=self.schedule, fold=self.fold_step,
            )  # fmt: skip
            cache.advance(keys, values)
            return out
        rows = mx.array(offsets)
        q = self.q_norm(q.reshape(b, length, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(b, length, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=rows), self.rope(k, offset=rows)
        at = mx.broadcast_to(rows[:, None, None, None] + mx.arange(length)[:, None], k.shape)
        keys = mx.put_along_axis(keys, at, k, axis=2)
        values = mx.put_along_axis(values, at, v, axis=2)
        cache.advance(keys, values)
        keys, values, ends = keys[:, :, :context], values[:, :, :context], rows + length
        if self.checkpoint == "composition":
            out = scaled_dot_product_attention(q, keys, values, self.scale, "causal", ends=ends)
        elif use_fused(length, context, self.head_dim, "causal", where, dtype=q.dtype, batch=b):
            out = decode_attention_custom(
                q, keys, values, self.scale, "causal", ends=ends, schedule=self.schedule
            )
        else:
            mask = range_mask(b, length, context, None, ends, True)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, length, -1)

    def _attend_quantized(self, q, k, v, mask, cache) -> mx.array:
        """The guard over a quantized cache. Fallback: the cache dequantised, then mx.fast
        (composition: the readable path, the baseline)."""
        settings = dict(group_size=cache.group_size, bits=cache.bits)
        if self.checkpoint == "decode-attention" and use_fused_quantized(
            q.shape[2],
            k[0].shape[2],
            mask,
            head_dim=q.shape[-1],
            dtype=q.dtype,
            group_size=cache.group_size,
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
        self.gate_up = None  # FusedLinear of gate/up (fuse_projections)
        self.swiglu_in_linear = True  # fused: the SwiGLU inside down_proj's decode_linear

    def fuse_projections(self) -> None:
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def __call__(
        self, x: mx.array, fused: bool = False, residual=None, in_matmul: bool = False
    ) -> mx.array:
        """down_proj's output, plus `residual` when given (in_matmul: see project_out)."""
        if (
            fused
            and self.gate_up is not None
            and self.gate_up.fuses([self.gate_proj, self.up_proj])
        ):
            gate, up = mx.split(self.gate_up(x, decode=True), [self.gate_up.sizes[0]], axis=-1)
            if self.swiglu_in_linear:
                return project_out(self.down_proj, up, residual, in_matmul, True, gate)
            return project_out(self.down_proj, swiglu(gate, up), residual, in_matmul, decode=True)
        hidden = swiglu(self.gate_proj(x), self.up_proj(x))
        return project_out(self.down_proj, hidden, residual, False)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str):
        super().__init__()
        self.self_attn = Attention(args, checkpoint)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        attn = self.self_attn
        fused = (
            attn.fused_step
            and attn.checkpoint == "decode-attention"
            and (x.shape[1] <= DECODE_POSITIONS or isinstance(cache, BatchKVCache))
        )
        in_matmul = fused and attn.residual_in_matmul
        if fused and attn.add_norm:
            norm = self.post_attention_layernorm
            y = attn(self.input_layernorm(x), mask, cache)
            h, normed = add_rms_norm(x, y, norm.weight, norm.eps)
        else:
            h = attn(self.input_layernorm(x), mask, cache, residual=x)
            normed = self.post_attention_layernorm(h)
        return self.mlp(normed, fused, residual=h, in_matmul=in_matmul)


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
        if isinstance(cache[0], BatchKVCache):
            mask = None  # each row attends causally to its own range (Attention._attend_rows)
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
        self.fold_rows = True  # a batch decode step's rows as one row's positions (__call__)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        rows = inputs.shape[0]
        # A decode step of a batch cache's rows: the rows go through the linear layers as the
        # positions of one row, (1, B, hidden) instead of (B, 1, hidden). Same arithmetic; MLX's
        # CUDA quantized matmul runs every batch item as a GEMM of its own with a 128-row tile
        # (mlx/backend/cuda/quantized/qmm: M = 1 in each of B batches) and a batch of B rows costs
        # B such GEMMs, positions of one row one GEMM. Attention unfolds them (BatchKVCache).
        fold = (
            self.fold_rows
            and rows > 1
            and inputs.shape[1] == 1
            and isinstance(cache[0] if cache else None, BatchKVCache)
        )
        out = self.model(inputs.reshape(1, rows) if fold else inputs, cache, mask)
        attn = self.layers[0].self_attn
        decode = (
            attn.checkpoint == "decode-attention"
            and attn.fused_step
            and (fold or inputs.shape[1] <= DECODE_POSITIONS)
        )
        head = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        logits = linear(head, out, decode)
        return logits.reshape(rows, 1, -1) if fold else logits

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

    def fuse_projections(self) -> None:
        """q/k/v into one matmul and gate/up into one, for the decode-attention checkpoint (bf16
        or quantized layers alike). parameters() keep the checkpoint's names, as views of the
        fused weights; call again after loading other weights into the model."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def set_fused_step(self, enabled: bool) -> None:
        """decode-attention with (True, the default) or without the fused projections and
        AttentionStep: without, it runs the op chain before them (separate projections, norms,
        RoPE, slice updates, then DecodeAttention), for A/B measurements."""
        for layer in self.layers:
            layer.self_attn.fused_step = enabled

    def set_residual_in_matmul(self, enabled: bool) -> None:
        """An experiment on the fused step's kernel count (docs/fused-step.md): with the fused
        step, o_proj and down_proj of decode-sized inputs as mx.addmm (the residual add inside
        the matmul) instead of a matmul and an add. Off: on the H200 (c4fc9c8) it launched more
        kernels, not fewer (MLX's AddMM goes to cuBLASLt)."""
        for layer in self.layers:
            layer.self_attn.residual_in_matmul = enabled

    def set_add_norm(self, enabled: bool) -> None:
        """An experiment on the fused step's kernel count (docs/fused-step.md): with the fused
        step, the residual add after attention and the post-attention RMSNorm of decode-sized
        inputs as one kernel on CUDA (qwen3_model.add_norm; elsewhere the same two ops). Off: on
        the H200 (c4fc9c8) it saved a kernel per layer but decoded slower."""
        for layer in self.layers:
            layer.self_attn.add_norm = enabled

    def set_swiglu_in_linear(self, enabled: bool) -> None:
        """With the fused step, where down_proj runs decode_linear (the CPU), the MLP's SwiGLU
        inside it (True, the default: decode_linear's gate) or as MLX's op before it (an A/B:
        bench's decode-attention-swiglu-apart)."""
        for layer in self.layers:
            layer.mlp.swiglu_in_linear = enabled

    def set_fold_step(self, enabled: bool | None) -> None:
        """The fused step as one kernel on CUDA (attention_step's fold: the preprocessing inside
        the attention's blocks) or, False, as two; None (the default): the process default
        (on; ATTN_STEP_FOLD=0 turns it off): 364 kernels per decode step instead of 400, no
        slower on the H200 (docs/fused-step.md); other backends ignore it."""
        for layer in self.layers:
            layer.self_attn.fold_step = enabled

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor-parallel in place over `group` (mlx-lm's layout; see sharding.py). The sharded
        projections run unfused (FusedLinear.fuses sees the new layers)."""
        shard(self, group)

    def set_schedule(self, schedule: str) -> None:
        """The fused kernel's GPU schedule inside the guard (for the scheduling experiment)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
        for layer in self.layers:
            layer.self_attn.schedule = schedule
