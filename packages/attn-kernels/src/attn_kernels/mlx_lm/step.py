"""mlx-lm's attention with the fused step: `enable()` puts `fused_call`'s method in place of
`Attention.__call__` of mlx-lm's llama (also mistral, which mlx-lm loads through llama.py),
qwen2, qwen3, qwen3_moe, gemma3_text and phi3 modules (STEP_MODELS).

A decode step that attn_kernels.guard.use_step accepts (the question qwen3_model's attention
asks) with mlx-lm's plain KVCache runs q/k RMSNorm (Qwen3 and Gemma 3; the others have none),
RoPE, the cache write and attention as one `attention_step` on the cache's own buffers, then
o_proj as mlx-lm does; with mlx-lm's QuantizedKVCache, where guard.use_step_quantized accepts
it, one `attention_step_quantized` on its triples (the new position quantized as mx.quantize
does). The q/k/v projections stay mlx-lm's Linear layers (with Qwen2's biases; Phi-3's one
qkv_proj split as mlx-lm splits it); the op takes their outputs. The cache grows exactly as
KVCache.update_and_fetch grows it, and afterwards holds only the buffers the op returned
(owned_caches: nothing else holds them, and the cache reads [0, offset) of them). With mlx-lm's
BatchKVCache (and BatchRotatingKVCache until it wraps) a decode step runs every row in one
attention_step, each from its left padding. With a RotatingKVCache (a sliding window) a
single-token step writes at the ring's slot (ring_slot) and, once the window is full, attends all
of it at the token's own position (attention_step's `position`). Every other call runs mlx-lm's
method unchanged: prefill past the guard's query limit, other cache types, explicit masks, RoPE
other than nn.RoPE (plain or with a position scale) and Llama 3's scaled frequencies
(rope_options: other scalings such as yarn and longrope, traditional pairs, partial rotary dims,
NoPE), dtypes that differ between the projections, the norms and the cache, and anything the op
refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from attn_kernels.attention_step import attention_step, attention_step_quantized
from attn_kernels.guard import use_step, use_step_quantized


@dataclass(frozen=True)
class StepModel:
    """What the fused step needs to know of an architecture's Attention class."""

    norms: tuple[str, str] | None = None  # the q/k RMSNorm attributes (None: no q/k norm)
    norm_plus_one: bool = False  # Gemma's RMSNorm scales by 1 + weight
    fused_qkv: str | None = None  # one projection split into q | k | v (Phi-3's qkv_proj)


# mlx-lm model modules whose Attention class the fused step replaces.
STEP_MODELS: dict[str, StepModel] = {
    "llama": StepModel(),  # and mistral, which mlx-lm loads through llama.py
    "qwen2": StepModel(),
    "qwen3": StepModel(norms=("q_norm", "k_norm")),
    "qwen3_moe": StepModel(norms=("q_norm", "k_norm")),  # Qwen3's attention; experts in the MLP
    # its global layers on plain caches, the sliding ones on a RotatingKVCache's ring
    "gemma3_text": StepModel(norms=("q_norm", "k_norm"), norm_plus_one=True),
    "phi3": StepModel(fused_qkv="qkv_proj"),
}


def fold_rows(method: Callable) -> Callable:
    """A quantized layer's forward `method` with a decode step's rows folded: x of shape
    (B, 1, K), B > 1, runs as (1, B, K) and comes back as (B, 1, N). The arithmetic is the same
    per row; MLX 0.32's CUDA quantized matmul runs each batch item as its own GEMM with a 128-row
    tile (mlx/backend/cuda/quantized/qmm), so B rows of one position cost B GEMMs and B positions
    of one row one GEMM."""

    def folded(self, x, *args, **kwargs):
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            b = x.shape[0]
            out = method(self, x.reshape(1, b, x.shape[-1]), *args, **kwargs)
            return out.reshape(b, 1, out.shape[-1])
        return method(self, x, *args, **kwargs)

    folded.__wrapped__ = method
    return folded


