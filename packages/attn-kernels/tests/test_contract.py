"""The contract of attention.py's docstring, one table through both functions: bad inputs, empty
shapes, numpy inputs, output dtype, and non-finite values (against the float64 reference, on
every backend here and every GPU schedule); the NaN rule through every fused op."""

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import (
    MAX_HEAD_DIM,
    SCHEDULES,
    attention_step,
    attention_step_quantized,
    decode_attention_custom,
    decode_attention_quantized,
    scaled_dot_product_attention,
)
from conftest import TOLERANCE
from reference import assert_matches_nonfinite, attention_f64, to_numpy
from test_decode_attention import DEVICES

BOTH = [
    pytest.param(decode_attention_custom, id="fused"),
    pytest.param(scaled_dot_product_attention, id="readable"),
]


def arrays(b=1, hq=4, hkv=2, length=1, s=8, d=16, dtype=mx.float32):
    keys = mx.random.split(mx.random.key(b * 7 + s + d), 3)
    return (
        mx.random.normal((b, hq, length, d), key=keys[0]).astype(dtype),
        mx.random.normal((b, hkv, s, d), key=keys[1]).astype(dtype),
        mx.random.normal((b, hkv, s, d), key=keys[2]).astype(dtype),
    )


# (id, call arguments built from arrays(), exception, message)
BAD = [
    (
        "dtype-mismatch",
        lambda q, k, v: ((q, k.astype(mx.bfloat16), v), {}),
        ValueError,
        r"query, key and value must share one dtype, got mlx.core.float32, mlx.core.bfloat16",
    ),
    (
        "int-inputs",
        lambda q, k, v: ((q.astype(mx.int32), k.astype(mx.int32), v.astype(mx.int32)), {}),
        ValueError,
        "query must be float32, float16 or bfloat16",
    ),
    (
        "int-mask",
        lambda q, k, v: ((q, k, v), {"mask": mx.zeros((1, 1, 1, 8), mx.int32)}),
        TypeError,
        "mask must be boolean .* or floating point .*, got mlx.core.int32",
    ),
    (
        "mask-object",
        lambda q, k, v: ((q, k, v), {"mask": object()}),
        TypeError,
        "mask must be an mx.array or convertible",
    ),
    (
        "mask-string",
        lambda q, k, v: ((q, k, v), {"mask": "sliding"}),
        ValueError,
        "unsupported attention mask 'sliding'",
    ),
    (
        "mask-shape",
        lambda q, k, v: ((q, k, v), {"mask": mx.zeros((1, 4, 1, 7))}),
        ValueError,
        "mask of shape",
    ),
    (
        "query-object",
        lambda q, k, v: (("q", k, v), {}),
        TypeError,
        "query must be an mx.array or convertible",
    ),
    (
        "value-object",
        lambda q, k, v: ((q, k, {}), {}),
        TypeError,
        "value must be an mx.array or convertible",
    ),
    ("rank", lambda q, k, v: ((q[0], k, v), {}), ValueError, "query must have shape"),
    (
        "key-value-shapes",
        lambda q, k, v: ((q, k, v[:, :, :4]), {}),
        ValueError,
        "key and value must have the same shape",
    ),
    (
        "heads",
        lambda q, k, v: ((mx.concatenate([q, q[:, :1]], axis=1), k, v), {}),
        ValueError,
        r"query heads \(5\) must be a multiple of key/value heads \(2\)",
    ),
    (
        "head-dims",
        lambda q, k, v: ((q[..., :8], k, v), {}),
        ValueError,
        "query head dim 8 differs from key/value head dim 16",
    ),
    (
        "zero-head-dim",
        lambda q, k, v: ((q[..., :0], k[..., :0], v[..., :0]), {}),
        ValueError,
        "head dim",
    ),
    (
        "causal-L-over-S",
        lambda q, k, v: ((mx.repeat(q, 9, axis=2), k, v), {"mask": "causal"}),
        ValueError,
        "causal attention needs query length <= context",
    ),
]


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize(
    ("build", "error", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_inputs(fn, build, error, message):
    args, kwargs = build(*arrays())
    with pytest.raises(error, match=message):
        mx.eval(fn(*args, **kwargs))


def test_head_dim_above_the_kernel_limit_is_the_one_asymmetry():
    q, k, v = arrays(d=MAX_HEAD_DIM + 8)
    with pytest.raises(ValueError, match=rf"head_dim must be in \[1, {MAX_HEAD_DIM}\]"):
        decode_attention_custom(q, k, v)
    expected = attention_f64(q, k, v)
    np.testing.assert_allclose(
        to_numpy(scaled_dot_product_attention(q, k, v)), expected, **TOLERANCE[mx.float32]
    )


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_no_keys_gives_zeros(fn, mask):
    q, k, v = arrays(length=1 if mask == "causal" else 3, s=0, dtype=mx.bfloat16)
    if mask == "causal":
        q = q[:, :, :0]  # causal needs L <= S = 0
    m = {
        "bool": mx.zeros((1, 1, q.shape[2], 0), mx.bool_),
        "additive": mx.zeros((1, 1, q.shape[2], 0)),
    }.get(mask, mask)
    out = fn(q, k, v, mask=m)
    assert out.shape == q.shape and out.dtype == mx.bfloat16
    assert not mx.any(out).item()


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("shape", [dict(length=0), dict(b=0), dict(length=0, s=0)])
def test_empty_output(fn, shape):
    q, k, v = arrays(**shape)
    out = fn(q, k, v)
    assert out.shape == q.shape and out.size == 0 and out.dtype == q.dtype


@pytest.mark.parametrize("fn", BOTH)
def test_numpy_inputs_convert_like_mx_array(fn):
    q, k, v = arrays(length=2, s=37)
    mask = np.where(np.arange(37) % 5 == 0, -np.inf, 0.0)  # float64: mx.array makes float32
    out = fn(np.array(q), np.array(k), np.array(v), mask=mask)
    same = fn(q, k, v, mask=mx.array(mask))
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np.array(out), np.array(same))


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_output_dtype_is_the_query_dtype(fn, dtype):
    q, k, v = arrays(length=2, s=37, dtype=dtype)
    assert fn(q, k, v, mask=mx.zeros((1, 1, 2, 37), mx.float32)).dtype == dtype


# Non-finite values: (id, where). Position 37 of S=45 and 1500 of S=1600 lie in a later tile and,
# for long contexts, a later split than position 0.
NONFINITE = [
    ("q-nan", "q", np.nan),
    ("q-inf", "q", np.inf),
    ("q-neginf", "q", -np.inf),
    ("k-nan", "k", np.nan),
    ("k-inf", "k", np.inf),
    ("k-neginf", "k", -np.inf),
    ("v-nan", "v", np.nan),
    ("v-inf", "v", np.inf),
    ("v-neginf", "v", -np.inf),
    ("scale-nan", "scale", np.nan),
    ("scale-inf", "scale", np.inf),
    ("scale-neginf", "scale", -np.inf),
    ("mask-nan", "mask", np.nan),
    ("mask-inf", "mask", np.inf),
    ("mask-neginf", "mask", -np.inf),
    ("mask-row-all-neginf", "mask-row", -np.inf),
    ("bool-mask-removes-nan-key", "bool", np.nan),
]


def nonfinite_inputs(where, value, s, d, dtype):
    b, hq, hkv, length = 1, 8, 2, 3
    q, k, v = (to_numpy(a) for a in arrays(b, hq, hkv, length, s, d))
    pos = s - 8
    scale, mask = 1.0 / np.sqrt(d), None
    if where == "q":
        q[0, 1, 2, 5] = value
    elif where in ("k", "v"):
        (k if where == "k" else v)[0, 0, pos, 5] = value
    elif where == "scale":
        scale = value
    elif where in ("mask", "mask-row"):
        mask = np.zeros((b, hq, length, s))
        if where == "mask":
            mask[0, 1, 2, pos] = value
        else:
            mask[0, 3, 1, :] = value
    elif where == "bool":
        k[0, 0, pos, :] = value  # every query head of KV head 0 scores NaN there ...
        mask = np.ones((b, hq, length, s), dtype=bool)
        mask[:, :, :, pos] = False  # ... and the mask removes it
    as_mx = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    if mask is not None:
        mask = mx.array(mask) if mask.dtype == bool else mx.array(mask.astype(np.float32))
    return as_mx(q), as_mx(k), as_mx(v), scale, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("where", "value"), [c[1:] for c in NONFINITE], ids=[c[0] for c in NONFINITE]
)
@pytest.mark.parametrize(("s", "d", "dtype"), [(45, 72, mx.float32), (1600, 128, mx.bfloat16)])
def test_nonfinite_values(device, where, value, s, d, dtype):
    q, k, v, scale, mask = nonfinite_inputs(where, value, s, d, dtype)
    expected = attention_f64(q, k, v, scale=scale, mask=mask)
    tol = {key: 2 * x for key, x in TOLERANCE[dtype].items()}
    with mx.stream(device):
        readable = scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        fused = {
            name: decode_attention_custom(q, k, v, scale=scale, mask=mask, schedule=name)
            for name in (SCHEDULES if device == mx.gpu else ("auto",))
        }
    if where == "mask-row":
        assert np.all(expected[0, 3, 1] == 0.0)  # every key removed: zeros
    elif where != "bool" and not (where in ("v", "mask") and value == -np.inf):
        assert not np.isfinite(expected).all()  # the case does reach the output
    assert_matches_nonfinite(to_numpy(readable), expected, **tol)
    for name, out in fused.items():
        assert_matches_nonfinite(to_numpy(out), expected, **tol, err_msg=name)


