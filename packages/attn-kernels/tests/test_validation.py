"""The op's own checks (bindings level); the shared bad-input table is test_contract.py."""

import mlx.core as mx
import pytest
from attn_kernels import _ext


def arrays(b=1, hq=4, hkv=2, length=1, s=8, d=16, dtype=mx.float32):
    return (
        mx.zeros((b, hq, length, d), dtype),
        mx.zeros((b, hkv, s, d), dtype),
        mx.zeros((b, hkv, s, d), dtype),
    )


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
    with pytest.raises(ValueError, match="must share one dtype"):
        _ext.decode_attention(q, k.astype(mx.bfloat16), v, 1.0)
    with pytest.raises(ValueError, match="mask must be additive"):
        _ext.decode_attention(q, k, v, 1.0, mx.zeros((1, 4, 1, 8), mx.int32))
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        _ext.decode_attention(q, k, v, 1.0, None, False, "fast")
    # The contract's empty cases hold at the op too (attention.py).
    assert not mx.any(_ext.decode_attention(q, k[:, :, :0], v[:, :, :0], 1.0)).item()
    assert _ext.decode_attention(q[:, :, :0], k, v, 1.0).shape == (1, 4, 0, 16)
