"""Grouped-query attention: the readable oracle and the fused decode-attention entry point.

Shapes (both functions):
    query: (B, Hq, L, D)    key, value: (B, Hkv, S, D)    out: (B, Hq, L, D)
Query head h reads key/value head h // (Hq // Hkv); K/V are never repeated.

mask: None, "causal" (bottom-right aligned: query row i sees keys <= S - L + i), or an array
broadcastable to (B, Hq, L, S): additive (float) or boolean (True keeps a key). A query row whose
mask removes every key returns zeros in both functions.
"""

from __future__ import annotations

import math

import mlx.core as mx

from attn_kernels import _ext

MAX_HEAD_DIM: int = _ext.MAX_HEAD_DIM
# GPU kernel schedules; "auto" picks per backend and shape (kernels-cuda/README.md). The CPU
# kernel has one.
SCHEDULES: tuple[str, ...] = tuple(_ext.SCHEDULES)


def _check_shapes(query: mx.array, key: mx.array, value: mx.array) -> tuple[int, ...]:
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape (B, heads, length, D), got {a.shape}")
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {key.shape} and {value.shape}"
        )
    b, hq, length, d = query.shape
    bk, hkv, s, dk = key.shape
    if bk != b:
        raise ValueError(f"query batch {b} differs from key/value batch {bk}")
    if dk != d:
        raise ValueError(f"query head dim {d} differs from key/value head dim {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return b, hq, hkv, length, s, d


def _mask_kind(mask: object) -> str:
    if mask is None:
        return "none"
    if isinstance(mask, str):
        if mask == "causal":
            return "causal"
        raise ValueError(f"unsupported attention mask {mask!r}: use None, 'causal' or an array")
    if isinstance(mask, mx.array):
        return "array"
    raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")


def _broadcast_mask(mask: mx.array, shape: tuple[int, int, int, int]) -> mx.array:
    try:
        return mx.broadcast_to(mask, shape)
    except ValueError as e:
        raise ValueError(
            f"mask of shape {mask.shape} does not broadcast to (B, Hq, L, S) = {shape}"
        ) from e


def causal_mask(query_len: int, context: int) -> mx.array:
    """Boolean (L, S) mask, True where query row i may see key j (j <= S - L + i)."""
    rows = mx.arange(context - query_len, context)[:, None]
    return mx.arange(context)[None, :] <= rows


def scaled_dot_product_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
) -> mx.array:
    """Readable grouped attention in mlx.core: scores, float32 softmax, weighted values."""
    b, hq, hkv, length, s, d = _check_shapes(query, key, value)
    kind = _mask_kind(mask)
    if kind == "causal" and length > s:
        raise ValueError(f"causal attention needs query length <= context, got L={length} > S={s}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    # (B, Hkv, group, L, D) against (B, Hkv, 1, S, D): broadcasting pairs each group with its head.
    q = query.reshape(b, hkv, group, length, d)
    k = key[:, :, None]
    v = value[:, :, None]
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
    fully_masked = None
    if kind == "causal":
        scores = mx.where(causal_mask(length, s), scores, -mx.inf)
    elif kind == "array":
        m = _broadcast_mask(mask, (b, hq, length, s)).reshape(b, hkv, group, length, s)
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m
        fully_masked = mx.all(scores == -mx.inf, axis=-1, keepdims=True)
    probs = mx.softmax(scores, axis=-1)
    if fully_masked is not None:
        probs = mx.where(fully_masked, 0.0, probs)
    out = probs.astype(value.dtype) @ v
    return out.reshape(b, hq, length, d)


def decode_attention_custom(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
    *,
    schedule: str = "auto",
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """The same contract as `scaled_dot_product_attention`, as one fused DecodeAttention op.

    The op takes the 4-D arrays as they are (views included: no K/V copies, and no reshape ops
    around the call, which on a GPU cost more host time than the kernel at short contexts);
    "causal" becomes a flag, so no mask tensor is built; an explicit mask is broadcast (a view) to
    (B, Hq, L, S). `schedule` picks the GPU kernel variant (one of SCHEDULES).
    """
    # The common decode call (mask None or "causal") goes straight to the op, which validates
    # everything itself: at short contexts host time per call is what a GPU decode step waits
    # on. On a ValueError the shared checks run again, so both entry points word it alike.
    causal = isinstance(mask, str) and mask == "causal"
    explicit = None
    if mask is not None and not causal:
        b, hq, _hkv, length, s, _d = _check_shapes(query, key, value)
        _mask_kind(mask)  # raises for other strings and types
        explicit = _broadcast_mask(mask, (b, hq, length, s))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    try:
        return _ext.decode_attention(
            query, key, value, float(scale), explicit, causal, schedule, stream=stream
        )
    except ValueError:
        _check_shapes(query, key, value)
        raise
