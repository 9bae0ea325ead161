"""Bad input gives errors that name the argument, from both entry points."""

import mlx.core as mx
import pytest
from attn_kernels import MAX_HEAD_DIM, _ext, decode_attention_custom, scaled_dot_product_attention


def arrays(b=1, hq=4, hkv=2, length=1, s=8, d=16, dtype=mx.float32):
    return (
        mx.zeros((b, hq, length, d), dtype),
        mx.zeros((b, hkv, s, d), dtype),
        mx.zeros((b, hkv, s, d), dtype),
    )


BOTH = [decode_attention_custom, scaled_dot_product_attention]


@pytest.mark.parametrize("fn", BOTH)
def test_heads_must_divide(fn):
    q, k, v = arrays(hq=6, hkv=4)
    with pytest.raises(
        ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"
    ):
        fn(q, k, v)


@pytest.mark.parametrize("fn", BOTH)
def test_rank(fn):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="query must have shape"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match="key must have shape"):
        fn(q, k[0], v)


@pytest.mark.parametrize("fn", BOTH)
def test_key_value_mismatch(fn):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="key and value must have the same shape"):
        fn(q, k, v[:, :, :4])


@pytest.mark.parametrize("fn", BOTH)
def test_unsupported_mask_string(fn):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="unsupported attention mask 'sliding'"):
        fn(q, k, v, mask="sliding")


@pytest.mark.parametrize("fn", BOTH)
def test_mask_not_broadcastable(fn):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="mask of shape"):
        fn(q, k, v, mask=mx.zeros((1, 4, 1, 7)))


@pytest.mark.parametrize("fn", BOTH)
def test_causal_longer_query_than_context(fn):
    q, k, v = arrays(length=9, s=8)
    with pytest.raises(ValueError, match="causal attention needs query length <= context"):
        fn(q, k, v, mask="causal")


def test_dtype_checks():
    q, k, v = arrays(dtype=mx.int32)
    with pytest.raises(ValueError, match="queries must be float32, float16 or bfloat16"):
        decode_attention_custom(q, k, v)
    q, k, v = arrays()
    with pytest.raises(ValueError, match="must share one dtype"):
        decode_attention_custom(q, k.astype(mx.bfloat16), v.astype(mx.bfloat16))
    with pytest.raises(ValueError, match="mask must be additive"):
        decode_attention_custom(q, k, v, mask=mx.zeros((1, 1, 1, 8), mx.int32))


def test_head_dim_limit():
    q, k, v = arrays(d=MAX_HEAD_DIM + 1)
    with pytest.raises(
        ValueError, match=f"head_dim must be in \\[1, {MAX_HEAD_DIM}\\], got {MAX_HEAD_DIM + 1}"
    ):
        decode_attention_custom(q, k, v)


def test_op_level_checks():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="mask must have shape"):
        _ext.decode_attention(q, k, v, 1.0, mx.zeros((1, 4, 1, 7)))
    with pytest.raises(ValueError, match="either an explicit mask or causal"):
        _ext.decode_attention(q, k, v, 1.0, mx.zeros((1, 4, 1, 8)), True)
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        _ext.decode_attention(q[0], k, v, 1.0)
    with pytest.raises(ValueError, match="keys' batch 2 differs"):
        _ext.decode_attention(q, mx.concatenate([k, k]), mx.concatenate([v, v]), 1.0)
    with pytest.raises(ValueError, match="keys must hold at least one position"):
        _ext.decode_attention(q, k[:, :, :0], v[:, :, :0], 1.0)


def test_mask_type():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"mask must be None, 'causal' or an mx\.array"):
        decode_attention_custom(q, k, v, mask=[[0.0]])
