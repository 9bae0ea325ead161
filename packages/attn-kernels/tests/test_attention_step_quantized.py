"""attention_step_quantized (AttentionStepQuantized) against mx.quantize on the same device (the
new position's codes, scales and biases), a float64 step over the dequantized cache, and the
unfused chain (mx.fast RMSNorm and RoPE, mx.quantize, slice updates, decode_attention_quantized)."""

import itertools
import math
import re

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import attention_step_cache_copies, attention_step_quantized
from attn_kernels.quantized import decode_attention_quantized
from conftest import TOLERANCE
from reference import to_numpy
from step_reference import make_step as bf16_step
from step_reference import norm_rope_f64

EPS, BASE = 1e-6, 1_000_000.0  # Qwen3's
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _cuda_available() -> bool:
    return mx.cuda.is_available()


DEVICES = [
    pytest.param(mx.cpu, id="cpu"),
    pytest.param(
        mx.gpu,
        id="gpu",
        marks=pytest.mark.skipif(not _cuda_available(), reason="no CUDA GPU (no Metal kernel)"),
    ),
]


def make_step(seed, b, hq, hkv, length, d, capacity, dtype, bits, group_size):
    """test_attention_step's step (projections, norm weights near 1, caches full of earlier
    K/V), its caches quantized."""
    *inputs, old_k, old_v = bf16_step(seed, b, hq, hkv, length, d, capacity, dtype)
    caches = [
        mx.quantize(c, group_size=group_size, bits=bits, stream=mx.cpu) for c in (old_k, old_v)
    ]
    mx.eval(caches)
    return (*inputs, tuple(caches[0]), tuple(caches[1]))


def heads(x, d):
    b, length, _ = x.shape
    return x.reshape(b, length, -1, d).transpose(0, 2, 1, 3)


def chain_keys(k, k_w, offset, d, device):
    """The new keys as mlx-lm's Qwen3 forms them before its cache quantizes them."""
    b, length, _ = k.shape
    if k_w is not None:
        k = mx.fast.rms_norm(k.reshape(b, length, -1, d), k_w, EPS, stream=device).reshape(k.shape)
    return mx.fast.rope(
        heads(k, d), d, traditional=False, base=BASE, scale=1.0, offset=offset, stream=device
    )


def dequantize(triple, group_size, bits):
    codes, scales, biases = triple
    return to_numpy(
        mx.dequantize(
            codes,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=group_size,
            bits=bits,
            stream=mx.cpu,
        )
    )


def unpack(words, bits):
    """uint32 words -> their codes, lowest bits first (mx.quantize's packing)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)


def step_f64(q, q_w, k_cache, v_cache, offset, group_size, bits, d, scale):
    """float64: q normalised and rotated, causal attention over the dequantized caches' first
    offset + L positions (the codes the step wrote included)."""
    b, length, _ = q.shape
    qh = norm_rope_f64(q, q_w, offset, d, EPS, BASE).transpose(0, 2, 1, 3)
    end = offset + length
    kc = dequantize(k_cache, group_size, bits)[:, :, :end]
    vc = dequantize(v_cache, group_size, bits)[:, :, :end]
    group = qh.shape[1] // kc.shape[1]
    kc, vc = np.repeat(kc, group, axis=1), np.repeat(vc, group, axis=1)
    scores = np.einsum("bhld,bhsd->bhls", qh, kc) * scale
    keep = np.arange(end)[None, :] <= np.arange(offset, end)[:, None]
    scores = np.where(keep, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhls,bhsd->bhld", probs, vc).transpose(0, 2, 1, 3).reshape(b, length, -1)


def raw(a):
    """An array's values as NumPy holds them exactly (half-precision floats widened)."""
    return np.array(a if a.dtype == mx.uint32 else a.astype(mx.float32))


