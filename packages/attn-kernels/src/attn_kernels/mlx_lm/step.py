"""mlx-lm's attention with the fused step: `enable()` puts `fused_call`'s method in place of
`Attention.__call__` of mlx-lm's llama (also mistral, which mlx-lm loads through llama.py),
qwen2 and qwen3 modules (STEP_MODELS).

A decode step that attn_kernels.guard.use_step accepts (the question qwen3_model's attention
asks) with mlx-lm's plain KVCache runs q/k RMSNorm (Qwen3 only: Llama and Qwen2 have none),
RoPE, the cache write and attention as one `attention_step` on the cache's own buffers, then
o_proj as mlx-lm does; with mlx-lm's QuantizedKVCache, where guard.use_step_quantized accepts
it, one `attention_step_quantized` on its triples (the new position quantized as mx.quantize
does). The q/k/v projections stay mlx-lm's Linear layers (with Qwen2's biases);
the op takes their outputs. The cache grows exactly as KVCache.update_and_fetch grows it, and
afterwards holds only the buffers the op returned (owned_caches: nothing else holds them, and
the cache reads [0, offset) of them). Every other call runs mlx-lm's method unchanged: prefill
past the guard's query limit, other cache types, explicit masks, RoPE other than plain nn.RoPE
(scaling, traditional, partial, NoPE), dtypes that differ between the projections, the norms and
the cache, and anything the op refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from attn_kernels.attention_step import attention_step, attention_step_quantized
from attn_kernels.guard import use_step, use_step_quantized

# mlx-lm model modules whose Attention class the fused step replaces, and the attribute names of
# that class's q/k RMSNorm modules (None: no q/k norm).
STEP_MODELS: dict[str, tuple[str, str] | None] = {
    "llama": None,
    "qwen2": None,
    "qwen3": ("q_norm", "k_norm"),
}


def _plain_rope(rope, head_dim: int) -> bool:
    """The op's rotation: non-traditional, all head_dim dims, no position scaling (what mlx-lm's
    initialize_rope builds without rope_scaling and rope_traditional)."""
    return (
        type(rope) is nn.RoPE
        and not rope.traditional
        and rope.dims == head_dim
        and rope.scale == 1.0
    )


def grow(cache, b: int, heads: int, length: int, head_dim: int, dtype: mx.Dtype):
    """The buffers of mlx-lm's KVCache with room for `length` more positions, grown as its
    update_and_fetch grows them (step positions at a time, by concatenation)."""
    prev = cache.offset
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


def fused_call(
    original: Callable,
    kv_cache: type,
    calls: dict,
    norms: tuple[str, str] | None,
    quantized_kv_cache: type | None = None,
) -> Callable:
    """mlx-lm's `Attention.__call__` with decode steps through `attention_step` (and, with a
    QuantizedKVCache, `attention_step_quantized`); `original` is mlx-lm's method, `kv_cache` and
    `quantized_kv_cache` mlx-lm's cache classes, `norms` the names of the q/k RMSNorm attributes
    (None: the model has none), calls["fused_step"] counts the fused steps."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        weight = getattr(self.q_proj, "weight", None)  # Linear or QuantizedLinear: (Hq·D, ...)
        quantized = quantized_kv_cache is not None and type(cache) is quantized_kv_cache
        if (
            not (type(cache) is kv_cache or quantized)
            or not (mask is None or isinstance(mask, str))
            or weight is None
        ):
            return original(self, x, mask, cache)
        head_dim = weight.shape[0] // self.n_heads
        q_norm, k_norm = (getattr(self, n) for n in norms) if norms else (None, None)
        if (norms and q_norm.eps != k_norm.eps) or not _plain_rope(self.rope, head_dim):
            return original(self, x, mask, cache)
        b, length, _ = x.shape
        offset = cache.offset
        # The guard before the projections, so that prefill and long contexts go straight to
        # mlx-lm's method without projections built twice.
        dtype = x.dtype
        if quantized:
            group_size = cache.group_size
            taken = use_step_quantized(
                length, offset + length, head_dim, mask, dtype=dtype, group_size=group_size
            )
        else:
            taken = use_step(length, offset + length, head_dim, mask, dtype=dtype)
        if not taken:
            return original(self, x, mask, cache)
        # Lazy: if the step is not taken below, these nodes are dropped unevaluated.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = (q_norm.weight, k_norm.weight) if norms else (None, None)
        cached = None if cache.keys is None else cache.keys[1] if quantized else cache.keys
        if any(a is not None and a.dtype != dtype for a in (q, k, v, *weights, cached)):
            return original(self, x, mask, cache)
        options = dict(
            eps=q_norm.eps if norms else None,
            rope_base=self.rope.base,
            scale=self.scale,
            # The cache holds only the returned buffers and reads [0, offset) of them.
            owned_caches=True,
        )
        try:
            if quantized:
                keys, values = grow_quantized(cache, b, self.n_kv_heads, length, head_dim, dtype)
                out, keys, values = attention_step_quantized(
                    q, k, v, *weights, keys, values, offset,
                    group_size=cache.group_size, bits=cache.bits, **options,
                )  # fmt: skip
            else:
                keys, values = grow(cache, b, self.n_kv_heads, length, head_dim, dtype)
                out, keys, values = attention_step(
                    q, k, v, *weights, keys, values, offset, **options
                )
        except ValueError:
            # A shape the op refuses; the cache grew as mlx-lm's would have, so its own method
            # continues from here.
            return original(self, x, mask, cache)
        cache.keys, cache.values = keys, values
        cache.offset += length
        calls["fused_step"] += 1
        return self.o_proj(out)

    return __call__
