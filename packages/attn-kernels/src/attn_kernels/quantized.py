"""Decode attention over a quantized KV cache (mlx-lm's `QuantizedKVCache` layout).

keys and values are the `(codes, scales, biases)` triples of `mx.quantize` on the last axis:
codes uint32 (B, Hkv, S, D * bits / 32), scales and biases (B, Hkv, S, D / group_size), so that
a value is scale * code + bias per group of `group_size`. An mlx-lm cache's `state` (or its
`keys` / `values` sliced to the offset) can be passed as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from attn_kernels import _ext
from attn_kernels.attention import _broadcast_mask, _check_mask, row_bounds

QuantizedArrays = Sequence[mx.array]


def _triple(name: str, arrays: object) -> list[mx.array]:
    if not isinstance(arrays, (tuple, list)) or len(arrays) != 3:
        raise ValueError(
            f"{name} must be a (codes, scales, biases) triple from mx.quantize, got "
            f"{type(arrays).__name__}"
            + (f" of {len(arrays)}" if isinstance(arrays, (tuple, list)) else "")
        )
    for part, a in zip(("codes", "scales", "biases"), arrays, strict=True):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name}' {part} must be an mx.array, got {type(a).__name__}")
    return list(arrays)


def dequantize_kv(arrays: QuantizedArrays, *, group_size: int = 64, bits: int = 8) -> mx.array:
    """The (B, Hkv, S, D) float array a quantized triple stands for (mx.dequantize)."""
    codes, scales, biases = _triple("arrays", arrays)
    return mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)


def decode_attention_quantized(
    queries: mx.array,
    keys: QuantizedArrays,
    values: QuantizedArrays,
    scale: float | None = None,
    mask: mx.array | str | None = None,
    *,
    starts: mx.array | None = None,
    ends: mx.array | None = None,
    group_size: int = 64,
    bits: int = 8,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """`decode_attention_custom` over quantized keys and values, one fused op.

    queries: (B, Hq, L, D); keys, values: `mx.quantize` triples as above (views read in place);
    mask: None, "causal" or an array broadcastable to (B, Hq, L, S), and starts, ends (per-row
    ranges), as in `decode_attention_custom`. bits: 4 or 8; group_size: 32, 64 or 128, dividing D
    (mlx-lm's `kv_bits` / `kv_group_size`). Codes are dequantised as they are read; arithmetic is
    float32.
    Returns (B, Hq, L, D) in the queries' dtype.
    """
    # The op checks the triples' lengths, shapes, dtypes and packing; the element types are
    # checked here only when nanobind refuses them, to name the argument (checking every call
    # cost ~3 µs of the call's 4.9 µs of graph building on a 2-vCPU Xeon).
    if not isinstance(keys, (tuple, list)) or not isinstance(values, (tuple, list)):
        _triple("keys", keys)
        _triple("values", values)
    causal = isinstance(mask, str) and mask == "causal"
    explicit = None
    if mask is not None and not causal:
        mask = _check_mask(mask)  # raises for other strings, types and mask dtypes
        codes = _triple("keys", keys)[0]
        if queries.ndim != 4 or codes.ndim != 4:
            raise ValueError(
                f"queries and keys' codes must have 4 dimensions, got {queries.shape} and "
                f"{codes.shape}"
            )
        b, hq, length, _ = queries.shape
        explicit = _broadcast_mask(mask, (b, hq, length, codes.shape[2]))
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    batch = queries.shape[0] if queries.ndim else 0
    starts, ends = row_bounds("starts", starts, batch), row_bounds("ends", ends, batch)
    try:
        return _ext.decode_attention_quantized(
            queries,
            keys,
            values,
            float(scale),
            explicit,
            causal,
            group_size,
            bits,
            starts=starts,
            ends=ends,
            stream=stream,
        )
    except TypeError:
        _triple("keys", keys)
        _triple("values", values)
        raise