# Relative rounding of each dtype (half an ulp, doubled for margin).
ROUNDING = {mx.float32: 2.0**-23, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def run_step(inputs, offset, device, bits, group_size, owned_caches=False):
    q, k, v, q_w, k_w, k_cache, v_cache = inputs
    out, new_k, new_v = attention_step_quantized(
        q,
        k,
        v,
        q_w,
        k_w,
        k_cache,
        v_cache,
        offset,
        eps=EPS,
        rope_base=BASE,
        group_size=group_size,
        bits=bits,
        owned_caches=owned_caches,
        stream=device,
    )
    mx.eval(out, new_k, new_v)
    return out, new_k, new_v


def check_step(inputs, offset, device, bits, group_size, label):
    q, k, v, q_w, k_w, k_cache, v_cache = inputs
    d = q_w.shape[0] if q_w is not None else k_cache[0].shape[-1] * 32 // bits
    length, dtype = q.shape[1], q.dtype
    before = [raw(a) for a in (*k_cache, *v_cache)]
    out, new_k, new_v = run_step(inputs, offset, device, bits, group_size)
    end = offset + length
    assert out.shape == q.shape and out.dtype == dtype
    # The new values exactly as mx.quantize writes them on this device.
    expected = mx.quantize(heads(v, d), group_size=group_size, bits=bits, stream=device)
    for part, got, want in zip(("codes", "scales", "biases"), new_v, expected, strict=True):
        np.testing.assert_array_equal(
            raw(got[:, :, offset:end]), raw(want), err_msg=f"{label} new values' {part}"
        )
    # The new keys: their normalised, rotated values in the dtype are the chain's but for an
    # occasional last bit (which can move a group's extremes and so its scale), so they are held
    # to float64 instead: within mx.quantize's own error, half a step plus the one code its
    # snapped scale can clamp off the far end of the range (the snap moves the scale by at most
    # half a code in |edge / scale| >= (2^bits - 1) / 2), plus the roundings of the scale, the
    # bias and the key itself to the dtype.
    codes = unpack(raw(new_k[0][:, :, offset:end]), bits).reshape(
        *new_k[0][:, :, offset:end].shape[:3], d
    )
    scales = np.repeat(raw(new_k[1][:, :, offset:end]), group_size, axis=-1)
    biases = np.repeat(raw(new_k[2][:, :, offset:end]), group_size, axis=-1)
    exact = norm_rope_f64(k, k_w, offset, d, EPS, BASE).transpose(0, 2, 1, 3)
    eps = ROUNDING[dtype]
    bound = 1.5 * np.abs(scales) + eps * (
        codes * np.abs(scales) + np.abs(biases) + 2 * np.abs(exact)
    )
    error = np.abs(codes * scales + biases - exact)
    assert np.all(error <= 1.01 * bound + 1e-6), f"{label} new keys: {np.max(error / bound):.3f}"
    # Every other position untouched.
    for g, b in zip((*new_k, *new_v), before, strict=True):
        g = raw(g)
        np.testing.assert_array_equal(g[:, :, :offset], b[:, :, :offset], err_msg=label)
        np.testing.assert_array_equal(g[:, :, end:], b[:, :, end:], err_msg=label)
    scale = 1.0 / math.sqrt(d)
    expected = step_f64(q, q_w, new_k, new_v, offset, group_size, bits, d, scale)
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(to_numpy(out), expected, **tol, err_msg=label + " vs float64")
    # The unfused chain over the same codes (decode_attention_quantized of the updated caches).
    qh = chain_keys(q, q_w, offset, d, device)
    chain = decode_attention_quantized(
        qh,
        tuple(a[:, :, :end] for a in new_k),
        tuple(a[:, :, :end] for a in new_v),
        mask="causal",
        group_size=group_size,
        bits=bits,
        stream=device,
    )
    chain = chain.transpose(0, 2, 1, 3).reshape(q.shape)
    np.testing.assert_allclose(to_numpy(out), to_numpy(chain), **tol, err_msg=label + " vs chain")


GRID = [
    (dtype, bits, group_size, heads_, length, offset)
    for dtype, (bits, group_size), heads_, length, offset in itertools.product(
        DTYPES,
        [(4, 64), (8, 64), (4, 32), (8, 128)],
        [(8, 2), (32, 8)],
        [1, 3],
        [0, 100, 255],
    )
    if offset + length <= 258
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,bits,group_size,heads_,length,offset",
    GRID,
    ids=[
        f"{str(t).split('.')[-1]}-b{b}-g{g}-hq{h[0]}-hkv{h[1]}-L{n}-o{o}"
        for t, b, g, h, n, o in GRID
    ],
)
def test_matches_quantize_and_float64(device, dtype, bits, group_size, heads_, length, offset):
    hq, hkv = heads_
    capacity = -(-(offset + length) // 256) * 256
    inputs = make_step(
        offset + 7 * bits + group_size, 1, hq, hkv, length, 128, capacity, dtype, bits, group_size
    )
    check_step(
        inputs,
        offset,
        device,
        bits,
        group_size,
        f"{dtype} bits {bits} group {group_size} Hq={hq} Hkv={hkv} L={length} o={offset}",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_without_norms_first_position_is_mx_quantize(device, bits, group_size):
    """Without norms at position 0 RoPE is the identity: the new keys' triple must be
    mx.quantize's exactly, as the values' are."""
    q, k, v, _, _, k_cache, v_cache = make_step(
        5, 2, 8, 2, 1, 64, 256, mx.bfloat16, bits, group_size
    )
    inputs = (q, k, v, None, None, k_cache, v_cache)
    _, new_k, _ = run_step(inputs, 0, device, bits, group_size)
    expected = mx.quantize(heads(k, 64), group_size=group_size, bits=bits, stream=device)
    for g, w in zip(new_k, expected, strict=True):
        np.testing.assert_array_equal(raw(g[:, :, :1]), raw(w))
    check_step(inputs, 0, device, bits, group_size, "no norms, B=2, D=64")


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_256_and_batch(device):
    inputs = make_step(11, 2, 4, 2, 2, 256, 512, mx.bfloat16, 4, 128)
    check_step(inputs, 300, device, 4, 128, "D=256 B=2")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("heads_,length,offset", [((32, 32), 1, 100), ((8, 2), 3, 254)])
def test_head_dim_96_on_the_cpu(bits, heads_, length, offset):
    """D 96 (Phi-3's, Mistral-7B's; group 32, the one that divides it) on the CPU, without GQA
    and across position 256: the new positions as mx.quantize's, attention as float64's
    and the unfused chain's."""
    hq, hkv = heads_
    inputs = make_step(13 + bits, 1, hq, hkv, length, 96, 512, mx.bfloat16, bits, 32)
    check_step(inputs, offset, mx.cpu, bits, 32, f"D=96 bits {bits} Hq={hq} Hkv={hkv}")


@pytest.mark.skipif(not _cuda_available(), reason="no CUDA GPU")
def test_head_dim_96_refused_on_a_gpu():
    inputs = make_step(3, 1, 8, 2, 1, 96, 256, mx.bfloat16, 8, 32)
    with pytest.raises(ValueError, match="on a GPU, of 64, got 96"):
        run_step(inputs, 0, mx.gpu, 8, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_periods(device):
    """rope_freqs (each pair's period) set to the base's own periods gives what rope_base gives
    (attention_step's tests hold rope_freqs against mx.fast.rope's freqs)."""
    d = 128
    q, k, v, q_w, k_w, k_cache, v_cache = make_step(5, 1, 8, 2, 2, d, 512, mx.bfloat16, 4, 64)
    periods = [BASE ** (2 * j / d) for j in range(d // 2)]
    outs = []
    for rope in (dict(rope_base=BASE), dict(rope_freqs=periods)):
        out, keys, _ = attention_step_quantized(
            q, k, v, q_w, k_w, k_cache, v_cache, 300, eps=EPS, group_size=64, bits=4,
            stream=device, **rope,
        )  # fmt: skip
        outs.append((raw(out), raw(keys[0])[:, :, 300:302]))
    np.testing.assert_allclose(outs[1][0], outs[0][0], **TOLERANCE[mx.bfloat16])
    # the codes of the new keys: equal but where a rounding moved one by a step
    assert np.mean(outs[1][1] == outs[0][1]) > 0.95


@pytest.mark.parametrize("device", DEVICES)
def test_decode_loop_donates(device):
    """A loop that keeps only the returned triples updates them in place: no copies."""
    inputs = make_step(3, 1, 8, 2, 1, 128, 256, mx.bfloat16, 4, 64)
    q, k, v, q_w, k_w, k_cache, v_cache = inputs
    del inputs
    copies = attention_step_cache_copies()
    for offset in range(20, 24):
        out, k_cache, v_cache = attention_step_quantized(
            q,
            k,
            v,
            q_w,
            k_w,
            k_cache,
            v_cache,
            offset,
            eps=EPS,
            rope_base=BASE,
            group_size=64,
            bits=4,
            owned_caches=True,
            stream=device,
        )
        mx.eval(out, k_cache, v_cache)
    assert attention_step_cache_copies() == copies


BAD = [
    (lambda a: {**a, "bits": 3}, "bits must be 4 or 8, got 3"),
    (lambda a: {**a, "group_size": 48}, "group_size must be 32, 64 or 128, got 48"),
    (lambda a: {**a, "k_cache": a["k_cache"][:2]}, "k_cache must be a (codes, scales, biases)"),
    (
        lambda a: {**a, "v_cache": (a["v_cache"][0][:, :1], *a["v_cache"][1:])},
        "k_cache and v_cache must have the same shapes",
    ),
    (
        lambda a: {**a, "k_cache": (a["k_cache"][0].astype(mx.int32), *a["k_cache"][1:])},
        "k_cache's codes must be uint32",
    ),
    (
        lambda a: {**a, "bits": 8, "k_cache": a["k_cache"], "v_cache": a["v_cache"]},
        "the caches' head_dim 64 differs from the norm weights' 128",
    ),
    (lambda a: {**a, "group_size": 32}, "(were they quantized with another group_size?)"),
    (
        lambda a: {
            **a,
            "k_cache": (a["k_cache"][0], a["k_cache"][1].astype(mx.float16), a["k_cache"][2]),
        },
        "k_cache's scales must have q's dtype",
    ),
    (lambda a: {**a, "offset": 256}, "offset + length must fit the caches"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_inputs(change, message):
    q, k, v, q_w, k_w, k_cache, v_cache = make_step(1, 1, 8, 2, 1, 128, 256, mx.bfloat16, 4, 64)
    args = dict(
        q=q,
        k=k,
        v=v,
        q_norm_weight=q_w,
        k_norm_weight=k_w,
        k_cache=k_cache,
        v_cache=v_cache,
        offset=10,
        group_size=64,
        bits=4,
    )
    args = change(args)
    with pytest.raises(ValueError, match=r"\[attention_step_quantized\].*" + re.escape(message)):
        attention_step_quantized(**args, eps=EPS, rope_base=BASE)
