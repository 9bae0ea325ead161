"""Two oracles of the fused attention step: the unfused MLX chain (mx.fast RMSNorm and RoPE, a
slice update, decode_attention_custom) and a float64 NumPy step written independently."""

import math

import mlx.core as mx
import numpy as np
from attn_kernels import decode_attention_custom
from reference import to_numpy


def make_step(seed, b, hq, hkv, length, d, capacity, dtype):
    """New tokens' projections, norm weights near 1, caches full of earlier (random) K/V."""
    keys = mx.random.split(mx.random.key(seed), 7)
    q = mx.random.normal((b, length, hq * d), key=keys[0]).astype(dtype)
    k = (2.0 * mx.random.normal((b, length, hkv * d), key=keys[1])).astype(dtype)
    v = mx.random.normal((b, length, hkv * d), key=keys[2]).astype(dtype)
    q_w = (1.0 + 0.2 * mx.random.normal((d,), key=keys[3])).astype(dtype)
    k_w = (1.0 + 0.2 * mx.random.normal((d,), key=keys[4])).astype(dtype)
    # Earlier positions: unit-norm-ish keys as the model's normalised, rotated keys are.
    k_cache = mx.random.normal((b, hkv, capacity, d), key=keys[5]).astype(dtype)
    v_cache = mx.random.normal((b, hkv, capacity, d), key=keys[6]).astype(dtype)
    mx.eval(q, k, v, q_w, k_w, k_cache, v_cache)
    return q, k, v, q_w, k_w, k_cache, v_cache


def rope_kwargs(base) -> dict:
    """mx.fast.rope's frequency arguments for `base`: a RoPE base, or the period of each pair
    (a sequence: the op's rope_freqs)."""
    if isinstance(base, int | float):
        return dict(base=base)
    return dict(base=None, freqs=mx.array(base, dtype=mx.float32))


def unfused_step(q, k, v, q_w, k_w, k_cache, v_cache, offset, eps, base, scale=None):
    """The op sequence the fused step replaces, as mlx-lm's Qwen3 runs it (q_w, k_w None: as
    its Llama and Qwen2 run it, no q/k norm). base: the RoPE base or the periods (rope_kwargs)."""
    b, length, _ = q.shape
    d = k_cache.shape[-1]

    def heads(x):
        return x.reshape(b, length, -1, d).transpose(0, 2, 1, 3)

    def norm(x, w):
        return x if w is None else mx.fast.rms_norm(x.reshape(b, length, -1, d), w, eps)

    qh = mx.fast.rope(
        heads(norm(q, q_w).reshape(q.shape)),
        d,
        traditional=False,
        scale=1.0,
        **rope_kwargs(base),
        offset=offset,
    )
    kh = mx.fast.rope(
        heads(norm(k, k_w).reshape(k.shape)),
        d,
        traditional=False,
        scale=1.0,
        **rope_kwargs(base),
        offset=offset,
    )
    k_cache = mx.array(k_cache)
    v_cache = mx.array(v_cache)
    k_cache[:, :, offset : offset + length, :] = kh
    v_cache[:, :, offset : offset + length, :] = heads(v)
    end = offset + length
    out = decode_attention_custom(
        qh, k_cache[:, :, :end], v_cache[:, :, :end], scale=scale, mask="causal"
    )
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1), k_cache, v_cache


def rope_angles(positions, d, base):
    """(len(positions), D/2) angles as MLX computes them (base: the RoPE base, or the periods
    as rope_kwargs takes them): float32 inverse frequencies and
    float32 products (the rotation itself in float64). The inverse frequencies are the float32
    power rounded once (taken in float64): NumPy's float32 exp2 is not correctly rounded (on
    AVX-512 it missed by an ulp in 6-18 of 32-64 pairs), which at position 131072 moves an
    angle by up to 0.008."""
    half = d // 2
    if isinstance(base, int | float):
        frac = np.arange(half, dtype=np.float32) / np.float32(half)
        exponent = -frac * np.float32(math.log2(base))
        inv = np.exp2(exponent.astype(np.float64)).astype(np.float32)
    else:  # the period of each pair, as mx.fast.rope's freqs: their float32 reciprocals
        inv = np.float32(1) / np.asarray(base, dtype=np.float32)
    return (np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)


