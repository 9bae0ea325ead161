"""One decode step of attention after the q/k/v projections, as one fused op.

The unfused chain it replaces (what mlx-lm's Qwen3 attention runs per layer; Llama and Qwen2
have no q/k norm: q_norm_weight = k_norm_weight = None skips the first two lines' rms_norm):

    q = rms_norm(q.reshape(B, L, Hq, D), q_norm_weight, eps).transpose(0, 2, 1, 3)
    k = rms_norm(k.reshape(B, L, Hkv, D), k_norm_weight, eps).transpose(0, 2, 1, 3)
    q, k = rope(q, offset), rope(k, offset)            # non-traditional, base rope_base
    k_cache[:, :, offset:offset + L] = k; v_cache[:, :, offset:offset + L] = v (heads first)
    out = attention(q, k_cache[:, :, :offset + L], v_cache[:, :, :offset + L], causal)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, Hq * D)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from attn_kernels import _ext
from attn_kernels.attention import row_bounds


def _offsets(offset, batch: int, max_offset=None) -> tuple[int, mx.array | None]:
    """A step's `offset` as the op takes it: the write position of every row (an int), or per-row
    write positions (a sequence of ints, or an int32 (B,) array) with the largest of them, which
    bounds the attention's context. The largest of an array's values is `max_offset` where the
    caller gives it, else read from the array (an evaluation: a loop that must not wait for the
    device passes it, or a sequence)."""
    if max_offset is not None:
        if not isinstance(offset, mx.array):
            raise ValueError("[attention_step] max_offset goes with an array offset only")
        if isinstance(max_offset, bool) or not isinstance(max_offset, int | np.integer):
            raise ValueError(f"[attention_step] max_offset must be an int, got {max_offset!r}")
        if max_offset < 0:
            raise ValueError(f"[attention_step] max_offset must be >= 0, got {max_offset}")
    if isinstance(offset, int | np.integer):
        return int(offset), None
    if isinstance(offset, mx.array):
        offsets = offset
        if max_offset is not None:
            return int(max_offset), offsets
        largest = int(mx.max(offsets).item()) if offsets.size else 0
    else:
        offsets = row_bounds("offset", offset, batch)
        largest = max((int(x) for x in offset), default=0)
    return largest, offsets


def _ring_position(position) -> int:
    """attention_step's `position` as the op takes it: -1 for None (no ring), else an int >= 0."""
    if position is None:
        return -1
    if isinstance(position, bool) or not isinstance(position, int | np.integer):
        raise ValueError(f"[attention_step] position must be an int or None, got {position!r}")
    if position < 0:
        raise ValueError(f"[attention_step] position must be >= 0 (or None), got {position}")
    return int(position)


def _rope(op: str, rope_base, rope_freqs) -> tuple[float, list[float]]:
    """RoPE's frequencies as the ops take them: exactly one of rope_base and rope_freqs (the
    period of each pair, mx.fast.rope's `freqs`; an array is read to the host)."""
    if (rope_base is None) == (rope_freqs is None):
        raise ValueError(f"[{op}] pass exactly one of rope_base and rope_freqs")
    if rope_freqs is None:
        return float(rope_base), []
    if isinstance(rope_freqs, mx.array):
        if rope_freqs.ndim != 1:
            raise ValueError(f"[{op}] rope_freqs must be one-dimensional, got {rope_freqs.shape}")
        rope_freqs = rope_freqs.astype(mx.float32).tolist()
    return 0.0, [float(f) for f in rope_freqs]


