"""Per-layer KV cache, preallocated in steps and written in place."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys/values of one layer, shape (B, Hkv, capacity, D), capacity a multiple of `step`.

    update_and_fetch writes the new positions into the buffers and returns views of the first S
    positions (strided views of the buffers: the fused kernel reads them in place). Old K/V are
    copied only when the capacity grows, once every `step` tokens.
    """

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(
        self, dtype: mx.Dtype, b: int, h: int, length: int, d: int
    ) -> tuple[mx.array, mx.array]:
        """The buffers, grown (a copy, once every `step` tokens) to hold `length` more positions."""
        start, end = self.offset, self.offset + length
        if end > self.capacity:
            capacity = -(-end // self.step) * self.step
            grown_k = mx.zeros((b, h, capacity, d), dtype)
            grown_v = mx.zeros((b, h, capacity, d), dtype)
            if self.keys is not None:
                grown_k[:, :, :start, :] = self.keys[:, :, :start, :]
                grown_v[:, :, :start, :] = self.values[:, :, :start, :]
            self.keys, self.values = grown_k, grown_v
        return self.keys, self.values

    def advance(self, keys: mx.array, values: mx.array, length: int) -> None:
        """Take the buffers an AttentionStep returned (positions up to offset + length written).
        Holding only these lets the next step update them in place, also while this one still
        runs (attention_step's owned_caches: the cache reads only [0, offset) of its buffers, so
        positions past it may be written under any view of them; a cache array held elsewhere,
        e.g. a copied prompt cache, is still copied)."""
        self.keys, self.values = keys, values
        self.offset += length

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, length, d = keys.shape
        start, end = self.offset, self.offset + length
        self.reserve(keys.dtype, b, h, length, d)
        self.keys[:, :, start:end, :] = keys
        self.values[:, :, start:end, :] = values
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        """What mlx-lm's generate_step evaluates after each prefill chunk."""
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def make_cache(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """One cache per layer: KVCache, or with kv_bits (4 or 8) a QuantizedKVCache in mlx-lm's
    layout (kv_bits / kv_group_size as mlx-lm's generate takes them)."""
    if kv_bits is None:
        return [KVCache() for _ in model.layers]
    from qwen3_model.quantized_cache import QuantizedKVCache

    return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) for _ in model.layers]
