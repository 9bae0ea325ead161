"""mlx-lm's attention with the fused step: `enable()` puts `fused_call`'s method in place of
`Attention.__call__` of mlx-lm's llama (also mistral, which mlx-lm loads through llama.py),
qwen2 and qwen3 modules (STEP_MODELS).

A decode step that attn_kernels.guard.use_step accepts (the question qwen3_model's attention
asks) with mlx-lm's plain KVCache runs q/k RMSNorm (Qwen3 only: Llama and Qwen2 have none),
RoPE, the cache write and attention as one `attention_step` on the cache's own buffers, then
o_proj as mlx-lm does. The q/k/v projections stay mlx-lm's Linear layers (with Qwen2's biases);
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

from attn_kernels.attention_step import attention_step
from attn_kernels.guard import use_step

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


def fused_call(
    original: Callable, kv_cache: type, calls: dict, norms: tuple[str, str] | None
) -> Callable:
    """mlx-lm's `Attention.__call__` with decode steps through `attention_step`; `original` is
    mlx-lm's method, `kv_cache` mlx-lm's KVCache class, `norms` the names of the q/k RMSNorm
    attributes (None: the model has none), calls["fused_step"] counts the fused steps."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        weight = getattr(self.q_proj, "weight", None)  # Linear or QuantizedLinear: (Hq·D, ...)
        if (
            type(cache) is not kv_cache
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
        if not use_step(length, offset + length, head_dim, mask, dtype=dtype):
            return original(self, x, mask, cache)
        # Lazy: if the step is not taken below, these nodes are dropped unevaluated.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = (q_norm.weight, k_norm.weight) if norms else (None, None)
        if any(a is not None and a.dtype != dtype for a in (q, k, v, *weights)) or (
            cache.keys is not None and cache.keys.dtype != dtype
        ):
            return original(self, x, mask, cache)
        keys, values = grow(cache, b, self.n_kv_heads, length, head_dim, dtype)
        try:
            out, keys, values = attention_step(
                q,
                k,
                v,
                *weights,
                keys,
                values,
                offset,
                eps=q_norm.eps if norms else None,
                rope_base=self.rope.base,
                scale=self.scale,
                # The cache holds only the returned buffers and reads [0, offset) of them.
                owned_caches=True,
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