def rope_options(rope, head_dim: int) -> dict | None:
    """How the op rotates as `rope` does, over all head_dim dims, non-traditional:
    {"rope_base": base} for a plain nn.RoPE; {"rope_freqs": periods} for an nn.RoPE with a
    position scale (mlx-lm's linear scaling: base^(2j/D) / scale) and mlx-lm's Llama3RoPE (its
    _freqs), worked out once per module; None for any other rotation (other scalings, partial
    rotary dims, traditional pairs), which keeps mlx-lm's path."""
    kind = type(rope)
    llama3 = kind.__name__ == "Llama3RoPE" and kind.__module__ == "mlx_lm.models.rope_utils"
    if not (kind is nn.RoPE or llama3) or rope.traditional or rope.dims != head_dim:
        return None
    if kind is nn.RoPE and rope.scale == 1.0:
        return {"rope_base": rope.base}
    periods = rope.__dict__.get("_attn_kernels_periods")  # beside the module's parameters
    if periods is None:
        if llama3:
            periods = tuple(rope._freqs.astype(mx.float32).tolist())
        else:
            periods = tuple(
                rope.base ** (2 * j / head_dim) / rope.scale for j in range(head_dim // 2)
            )
        object.__setattr__(rope, "_attn_kernels_periods", periods)
    return {"rope_freqs": periods}


def _plus_one(norm) -> mx.array:
    """Gemma's RMSNorm scale, 1 + weight, formed once per weight array rather than as two more
    ops in every layer of every step (a new weight array, e.g. after load_weights, forms it
    again)."""
    cached = norm.__dict__.get("_attn_kernels_plus_one")
    if cached is None or cached[0] is not norm.weight:
        cached = (norm.weight, 1.0 + norm.weight)
        object.__setattr__(norm, "_attn_kernels_plus_one", cached)  # beside its parameters
    return cached[1]


def grow(cache, b: int, heads: int, length: int, head_dim: int, dtype: mx.Dtype, prev: int):
    """The buffers of mlx-lm's KVCache (or BatchKVCache) with room for `length` more positions
    after `prev` (its offset; a batch cache's _idx), grown as its update_and_fetch grows them
    (step positions at a time, by concatenation)."""
    if cache.keys is None or prev + length > cache.keys.shape[2]:
        n_steps = (cache.step + length - 1) // cache.step
        shape = (b, heads, n_steps * cache.step, head_dim)
        new_k, new_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        if cache.keys is None:
            cache.keys, cache.values = new_k, new_v
        else:
            if prev % cache.step != 0:
                cache.keys = cache.keys[..., :prev, :]
                cache.values = cache.values[..., :prev, :]
            cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
            cache.values = mx.concatenate([cache.values, new_v], axis=2)
    return cache.keys, cache.values


def own_layout(cache) -> None:
    """A batch cache whose buffers mlx-lm re-laid out since the last fused step (their shape
    differs from the one that step left: rows left or joined) gets MLX's row-contiguous copies of
    them. BatchKVCache.filter leaves views (`keys[rows][..., shift:, :]`) that the op would copy
    into buffers of its own, which on CUDA are managed memory (kernels-cuda/README.md): filling
    every layer's cache so made two calls of 138 and 275-283 ms when a 32-slot batch shrank
    (H100, bench-serve), where MLX's copy lands in device memory and the op then writes it in
    place. A row-contiguous buffer (extend's concatenation) passes MLX's copy as it is."""
    if cache.keys is not None and cache.__dict__.get("_attn_kernels_shape") != cache.keys.shape:
        cache.keys, cache.values = mx.contiguous(cache.keys), mx.contiguous(cache.values)


def grow_rotating(cache, b: int, heads: int, head_dim: int, dtype: mx.Dtype):
    """The buffers of mlx-lm's BatchRotatingKVCache with room for one more position before it
    wraps, grown as its _update_in_place grows them (step positions at a time up to max_size);
    None once it has wrapped (the step's position would overwrite the oldest)."""
    prev = cache._offset
    if cache.rotated or prev >= cache.max_size:
        return None
    if cache.keys is None or (prev >= cache.keys.shape[2] and cache.keys.shape[2] < cache.max_size):
        shape = (b, heads, min(cache.step, cache.max_size - prev), head_dim)
        new_k, new_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        if cache.keys is None:
            cache.keys, cache.values = new_k, new_v
        else:
            cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
            cache.values = mx.concatenate([cache.values, new_v], axis=2)
        cache._idx = prev
    if cache._idx != prev or cache._idx >= cache.keys.shape[2]:
        return None  # not mlx-lm's in-place layout (it trims and rotates there)
    return cache.keys, cache.values


def ring_slot(cache, b: int, heads: int, head_dim: int, dtype: mx.Dtype) -> int | None:
    """Where mlx-lm's RotatingKVCache writes its next single position, its buffers grown as its
    _update_in_place grows them (step positions at a time up to max_size) and the slot wrapped
    to `keep` at the end of the ring; None where that method would first trim a buffer longer
    than max_size (the step after a prefill past the window: left to mlx-lm's method, once)."""
    prev = cache.offset
    if cache.keys is None:
        return None
    if prev >= cache.keys.shape[2] and cache.keys.shape[2] < cache.max_size:
        shape = (b, heads, min(cache.step, cache.max_size - prev), head_dim)
        cache.keys = mx.concatenate([cache.keys, mx.zeros(shape, dtype)], axis=2)
        cache.values = mx.concatenate([cache.values, mx.zeros(shape, dtype)], axis=2)
        cache._idx = prev
    if cache.keys.shape[2] > cache.max_size:
        return None
    return cache.keep if cache._idx == cache.max_size else cache._idx


def grow_quantized(cache, b: int, heads: int, length: int, head_dim: int, dtype: mx.Dtype):
    """The (codes, scales, biases) triples of mlx-lm's QuantizedKVCache with room for `length`
    more positions, grown as its update_and_fetch grows them."""
    prev = cache.offset
    if cache.keys is None or prev + length > cache.keys[0].shape[-2]:
        shape = (b, heads, (cache.step + length - 1) // cache.step * cache.step)
        widths = (head_dim * cache.bits // 32, head_dim // cache.group_size)

        def zeros():
            return (
                mx.zeros((*shape, widths[0]), mx.uint32),
                mx.zeros((*shape, widths[1]), dtype),
                mx.zeros((*shape, widths[1]), dtype),
            )

        if cache.keys is None:
            cache.keys, cache.values = zeros(), zeros()
        else:
            grown = []
            for triple in (cache.keys, cache.values):
                if prev % cache.step != 0:
                    triple = tuple(a[..., :prev, :] for a in triple)
                pairs = zip(triple, zeros(), strict=True)
                grown.append(tuple(mx.concatenate([a, z], axis=-2) for a, z in pairs))
            cache.keys, cache.values = grown
    return cache.keys, cache.values


@dataclass(frozen=True)
class CacheTypes:
    """mlx-lm's cache classes the fused step takes (mlx_lm.models.cache)."""

    kv: type
    quantized: type
    batch: type
    batch_rotating: type
    rotating: type


def _batch_layout_ready(cache) -> bool:
    """A batch cache between decode steps: no right padding waiting for finalize() (a prefill
    of ragged prompts), nothing rolled or trimmed yet."""
    return (
        getattr(cache, "_right_padding", None) is None and getattr(cache, "_lengths", None) is None
    )


def fused_call(original: Callable, types: CacheTypes, calls: dict, model: StepModel) -> Callable:
    """mlx-lm's `Attention.__call__` with decode steps through `attention_step` (and, with a
    QuantizedKVCache, `attention_step_quantized`); `original` is mlx-lm's method, `types` mlx-lm's
    cache classes, `model` what the architecture's attention holds (StepModel),
    calls["fused_step"] counts the fused steps. With mlx-lm's batch caches (BatchGenerator,
    batch_generate, mlx_lm.server) a decode step runs every row at once: each row from its own
    start (the cache's left padding) at its own RoPE position, the new position written at the
    cache's shared index; the mask mlx-lm built from the same cache is then not needed."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        projection = getattr(self, model.fused_qkv or "q_proj")
        weight = getattr(projection, "weight", None)  # Linear or QuantizedLinear: (N, ...)
        kind = type(cache)
        quantized = kind is types.quantized
        batched = kind is types.batch or kind is types.batch_rotating
        rotating = kind is types.rotating
        if weight is None or not (kind is types.kv or quantized or batched or rotating):
            return original(self, x, mask, cache)
        if rotating and x.shape[1] != 1:
            return original(self, x, mask, cache)  # prefill: mlx-lm's concatenation and trims
        if batched:
            # Decode steps only; the mask is the cache's own (left padding, causal).
            if x.shape[1] != 1 or not _batch_layout_ready(cache) or isinstance(mask, str):
                return original(self, x, mask, cache)
        elif not (mask is None or isinstance(mask, str)):
            return original(self, x, mask, cache)
        head_dim = self.head_dim if model.fused_qkv else weight.shape[0] // self.n_heads
        norms = model.norms
        q_norm, k_norm = (getattr(self, n) for n in norms) if norms else (None, None)
        rotation = rope_options(self.rope, head_dim)
        if (norms and q_norm.eps != k_norm.eps) or rotation is None:
            return original(self, x, mask, cache)
        b, length, _ = x.shape
        # The write position: a batch cache's shared index (_offset for the rotating one, which
        # equals its index until it wraps), else the cache's offset.
        offset = (
            cache._offset
            if kind is types.batch_rotating
            else cache._idx
            if batched
            else cache.offset
        )
        # The context the step attends: a rotating cache's window once full.
        context = min(offset + length, cache.max_size) if rotating else offset + length
        # The guard before the projections, so that prefill and long contexts go straight to
        # mlx-lm's method without projections built twice.
        dtype = x.dtype
        if quantized:
            group_size = cache.group_size
            taken = use_step_quantized(
                length, offset + length, head_dim, mask, dtype=dtype, group_size=group_size
            )
        else:
            taken = use_step(
                length,
                context,
                head_dim,
                "causal" if batched else mask,
                dtype=dtype,
                batch=b if batched else 1,
            )
        if not taken:
            return original(self, x, mask, cache)
        # Lazy: if the step is not taken below, these nodes are dropped unevaluated.
        if model.fused_qkv:  # strided views of one projection, read in place by the op
            q_size, kv_size = self.n_heads * head_dim, self.n_kv_heads * head_dim
            q, k, v = mx.split(projection(x), [q_size, q_size + kv_size], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = (q_norm.weight, k_norm.weight) if norms else (None, None)
        if model.norm_plus_one:
            weights = (_plus_one(q_norm), _plus_one(k_norm))
        cached = None if cache.keys is None else cache.keys[1] if quantized else cache.keys
        if any(a is not None and a.dtype != dtype for a in (q, k, v, *weights, cached)):
            return original(self, x, mask, cache)
        options = dict(
            eps=q_norm.eps if norms else None,
            **rotation,
            scale=self.scale,
            # The cache holds only the returned buffers and reads [0, offset) of them.
            owned_caches=True,
        )
        heads = self.n_kv_heads
        try:
            if quantized:
                keys, values = grow_quantized(cache, b, heads, length, head_dim, dtype)
                out, keys, values = attention_step_quantized(
                    q, k, v, *weights, keys, values, offset,
                    group_size=cache.group_size, bits=cache.bits, **options,
                )  # fmt: skip
            elif batched:
                own_layout(cache)
                if kind is types.batch_rotating:
                    grown = grow_rotating(cache, b, heads, head_dim, dtype)
                    if grown is None:  # wrapped: its keys are no longer in temporal order
                        return original(self, x, mask, cache)
                else:
                    grown = grow(cache, b, heads, length, head_dim, dtype, offset)
                starts = cache.left_padding
                if starts.dtype != mx.int32:
                    starts = starts.astype(mx.int32)
                out, keys, values = attention_step(
                    q, k, v, *weights, *grown, offset, starts=starts, **options
                )
            elif rotating:
                slot = ring_slot(cache, b, heads, head_dim, dtype)
                if slot is None:
                    return original(self, x, mask, cache)
                # Until the window fills, the slot is the offset and the keys are in order; from
                # then on the ring is full and its one query attends all of it.
                ring = dict(position=offset) if slot != offset else {}
                out, keys, values = attention_step(
                    q, k, v, *weights, cache.keys, cache.values, slot, **ring, **options
                )
                cache._idx = slot + length
            else:
                keys, values = grow(cache, b, heads, length, head_dim, dtype, offset)
                out, keys, values = attention_step(
                    q, k, v, *weights, keys, values, offset, **options
                )
        except ValueError:
            # A shape the op refuses; the cache grew as mlx-lm's would have, so its own method
            # continues from here.
            return original(self, x, mask, cache)
        cache.keys, cache.values = keys, values
        if batched:
            cache.__dict__["_attn_kernels_shape"] = keys.shape  # beside mlx-lm's attributes
            cache._idx += length
            cache.offset = cache.offset + length  # an array: each row's own count
            if kind is types.batch_rotating:
                cache._offset += length
        else:
            cache.offset += length
        calls["fused_step"] += 1
        return self.o_proj(out)

    return __call__
