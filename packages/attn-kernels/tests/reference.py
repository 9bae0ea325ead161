"""A float64 NumPy attention written independently of the package (np.repeat for GQA)."""

import mlx.core as mx
import numpy as np


def to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def attention_f64(q, k, v, scale=None, mask=None) -> np.ndarray:
    """q (B, Hq, L, D), k/v (B, Hkv, S, D) as mx arrays; mask None | "causal" | mx array."""
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    _, hq, length, d = q.shape
    s_len = k.shape[2]
    group = hq // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    scores = np.einsum("bhld,bhsd->bhls", q, k) * scale
    if isinstance(mask, str):
        keep = np.arange(s_len)[None, :] <= np.arange(s_len - length, s_len)[:, None]
        scores = np.where(keep, scores, -np.inf)
    elif mask is not None:
        m = np.array(mask) if mask.dtype == mx.bool_ else to_numpy(mask)
        m = np.broadcast_to(m, scores.shape)
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m
    row_max = scores.max(axis=-1, keepdims=True)
    empty = np.isneginf(row_max)  # every key removed: defined as a zero row
    with np.errstate(invalid="ignore"):  # NaN and inf inputs: IEEE arithmetic, NaN rows
        weights = np.exp(scores - np.where(empty, 0.0, row_max))
        total = weights.sum(axis=-1, keepdims=True)
        probs = np.where(empty, 0.0, weights / np.where(empty, 1.0, total))
    return np.einsum("bhls,bhsd->bhld", probs, v)


def assert_matches_nonfinite(out: np.ndarray, expected: np.ndarray, err_msg="", **tol) -> None:
    """NaN where `expected` is NaN, the same infinities, and the finite rest within `tol`."""
    for what, test in [("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)]:
        np.testing.assert_array_equal(test(out), test(expected), err_msg=f"{err_msg} {what}")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[finite], expected[finite], err_msg=err_msg, **tol)
