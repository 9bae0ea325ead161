"""Grouped-query attention: the readable oracle and the fused decode-attention entry point.

Shapes (both functions):
    query: (B, Hq, L, D)    key, value: (B, Hkv, S, D)    out: (B, Hq, L, D)
Query head h reads key/value head h // (Hq // Hkv); K/V are never repeated.

mask: None, "causal" (bottom-right aligned: query row i sees keys <= S - L + i), or an array
broadcastable to (B, Hq, L, S): additive (float) or boolean (True keeps a key).

starts, ends: per batch row, the cache positions [starts[b], ends[b]) the row's queries see
(defaults 0 and S): a batch of sequences of different lengths in one cache, left-padded as
mlx-lm's batch caches are (a start per row) or ending at their own positions (an end per row),
without a mask tensor. Causal rows are aligned to their own end (query i sees up to
ends[b] - L + i). int32 arrays of shape (B,), or sequences of ints.

The contract: `scaled_dot_product_attention` (the readable path, the tests' oracle) and
`decode_attention_custom` (the fused op) follow every rule below; tests/test_contract.py runs one
table of inputs through both.

- Inputs: query, key, value and an array mask may be anything `mx.array(x)` accepts (numpy arrays
  included) and are converted as it converts them; anything else raises TypeError naming the
  argument. scale defaults to 1 / sqrt(D).
- dtypes: query, key and value are float32, float16 or bfloat16, all three the same; otherwise
  ValueError naming the arrays and their dtypes (nothing is promoted silently). The output has
  the query's dtype. An array mask is boolean or floating point (any float dtype: it is added in
  float32); any other mask dtype raises TypeError. Other mask objects raise TypeError, other
  strings ValueError.
- Shapes: wrong ranks, batch, head dim or head counts raise ValueError; so does causal with
  L > S and a mask that does not broadcast. D >= 1.
- Empty: S = 0 returns zeros of shape (B, Hq, L, D) (the softmax over no keys is the fully
  masked row below); L = 0 (or B = 0, Hq = 0) returns the empty (B, Hq, L, D).
- Removed keys: a key is removed by False in a boolean mask, -inf in an additive one, the causal
  bound, or its row's range (starts, ends). A row whose scores are all -inf after the mask
  (every key removed, or an empty range) returns zeros.
- Ranges: starts and ends are int32 (B,) (sequences are converted); other dtypes or shapes, and
  values outside [0, S] or a start past its end, raise ValueError naming the argument (the
  fused op checks values it can read without waiting: arrays made from lists or already
  evaluated; a lazily computed one is clamped to [0, S] by the kernels). A mask and ranges
  combine.
- Non-finite values otherwise follow float32 arithmetic of softmax(scale * q k^T + mask) v: a NaN
  or +inf score in a row (NaN or inf in q, k, scale or an additive mask) makes the whole row NaN;
  NaN or inf in a kept value reaches the output dimensions it sits in. K/V at removed keys are
  not part of the result: the fused op does not read them where a whole tile is removed, and the
  readable path multiplies them by zero weights (0 * NaN is NaN), so keep them finite.
- The one asymmetry: D > MAX_HEAD_DIM raises ValueError in the fused op (its kernels keep a
  query slice in registers) and runs in the readable path, because the readable path is the
  oracle for every shape a test may want to check.
"""

from __future__ import annotations

import math

import mlx.core as mx

from attn_kernels import _ext

MAX_HEAD_DIM: int = _ext.MAX_HEAD_DIM
# GPU kernel schedules; "auto" picks per backend and shape (kernels-cuda/README.md). The CPU
# kernel has one.
SCHEDULES: tuple[str, ...] = tuple(_ext.SCHEDULES)


FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_decode = _ext.decode_attention  # one global lookup per call instead of two


def _as_array(name: str, x: object) -> mx.array:
    """`x` as mx.array(x) converts it (numpy arrays, lists), or a TypeError naming `name`."""
    if isinstance(x, mx.array):
        return x
    try:
        return mx.array(x)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be an mx.array or convertible by mx.array(), got {type(x).__name__}"
        ) from e


