"""Per-layer quantized KV cache in mlx-lm's layout (QuantizedKVCache: mx.quantize triples)."""

from __future__ import annotations

import mlx.core as mx


class QuantizedKVCache:
    """Keys/values of one layer as `mx.quantize` triples (codes uint32 (B, Hkv, capacity,
    D·bits/32), scales and biases (B, Hkv, capacity, D/group_size)), capacity a multiple of
    `step`: the state of mlx-lm's QuantizedKVCache, `kv_bits` / `kv_group_size` as there.

    update_and_fetch quantizes the new positions into the buffers and returns views of the first S
    positions of each array (decode_attention_quantized reads them in place).
    """

    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8):
        if bits not in (4, 8):
            raise ValueError(f"kv_bits must be 4 or 8, got {bits}")
        if group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size}")
        self.group_size, self.bits = group_size, bits
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _grow(self, triples: list[mx.array] | None, shapes: list, capacity: int, start: int):
        """Zeroed arrays of `capacity` positions, (B, Hkv, last size, dtype) each, holding the
        first `start` positions of `triples`."""
        grown = [mx.zeros((b, h, capacity, last), dtype) for b, h, last, dtype in shapes]
        if triples is not None:
            for g, old in zip(grown, triples, strict=True):
                g[:, :, :start, :] = old[:, :, :start, :]
        return grown

    def reserve(
        self, dtype: mx.Dtype, b: int, h: int, length: int, d: int
    ) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """The triples, grown (a copy, once every `step` tokens) to hold `length` more
        positions, for attention_step_quantized to write."""
        if d % self.group_size:
            raise ValueError(f"kv_group_size {self.group_size} does not divide head_dim {d}")
        start, end = self.offset, self.offset + length
        if end > self.capacity:
            capacity = -(-end // self.step) * self.step
            groups = d // self.group_size
            shapes = [(b, h, d * self.bits // 32, mx.uint32), *[(b, h, groups, dtype)] * 2]
            self.keys = self._grow(self.keys, shapes, capacity, start)
            self.values = self._grow(self.values, shapes, capacity, start)
        return tuple(self.keys), tuple(self.values)

    def advance(self, keys: tuple, values: tuple, length: int) -> None:
        """Take the triples an AttentionStepQuantized returned (as KVCache.advance)."""
        self.keys, self.values = list(keys), list(values)
        self.offset += length

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        if keys.shape[-1] % self.group_size:
            raise ValueError(
                f"kv_group_size {self.group_size} does not divide head_dim {keys.shape[-1]}"
            )
        start, end = self.offset, self.offset + keys.shape[2]
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if end > self.capacity:
            capacity = -(-end // self.step) * self.step
            self.keys = self._grow(
                self.keys, [(*a.shape[:2], a.shape[3], a.dtype) for a in new_k], capacity, start
            )
            self.values = self._grow(
                self.values, [(*a.shape[:2], a.shape[3], a.dtype) for a in new_v], capacity, start
            )
        for buffers, new in ((self.keys, new_k), (self.values, new_v)):
            for buffer, part in zip(buffers, new, strict=True):
                buffer[:, :, start:end, :] = part
        self.offset = end
        return (
            tuple(a[:, :, :end, :] for a in self.keys),
            tuple(a[:, :, :end, :] for a in self.values),
        )

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in self.keys + self.values)
