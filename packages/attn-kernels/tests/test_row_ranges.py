"""Per-row cache ranges (starts, ends; a step's per-row offsets) in every fused op, against the
float64 reference with the mask they stand for (range_mask): batches of 1 to 64 rows of ragged
lengths (empty rows included), GQA 1/4/8, L 1-8, on every backend here and every GPU schedule."""

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import (
    attention_step,
    attention_step_quantized,
    decode_attention_custom,
    decode_attention_quantized,
    range_mask,
    scaled_dot_product_attention,
)
from conftest import TOLERANCE
from reference import attention_f64, to_numpy
from step_reference import make_step, ragged_step_f64
from test_decode_attention import DEVICES, schedules

EPS, BASE = 1e-6, 10000.0


def ragged_ranges(rng, batch, context, length):
    """Starts and ends of `batch` rows in a cache of `context` positions: ragged; where there are
    several rows, one the whole cache, one empty (zeros) and one shorter than L (causal: its
    first queries see nothing, zeros too)."""
    starts = rng.integers(0, context // 2, batch)
    ends = rng.integers(context // 2, context + 1, batch)
    if batch > 1:
        starts[0], ends[0] = 0, context
        starts[1] = ends[1] = rng.integers(0, context)
    if batch > 2:
        ends[2] = starts[2] + max(length - 1, 0)
    return starts.astype(np.int32), ends.astype(np.int32)


# (batch, Hq, Hkv, L, S, D): GQA 1, 4 and 8, L 1-8, B up to 64, S and D not multiples of 32
CASES = [
    (1, 8, 8, 1, 45, 64),
    (3, 8, 2, 1, 300, 128),
    (5, 32, 4, 3, 77, 80),
    (17, 16, 2, 8, 130, 64),
    (64, 8, 1, 2, 37, 32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("b", "hq", "hkv", "length", "s", "d"), CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_ranges_match_the_mask(device, b, hq, hkv, length, s, d, causal):
    rng = np.random.default_rng(b * 31 + s + length)
    starts, ends = ragged_ranges(rng, b, s, length)
    keys = mx.random.split(mx.random.key(b + s), 3)
    q = mx.random.normal((b, hq, length, d), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((b, hkv, s + 9, d), key=keys[1]).astype(mx.bfloat16)[:, :, :s]
    v = mx.random.normal((b, hkv, s + 9, d), key=keys[2]).astype(mx.bfloat16)[:, :, :s]
    mask = "causal" if causal else None
    keep = range_mask(b, length, s, mx.array(starts), mx.array(ends), causal)
    expected = attention_f64(q, k, v, mask=keep)
    tol = {key: 2 * x for key, x in TOLERANCE[mx.bfloat16].items()}
    with mx.stream(device):
        readable = scaled_dot_product_attention(q, k, v, mask=mask, starts=starts, ends=ends)
        fused = {
            name: decode_attention_custom(
                q, k, v, mask=mask, starts=mx.array(starts), ends=mx.array(ends), schedule=name
            )
            for name in schedules(device)
        }
    np.testing.assert_allclose(to_numpy(readable), expected, **tol, err_msg="readable")
    for name, out in fused.items():
        got = to_numpy(out)
        np.testing.assert_allclose(got, expected, **tol, err_msg=name)
        if b > 1:
            assert not got[1].any(), name  # an empty range: zeros


@pytest.mark.parametrize("device", DEVICES)
def test_ranges_and_a_mask_combine(device):
    b, hq, hkv, length, s, d = 3, 8, 2, 2, 70, 64
    rng = np.random.default_rng(5)
    q = mx.random.normal((b, hq, length, d))
    k, v = mx.random.normal((b, hkv, s, d)), mx.random.normal((b, hkv, s, d))
    mask = mx.array(rng.random((b, 1, length, s)) < 0.7)
    starts, ends = [3, 0, 40], [70, 21, 41]
    keep = range_mask(b, length, s, mx.array(starts), mx.array(ends), False) & mask
    expected = attention_f64(q, k, v, mask=keep)
    with mx.stream(device):
        out = decode_attention_custom(q, k, v, mask=mask, starts=starts, ends=ends)
    np.testing.assert_allclose(to_numpy(out), expected, **TOLERANCE[mx.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("b", "length", "bits"), [(1, 1, 8), (7, 1, 4), (33, 3, 8)])
def test_quantized_ranges_match_the_mask(device, b, length, bits):
    hq, hkv, s, d, group_size = 16, 4, 160, 128, 64
    rng = np.random.default_rng(b + bits)
    starts, ends = ragged_ranges(rng, b, s, length)
    keys = mx.random.split(mx.random.key(b), 3)
    q = mx.random.normal((b, hq, length, d), key=keys[0]).astype(mx.float16)
    triples = [
        mx.quantize(mx.random.normal((b, hkv, s, d), key=key).astype(mx.float16), group_size, bits)
        for key in keys[1:]
    ]
    k, v = (mx.dequantize(*t, group_size, bits) for t in triples)
    expected = attention_f64(q, k, v, mask=range_mask(b, length, s, mx.array(starts),
                                                      mx.array(ends), True))  # fmt: skip
    with mx.stream(device):
        out = decode_attention_quantized(
            q, *triples, mask="causal", starts=starts, ends=ends, group_size=group_size, bits=bits
        )
    got = to_numpy(out)
    np.testing.assert_allclose(got, expected, atol=8e-3, rtol=8e-3)


# (batch, Hq, Hkv, L, D, layout): "shared": mlx-lm's batch cache (one write position, a start per
# row: left padding); "ragged": a write position per row (rows of different lengths), starts 0;
# "both".
STEP_CASES = [
    (4, 8, 2, 1, 128, "shared"),
    (6, 16, 2, 1, 64, "ragged"),
    (3, 32, 4, 4, 128, "both"),
    (64, 8, 1, 1, 64, "ragged"),
    (5, 8, 8, 8, 64, "both"),
]


def step_layout(rng, b, length, layout, capacity):
    offsets = rng.integers(length, capacity - length, b)
    if layout == "shared":
        offsets[:] = offsets.max()
    starts = np.zeros(b, np.int64) if layout == "ragged" else rng.integers(0, offsets + 1)
    return starts.astype(np.int32), offsets.astype(np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("b", "hq", "hkv", "length", "d", "layout"), STEP_CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_step_ranges_match_the_reference(device, b, hq, hkv, length, d, layout, dtype):
    capacity = 300
    rng = np.random.default_rng(b * 7 + d + length)
    starts, offsets = step_layout(rng, b, length, layout, capacity)
    inputs = make_step(b + d, b, hq, hkv, length, d, capacity, dtype)
    offset = int(offsets[0]) if layout == "shared" else list(offsets)
    with mx.stream(device):
        out, new_k, new_v = attention_step(
            *inputs,
            offset,
            starts=None if layout == "ragged" else mx.array(starts),
            eps=EPS,
            rope_base=BASE,
        )
        mx.eval(out, new_k, new_v)
    expected, exp_k, exp_v = ragged_step_f64(*inputs, starts, offsets, EPS, BASE)
    tol = {key: 2 * x for key, x in TOLERANCE[dtype].items()}
    key_tol = dict(atol=2e-4, rtol=2e-4) if dtype == mx.float32 else TOLERANCE[dtype]
    np.testing.assert_allclose(to_numpy(out), expected, **tol)
    got_k, got_v = to_numpy(new_k), to_numpy(new_v)
    before_k, before_v = to_numpy(inputs[5]), to_numpy(inputs[6])
    for r in range(b):  # each row's new positions at its own place, every other position intact
        at = slice(int(offsets[r]), int(offsets[r]) + length)
        np.testing.assert_allclose(got_k[r, :, at], exp_k[r, :, at], **key_tol, err_msg=str(r))
        np.testing.assert_array_equal(got_v[r, :, at], exp_v[r, :, at])
        got_k[r, :, at], got_v[r, :, at] = before_k[r, :, at], before_v[r, :, at]
    np.testing.assert_array_equal(got_k, before_k)
    np.testing.assert_array_equal(got_v, before_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clipped", [False, True], ids=["exact", "row-past-max"])
def test_step_offsets_array_with_max_offset(device, clipped):
    """Per-row offsets as an array still to be computed (a decode loop's, advanced on the device)
    with their largest given as max_offset: no read-back, the rows written and attended as with
    the list. A row past max_offset (the caller's mistake the op cannot see) writes at
    max_offset, inside the caches, as the reference with that row clipped."""
    b, hq, hkv, length, d, capacity = 5, 8, 2, 2, 64, 90
    rng = np.random.default_rng(11)
    _, offsets = step_layout(rng, b, length, "ragged", capacity)
    largest = int(offsets.max())
    given = offsets.copy()
    if clipped:
        given[1] = largest + 7  # past the largest the op is built with
    inputs = make_step(3, b, hq, hkv, length, d, capacity, mx.float32)
    lazy = mx.array(given) + mx.zeros((b,), mx.int32)  # unevaluated: the op cannot check it
    with mx.stream(device):
        out, new_k, new_v = attention_step(
            *inputs, lazy, max_offset=largest, eps=EPS, rope_base=BASE
        )
        mx.eval(out, new_k, new_v)
    written = np.minimum(given, largest).astype(np.int32)
    expected, exp_k, exp_v = ragged_step_f64(*inputs, np.zeros(b, np.int32), written, EPS, BASE)
    np.testing.assert_allclose(to_numpy(out), expected, **TOLERANCE[mx.float32])
    np.testing.assert_allclose(to_numpy(new_k), exp_k, atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(to_numpy(new_v), exp_v)


@pytest.mark.parametrize(
    ("offset", "max_offset", "message"),
    [
        (3, 3, "max_offset goes with an array offset only"),
        ([3, 4], 4, "max_offset goes with an array offset only"),
        (mx.array([3, 4]), -1, "max_offset must be >= 0, got -1"),
        (mx.array([3, 4]), 4.0, "max_offset must be an int, got 4.0"),
    ],
)
def test_bad_max_offset_names_the_argument(offset, max_offset, message):
    q, k, v = mx.zeros((2, 1, 4 * 64)), mx.zeros((2, 1, 2 * 64)), mx.zeros((2, 1, 2 * 64))
    cache = mx.zeros((2, 2, 40, 64))
    with pytest.raises(ValueError, match=message):
        attention_step(q, k, v, None, None, cache, cache, offset, max_offset=max_offset,
                       rope_base=BASE)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["shared", "ragged"])
def test_quantized_step_ranges_match_the_reference(device, layout):
    if device == mx.gpu and not mx.cuda.is_available():
        pytest.skip("no Metal kernel for the quantized step")
    b, hq, hkv, length, d, capacity, bits, group_size = 5, 16, 4, 1, 128, 200, 8, 64
    rng = np.random.default_rng(9)
    starts, offsets = step_layout(rng, b, length, layout, capacity)
    q, k, v, q_w, k_w, kc, vc = make_step(3, b, hq, hkv, length, d, capacity, mx.float16)
    triples = [mx.quantize(x, group_size, bits) for x in (kc, vc)]
    with mx.stream(device):
        out, _, _ = attention_step_quantized(
            q, k, v, q_w, k_w, *triples,
            int(offsets[0]) if layout == "shared" else list(offsets),
            starts=None if layout == "ragged" else starts,
            eps=EPS, rope_base=BASE, group_size=group_size, bits=bits,
        )  # fmt: skip
    # The reference over the dequantised caches, with the new positions quantized as the step
    # does (the rows as the dtype holds them, then mx.quantize: its error is the reference's).
    plain = [mx.dequantize(*t, group_size, bits) for t in triples]
    expected, _, _ = ragged_step_f64(q, k, v, q_w, k_w, *plain, starts, offsets, EPS, BASE)
    np.testing.assert_allclose(to_numpy(out), expected, atol=3e-2, rtol=3e-2)


# (arguments changed from a good call, the message naming the argument)
BAD_RANGES = [
    (dict(starts=[0, -1]), r"starts\[1\] = -1 is outside \[0, 40\]"),
    (dict(ends=[41, 3]), r"ends\[0\] = 41 is outside \[0, 40\]"),
    (dict(starts=[0, 0, 0]), r"starts must have one value per batch row \(2\), got 3"),
    (dict(starts=mx.array([0, 1], mx.int64)), "starts must be int32, got .*int64"),
    (dict(ends=mx.zeros((2, 1), mx.int32)), r"ends must have shape \(batch,\) = \(2,\)"),
    (dict(starts=[5, 0], ends=[4, 40]), r"starts\[0\] = 5 is past ends\[0\] = 4"),
    (dict(starts="0"), "starts must be an int32 array or a sequence of ints"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_RANGES)
@pytest.mark.parametrize("op", ["fused", "quantized"])
def test_bad_ranges_name_the_argument(changes, message, op):
    q = mx.zeros((2, 4, 1, 64))
    k = v = mx.zeros((2, 2, 40, 64))
    with pytest.raises(ValueError, match=message):
        if op == "fused":
            decode_attention_custom(q, k, v, **changes)
        else:
            triple = mx.quantize(k, 64, 8)
            decode_attention_quantized(q, triple, triple, group_size=64, bits=8, **changes)


BAD_STEP_RANGES = [
    (dict(offset=[3, -1]), r"offsets\[1\] = -1 is outside \[0, 3\]"),
    (dict(offset=[3, 40]), "offset \\+ length must fit the caches: offset 40"),
    (dict(offset=[3, 4, 5]), r"offset must have one value per batch row \(2\), got 3"),
    (dict(offset=5, starts=[0, 6]), r"starts\[1\] = 6 is outside \[0, 5\]"),
    (dict(offset=[5, 2], starts=[0, 3]), r"starts\[1\] = 3 is past offsets\[1\] = 2"),
    (dict(offset=5, starts=mx.array([0.0, 1.0])), "starts must be int32, got .*float32"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_STEP_RANGES)
def test_bad_step_ranges_name_the_argument(changes, message):
    b, hq, hkv, d, capacity = 2, 4, 2, 64, 40
    q, k, v = mx.zeros((b, 1, hq * d)), mx.zeros((b, 1, hkv * d)), mx.zeros((b, 1, hkv * d))
    cache = mx.zeros((b, hkv, capacity, d))
    args = dict(offset=0, starts=None) | changes
    with pytest.raises(ValueError, match=message):
        attention_step(q, k, v, None, None, cache, cache, args["offset"], starts=args["starts"],
                       rope_base=BASE)  # fmt: skip