def attention_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    q_norm_weight: mx.array | None,
    k_norm_weight: mx.array | None,
    k_cache: mx.array,
    v_cache: mx.array,
    offset: int | Sequence[int] | mx.array,
    *,
    starts: Sequence[int] | mx.array | None = None,
    max_offset: int | None = None,
    position: int | None = None,
    eps: float | None = None,
    rope_base: float | None = None,
    rope_freqs: Sequence[float] | mx.array | None = None,
    scale: float | None = None,
    schedule: str = "auto",
    owned_caches: bool = False,
    fold: bool | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Normalise, rotate, cache and attend in one `AttentionStep` primitive.

    Args:
        q: (B, L, Hq·D), k, v: (B, L, Hkv·D): the new tokens' projections as the linear layers
            lay them out; strided views (slices of one fused q/k/v projection) are read in place.
        q_norm_weight, k_norm_weight: (D,), the per-head RMSNorm weights (Qwen3); both None
            for a model without q/k norm (Llama, Qwen2): q and k are rotated as given.
        k_cache, v_cache: (B, Hkv, capacity, D), positions [0, offset) already written; D is
            their last size.
        offset: position of the first new token; offset + L <= capacity. Per batch row (rows of
            different lengths in one cache): a sequence of B ints or an int32 (B,) array, row b's
            tokens going to offsets[b] + i.
        max_offset: with an array `offset`, its largest value as the caller knows it (the
            attention's context, which the op is built with); without it the array is read back
            (an evaluation, which waits for the steps in flight). Not checked against the array:
            a smaller value clips the rows past it.
        starts: per batch row, its first valid cache position (int32 (B,) or a sequence; default
            0): mlx-lm's left padding. Row b attends to [starts[b], its offset + L) and rotates
            its tokens by RoPE at their position minus starts[b], as mlx-lm's batch caches count.
        position: for caches that are a full ring (a sliding window that has wrapped: mlx-lm's
            RotatingKVCache past its max_size, its keys out of temporal order), the new token's
            sequence position: it is written at slot `offset`, rotated by RoPE at `position`,
            and attends every position of the caches, as mlx-lm's unmasked call over the window
            does. One token (L = 1), an int offset, no starts; at least capacity - 1 (every slot
            written). None: the caches are in temporal order. RoPE stays float32 arithmetic as
            mx.fast.rope's: an angle's rounding grows with the position, in mlx-lm's own call as
            here (on the CPU the op's angles are the closer to exact ones: at position 10^6 off
            by up to 0.022 rad against mx.fast.rope's 0.042; float32 logits 0.02 apart at 10^5).
        eps: RMSNorm epsilon, needed with the norm weights (ignored without them).
        rope_base: RoPE base (non-traditional rotation, all D dims): the period of pair j is
            rope_base^(2j/D).
        rope_freqs: instead of rope_base, the period of each pair j < D/2, as mx.fast.rope's
            `freqs` takes them (the angle at position p is p / rope_freqs[j]): mlx-lm's
            Llama3RoPE `_freqs`, or rope_base^(2j/D) / scale for a RoPE with position scale.
            A sequence of floats, or an array (read to the host: an evaluation, so a decode
            loop passes a list it keeps). CPU and CUDA.
        scale: multiplier of the dot products (default 1/sqrt(D)).
        schedule: GPU attention schedule (as in `decode_attention_custom`).
        owned_caches: the caller's promise that no other array sharing the caches' memory (an
            evaluated view or slice of them) is read after this step at the positions it writes
            ([offset, offset + L); a ring's slot). Then a cache
            array that nothing else holds is updated in place even while an earlier step that
            read it is still running, which MLX's donation rule refuses (MLX holds the buffers of
            a step until it completes, so under pipelined generation, when the GPU is behind,
            the rule copies whole caches). A cache array the caller still holds is copied either
            way. A decode loop that keeps only the returned caches (qwen3_model's KVCache) passes
            True.
        fold: on CUDA, run the step as one kernel (the preprocessing inside the attention's
            blocks) where the attention plan is split-mma (bfloat16/float16, D 64 or 128; 80, 96,
            256 with schedule="split-mma"), L <= 8
            and both caches are updated in place; elsewhere, and with False, two kernels. None:
            the process default, on unless the environment variable ATTN_STEP_FOLD=0 (read once
            per process). The CPU and Metal ignore it. attention_step_folds() counts the steps
            that ran folded.

    Returns:
        (out, k_cache, v_cache): out (B, L, Hq·D) in q's dtype, causal attention over
        [0, offset + L) (a ring: over the whole caches); the caches with the new positions
        written. A cache buffer that nothing else references is updated in place (MLX's
        donation rule; see owned_caches); otherwise the op copies it (counted by
        attention_step_cache_copies). Use the returned caches from then on.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        given, missing = (
            ("q_norm_weight", "k_norm_weight")
            if k_norm_weight is None
            else ("k_norm_weight", "q_norm_weight")
        )
        raise ValueError(
            f"[attention_step] {missing} is None while {given} is not: pass both norm weights "
            "(q/k RMSNorm) or neither"
        )
    qk_norm = q_norm_weight is not None
    if qk_norm and eps is None:
        raise ValueError("[attention_step] eps is needed with the norm weights")
    if scale is None:
        scale = 1.0 / math.sqrt(k_cache.shape[-1])
    batch = q.shape[0] if q.ndim else 0
    offset, offsets = _offsets(offset, batch, max_offset)
    rope_base, rope_freqs = _rope("attention_step", rope_base, rope_freqs)
    out, k_cache, v_cache = _ext.attention_step(
        q,
        k,
        v,
        q_norm_weight,
        k_norm_weight,
        k_cache,
        v_cache,
        offset,
        float(eps) if qk_norm else 0.0,
        rope_base,
        float(scale),
        schedule,
        bool(owned_caches),
        None if fold is None else bool(fold),
        starts=row_bounds("starts", starts, batch),
        offsets=offsets,
        rope_freqs=rope_freqs,
        position=_ring_position(position),
        stream=stream,
    )
    return out, k_cache, v_cache


def attention_step_quantized(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    q_norm_weight: mx.array | None,
    k_norm_weight: mx.array | None,
    k_cache: tuple[mx.array, mx.array, mx.array],
    v_cache: tuple[mx.array, mx.array, mx.array],
    offset: int | Sequence[int] | mx.array,
    *,
    starts: Sequence[int] | mx.array | None = None,
    eps: float | None = None,
    rope_base: float | None = None,
    rope_freqs: Sequence[float] | mx.array | None = None,
    scale: float | None = None,
    group_size: int = 64,
    bits: int = 8,
    owned_caches: bool = False,
    stream: mx.Stream | mx.Device | None = None,
) -> tuple[mx.array, tuple[mx.array, ...], tuple[mx.array, ...]]:
    """`attention_step` over a quantized cache (mlx-lm's QuantizedKVCache layout), as one
    `AttentionStepQuantized` primitive on the CPU and CUDA.

    The chain it replaces is attention_step's with the cache write quantized:
    `k_cache[..., offset:offset + L, :] = mx.quantize(k, group_size, bits)` (each array of the
    triple; likewise v), then `decode_attention_quantized` over the first offset + L positions.

    Args:
        q, k, v, q_norm_weight, k_norm_weight, offset, starts, eps, rope_base, rope_freqs,
            scale, owned_caches: as in `attention_step`.
        k_cache, v_cache: (codes, scales, biases) as `mx.quantize` gives them: codes uint32
            (B, Hkv, capacity, D·bits/32), scales and biases (B, Hkv, capacity, D/group_size) in
            q's dtype, positions [0, offset) written. D must be a multiple of group_size (and
            of 64 on a GPU).
        group_size: 32, 64 or 128. bits: 4 or 8.

    The new keys (normalised, rotated, rounded to q's dtype) and values are quantized as
    `mx.quantize` does on the device that runs the step (MLX's CPU and CUDA kernels round ties
    differently), so the cache holds the codes the chain would write.

    Returns:
        (out, k_cache, v_cache): out (B, L, Hq·D); the triples with the new positions written, in
        place where MLX's donation rule (or owned_caches) allows, else copied.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(
            "[attention_step_quantized] pass both norm weights (q/k RMSNorm) or neither"
        )
    qk_norm = q_norm_weight is not None
    if qk_norm and eps is None:
        raise ValueError("[attention_step_quantized] eps is needed with the norm weights")
    if scale is None:
        head_dim = q_norm_weight.shape[0] if qk_norm else k_cache[0].shape[-1] * 32 // bits
        scale = 1.0 / math.sqrt(head_dim)
    batch = q.shape[0] if q.ndim else 0
    offset, offsets = _offsets(offset, batch)
    rope_base, rope_freqs = _rope("attention_step_quantized", rope_base, rope_freqs)
    out, *caches = _ext.attention_step_quantized(
        q,
        k,
        v,
        q_norm_weight,
        k_norm_weight,
        list(k_cache),
        list(v_cache),
        offset,
        float(eps) if qk_norm else 0.0,
        rope_base,
        float(scale),
        int(group_size),
        int(bits),
        bool(owned_caches),
        starts=row_bounds("starts", starts, batch),
        offsets=offsets,
        rope_freqs=rope_freqs,
        stream=stream,
    )
    return out, tuple(caches[:3]), tuple(caches[3:])


def attention_step_cache_copies() -> int:
    """Caches `attention_step` has copied so far in this process (0 in a donating decode loop)."""
    return _ext.attention_step_cache_copies()


def attention_step_folds() -> int:
    """`attention_step` calls that ran as one kernel (CUDA's fold) so far in this process."""
    return _ext.attention_step_folds()