def _check_shapes(query: mx.array, key: mx.array, value: mx.array) -> tuple[int, ...]:
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape (B, heads, length, D), got {a.shape}")
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            "query, key and value must share one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
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
    if d < 1:
        raise ValueError(f"head dim D must be >= 1, got shape {query.shape}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return b, hq, hkv, length, s, d


def _check_mask(mask: object) -> mx.array | str | None:
    """None, "causal" or a boolean/floating mask array (converted like the inputs)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask == "causal":
            return mask
        raise ValueError(f"unsupported attention mask {mask!r}: use None, 'causal' or an array")
    mask = _as_array("mask", mask)
    if mask.dtype != mx.bool_ and mask.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"mask must be boolean (True keeps a key) or floating point (additive), "
            f"got {mask.dtype}"
        )
    return mask


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


def row_bounds(name: str, bounds: object, batch: int) -> mx.array | None:
    """Per-row cache bounds as the ops take them: None, or an int32 (B,) array (sequences of ints
    converted; an array's dtype is the op's to check)."""
    if bounds is None or isinstance(bounds, mx.array):
        return bounds
    try:
        if isinstance(bounds, str | bytes):
            raise TypeError("a string")
        values = [int(x) for x in bounds]
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name} must be an int32 array or a sequence of ints, one per batch row, got "
            f"{type(bounds).__name__}"
        ) from e
    if len(values) != batch:
        raise ValueError(f"{name} must have one value per batch row ({batch}), got {len(values)}")
    return mx.array(values, dtype=mx.int32)


def range_mask(
    batch: int,
    query_len: int,
    context: int,
    starts: mx.array | None,
    ends: mx.array | None,
    causal: bool,
) -> mx.array:
    """The boolean (B, 1, L, S) mask that per-row ranges stand for: True where query i of row b
    may see key j, starts[b] <= j < ends[b] (defaults 0 and S), and causal: j <= ends[b] - L + i.
    The readable path's (and the tests') form of the fused ops' starts and ends."""
    j = mx.arange(context)[None, None, None, :]
    first = mx.zeros((batch,), mx.int32) if starts is None else starts.astype(mx.int32)
    end = mx.full((batch,), context, mx.int32) if ends is None else ends.astype(mx.int32)
    first, end = first[:, None, None, None], end[:, None, None, None]
    keep = (j >= first) & (j < end)
    if causal:
        i = mx.arange(query_len)[None, None, :, None]
        keep = keep & (j <= end - query_len + i)
    return keep


def _check_ranges(starts, ends, batch: int, context: int) -> tuple:
    """starts and ends as int32 (B,) arrays with values in [0, S], starts <= ends (the readable
    path's checks; the fused op checks the same in C++)."""
    starts, ends = row_bounds("starts", starts, batch), row_bounds("ends", ends, batch)
    for name, a in (("starts", starts), ("ends", ends)):
        if a is None:
            continue
        if a.dtype != mx.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
        if a.shape != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {a.shape}")
        if mx.any((a < 0) | (a > context)).item():
            raise ValueError(f"{name} has values outside [0, {context}]: {a.tolist()}")
    if starts is not None and ends is not None and mx.any(starts > ends).item():
        raise ValueError(f"starts {starts.tolist()} pass ends {ends.tolist()}")
    return starts, ends


