"""mx.quantize's affine quantization transcribed to NumPy float32, per backend (MLX 0.32's
mlx/backend/cpu/quantized.cpp and mlx/backend/cuda/quantized/affine_quantize.cu): the same formula;
the CPU starts a group's maximum at -inf and rounds half to even, the CUDA kernel starts it at 0
and rounds half away from zero. The oracle of the quantized step's CUDA kernel under emulation
(the CPU rule is checked against mx.quantize itself, which runs here)."""

import numpy as np


def _round(x: np.ndarray, rule: str) -> np.ndarray:
    if rule == "cpu":
        return np.rint(x)
    wide = x.astype(np.float64)  # floor(|x| + 0.5) exactly
    return (np.sign(wide) * np.floor(np.abs(wide) + 0.5)).astype(np.float32)


def mlx_quantize(w: np.ndarray, group_size: int, bits: int, rule: str):
    """(codes uint32 (..., D·bits/32), scales, biases float32 (..., D/group_size)) of float32
    rows w (..., D), scales and biases before their rounding to the cache dtype."""
    w = np.asarray(w, dtype=np.float32)
    g = w.reshape(*w.shape[:-1], -1, group_size)
    n_bins = np.float32(2**bits - 1)
    w_min = g.min(axis=-1)
    w_max = g.max(axis=-1)
    if rule == "cuda":
        w_max = np.maximum(w_max, np.float32(0))
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    min_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.where(min_edge, scale, -scale)
    edge = np.where(min_edge, w_min, w_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        q0 = _round(edge / scale, rule)
        at_zero = q0 == 0
        scale = np.where(at_zero, scale, edge / np.where(at_zero, np.float32(1), q0))
    bias = np.where(at_zero, np.float32(0), edge)
    codes = _round((g - bias[..., None]) / scale[..., None], rule)
    codes = np.clip(codes, 0, n_bins).astype(np.uint32).reshape(*w.shape[:-1], -1, 32 // bits)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    words = np.bitwise_or.reduce(codes << shifts, axis=-1)
    return words.astype(np.uint32), scale.astype(np.float32), bias.astype(np.float32)