def norm_rope_f64(x, w, offset, d, eps, base):
    """float64 per-head RMSNorm (none where w is None) and RoPE (dimension j pairs with
    j + D/2) of new tokens x (B, L, H·D) at positions offset...: (B, L, H, D)."""
    b, length, _ = x.shape
    half = d // 2
    theta = rope_angles(np.arange(offset, offset + length), d, base)  # (L, D/2)
    cos, sin = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    x = to_numpy(x).reshape(b, length, -1, d)
    if w is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * to_numpy(w)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def step_f64(q, k, v, q_w, k_w, k_cache, v_cache, offset, eps, base, scale=None):
    """float64: per-head RMSNorm (none where q_w, k_w are None), RoPE (dimension j pairs with
    j + D/2), cache write, causal grouped attention over [0, offset + L). Returns
    (out (B, L, Hq·D), k_cache, v_cache)."""
    b, length, _ = q.shape
    d = k_cache.shape[-1]
    qh = norm_rope_f64(q, q_w, offset, d, eps, base).transpose(0, 2, 1, 3)  # (B, Hq, L, D)
    kh = norm_rope_f64(k, k_w, offset, d, eps, base).transpose(0, 2, 1, 3)
    vh = to_numpy(v).reshape(b, length, -1, d).transpose(0, 2, 1, 3)
    kc, vc = to_numpy(k_cache).copy(), to_numpy(v_cache).copy()
    kc[:, :, offset : offset + length] = kh
    vc[:, :, offset : offset + length] = vh
    end = offset + length
    hq, hkv = qh.shape[1], kc.shape[1]
    keys = np.repeat(kc[:, :, :end], hq // hkv, axis=1)
    values = np.repeat(vc[:, :, :end], hq // hkv, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = np.einsum("bhld,bhsd->bhls", qh, keys) * scale
    keep = np.arange(end)[None, :] <= np.arange(offset, end)[:, None]
    scores = np.where(keep, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhls,bhsd->bhld", probs, values)
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1), kc, vc


def ragged_step_f64(q, k, v, q_w, k_w, k_cache, v_cache, starts, offsets, eps, base, scale=None):
    """step_f64 with a range per batch row, as mlx-lm's batch caches and per-row offsets lay it
    out: row b's tokens go to cache positions offsets[b] + i, are rotated at offsets[b] - starts[b]
    + i (positions counted from the row's start) and attend causally to [starts[b], offsets[b] +
    L). Returns (out (B, L, Hq·D), k_cache, v_cache) as float64."""
    b, length, _ = q.shape
    d = k_cache.shape[-1]
    kc, vc = to_numpy(k_cache).copy(), to_numpy(v_cache).copy()
    hq, hkv = q.shape[-1] // d, kc.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, length, hq * d))
    for r in range(b):
        first, at = int(starts[r]), int(offsets[r])
        position = at - first
        qh = norm_rope_f64(q[r : r + 1], q_w, position, d, eps, base)[0].transpose(1, 0, 2)
        kh = norm_rope_f64(k[r : r + 1], k_w, position, d, eps, base)[0].transpose(1, 0, 2)
        vh = to_numpy(v[r : r + 1]).reshape(length, hkv, d).transpose(1, 0, 2)
        kc[r, :, at : at + length] = kh
        vc[r, :, at : at + length] = vh
        keys = np.repeat(kc[r, :, first : at + length], hq // hkv, axis=0)
        values = np.repeat(vc[r, :, first : at + length], hq // hkv, axis=0)
        scores = np.einsum("hld,hsd->hls", qh, keys) * scale
        j = np.arange(first, at + length)[None, :]
        keep = j <= np.arange(at, at + length)[:, None]
        scores = np.where(keep, scores, -np.inf)
        with np.errstate(invalid="ignore"):
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
        rows = np.einsum("hls,hsd->hld", np.nan_to_num(probs), values)
        out[r] = rows.transpose(1, 0, 2).reshape(length, hq * d)
    return out, kc, vc


def ring_step_f64(q, k, v, q_w, k_w, k_cache, v_cache, slot, position, eps, base, scale=None):
    """step_f64 over a full ring (a sliding window that has wrapped): the one new token is
    rotated at its sequence `position`, written at `slot`, and attends every position of the
    caches, whatever their order. Returns (out (B, 1, Hq·D), k_cache, v_cache) as float64."""
    b, length, _ = q.shape
    assert length == 1
    d = k_cache.shape[-1]
    qh = norm_rope_f64(q, q_w, position, d, eps, base).transpose(0, 2, 1, 3)  # (B, Hq, 1, D)
    kh = norm_rope_f64(k, k_w, position, d, eps, base).transpose(0, 2, 1, 3)
    vh = to_numpy(v).reshape(b, 1, -1, d).transpose(0, 2, 1, 3)
    kc, vc = to_numpy(k_cache).copy(), to_numpy(v_cache).copy()
    kc[:, :, slot : slot + 1] = kh
    vc[:, :, slot : slot + 1] = vh
    hq, hkv = qh.shape[1], kc.shape[1]
    keys = np.repeat(kc, hq // hkv, axis=1)
    values = np.repeat(vc, hq // hkv, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = np.einsum("bhld,bhsd->bhls", qh, keys) * scale
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhls,bhsd->bhld", probs, values)
    return out.transpose(0, 2, 1, 3).reshape(b, 1, -1), kc, vc