def scaled_dot_product_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
    *,
    starts: mx.array | None = None,
    ends: mx.array | None = None,
) -> mx.array:
    """Readable grouped attention in mlx.core: scores, float32 softmax, weighted values. starts and
    ends become the mask they stand for (range_mask)."""
    query, key, value = (
        _as_array(n, a) for n, a in (("query", query), ("key", key), ("value", value))
    )
    b, hq, hkv, length, s, d = _check_shapes(query, key, value)
    mask = _check_mask(mask)
    kind = "none" if mask is None else "causal" if isinstance(mask, str) else "array"
    if kind == "causal" and length > s:
        raise ValueError(f"causal attention needs query length <= context, got L={length} > S={s}")
    if starts is not None or ends is not None:
        starts, ends = _check_ranges(starts, ends, b, s)
        ranges = range_mask(b, length, s, starts, ends, kind == "causal")
        if kind == "array":
            m = _broadcast_mask(mask, (b, hq, length, s))
            mask = mx.where(ranges, m, False if m.dtype == mx.bool_ else -mx.inf)
        else:
            mask = ranges
        kind = "array"
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    # (B, Hkv, group, L, D) against (B, Hkv, 1, S, D): broadcasting pairs each group with its head.
    q = query.reshape(b, hkv, group, length, d)
    k = key[:, :, None]
    v = value[:, :, None]
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
    if kind == "causal":
        scores = mx.where(causal_mask(length, s), scores, -mx.inf)
    elif kind == "array":
        m = _broadcast_mask(mask, (b, hq, length, s)).reshape(b, hkv, group, length, s)
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m
    # A row with every score -inf (every key removed) is zeros, not softmax's 0/0 = NaN.
    fully_masked = mx.all(scores == -mx.inf, axis=-1, keepdims=True)
    probs = mx.where(fully_masked, 0.0, mx.softmax(scores, axis=-1))
    out = probs.astype(value.dtype) @ v
    return out.reshape(b, hq, length, d)


def decode_attention_custom(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
    *,
    starts: mx.array | None = None,
    ends: mx.array | None = None,
    schedule: str = "auto",
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """The same contract as `scaled_dot_product_attention`, as one fused DecodeAttention op.

    The op takes the 4-D arrays as they are (views included: no K/V copies, and no reshape ops
    around the call, which on a GPU cost more host time than the kernel at short contexts);
    "causal" becomes a flag, so no mask tensor is built; an explicit mask is broadcast (a view) to
    (B, Hq, L, S). starts and ends (per-row ranges) are read by the kernel, no mask built either.
    `schedule` picks the GPU kernel variant (one of SCHEDULES).
    """
    # The decode call (a scale, mask None or "causal", ranges as arrays) goes straight to the
    # op, which validates everything itself in C++: at short contexts host time per call is what
    # a GPU decode step waits on (docs/host-cost.md). Anything the op refuses (numpy inputs:
    # TypeError; bad shapes or dtypes: ValueError) runs the general path below, which converts
    # and words errors as the readable path does.
    if scale is not None and (mask is None or (mask.__class__ is str and mask == "causal")):
        try:
            if starts is None and ends is None and stream is None:
                return _decode(query, key, value, scale, None, mask is not None, schedule)
            return _decode(
                query,
                key,
                value,
                scale,
                None,
                mask is not None,
                schedule,
                starts=starts,
                ends=ends,
                stream=stream,
            )
        except (TypeError, ValueError):
            pass
    return _decode_general(query, key, value, scale, mask, starts, ends, schedule, stream)


def _decode_general(query, key, value, scale, mask, starts, ends, schedule, stream) -> mx.array:
    """decode_attention_custom for any input the contract allows: conversion, explicit masks,
    the default scale, and errors worded as in the readable path."""
    if not (type(query) is type(key) is type(value) is mx.array):
        query, key, value = (
            _as_array(n, a) for n, a in (("query", query), ("key", key), ("value", value))
        )
    causal = isinstance(mask, str) and mask == "causal"
    explicit = None
    if mask is not None and not causal:
        b, hq, _hkv, length, s, _d = _check_shapes(query, key, value)
        explicit = _broadcast_mask(_check_mask(mask), (b, hq, length, s))
    if scale is None:
        d = query.shape[-1] if query.ndim else 0
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0  # D < 1 is refused below
    batch = query.shape[0] if query.ndim else 0
    starts, ends = row_bounds("starts", starts, batch), row_bounds("ends", ends, batch)
    try:
        return _decode(
            query,
            key,
            value,
            float(scale),
            explicit,
            causal,
            schedule,
            starts=starts,
            ends=ends,
            stream=stream,
        )
    except ValueError:
        _check_shapes(query, key, value)
        raise