def _nan_query_out(op, device):
    """One call of `op` with a NaN in query head 5 of batch row 0 (a step: in its q
    projection), on `device`; returns the output as (B, Hq, L, D) float64."""
    b, hq, hkv, s, d = 2, 8, 2, 300, 64
    keys = mx.random.split(mx.random.key(11), 3)
    k, v = (mx.random.normal((b, hkv, s, d), key=key) for key in keys[1:])
    quantized = op.endswith("quantized")
    triples = [mx.quantize(x, 32, 4) for x in (k, v)] if quantized else None
    with mx.stream(device):
        if op.startswith("attention_step"):
            q = mx.random.normal((b, 1, hq * d), key=keys[0])
            q[0, 0, 5 * d + 7] = mx.nan
            new = mx.zeros((b, 1, hkv * d))
            args = (q, new, new, None, None)
            options = dict(rope_base=1e4, owned_caches=False)
            if quantized:
                caches = [tuple(a[:, :, : s + 1] for a in t) for t in
                          (mx.quantize(mx.pad(x, [(0, 0), (0, 0), (0, 1), (0, 0)]), 32, 4)
                           for x in (k, v))]  # fmt: skip
                out = attention_step_quantized(*args, *caches, s, group_size=32, bits=4, **options)
            else:
                caches = [mx.pad(x, [(0, 0), (0, 0), (0, 1), (0, 0)]) for x in (k, v)]
                out = attention_step(*args, *caches, s, **options)
            out = out[0].reshape(b, 1, hq, d).transpose(0, 2, 1, 3)
        else:
            q = mx.random.normal((b, hq, 1, d), key=keys[0])
            q[0, 5, 0, 7] = mx.nan
            if quantized:
                out = decode_attention_quantized(q, *triples, group_size=32, bits=4)
            else:
                out = decode_attention_custom(q, k, v)
    return to_numpy(out)


OPS = ["decode_attention_custom", "decode_attention_quantized", "attention_step",
       "attention_step_quantized"]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_nan_query_gives_a_nan_row_in_every_op(device, op):
    """The NaN rule of the contract, for every fused op: a NaN in a query makes its whole output
    row NaN (not zeros, which the quantized CPU kernel once returned); every other row is
    finite."""
    if device == mx.gpu and op == "attention_step_quantized" and not mx.cuda.is_available():
        pytest.skip("no Metal kernel for the quantized step")
    out = _nan_query_out(op, device)
    assert np.isnan(out[0, 5]).all()
    rest = np.concatenate([np.delete(out[0], 5, axis=0).ravel(), out[1].ravel()])
    assert np.isfinite(rest).all()
