"""add_rms_norm (the residual add and RMSNorm in one kernel on CUDA) against the two MLX ops. On
the CPU it is those ops (the model's wiring is tested in test_model.test_add_norm_switch)."""

import mlx.core as mx
import numpy as np
import pytest
from qwen3_model.add_norm import add_rms_norm

SHAPES = [(1, 1, 2560), (1, 3, 1000), (2, 5, 4096), (1, 1, 33)]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def check(shape, dtype):
    keys = mx.random.split(mx.random.key(sum(shape)), 3)
    x = (4.0 * mx.random.normal(shape, key=keys[0])).astype(dtype)
    y = mx.random.normal(shape, key=keys[1]).astype(dtype)
    w = (1.0 + 0.2 * mx.random.normal(shape[-1:], key=keys[2])).astype(dtype)
    h, normed = add_rms_norm(x, y, w, 1e-6)
    want_h = x + y
    want = mx.fast.rms_norm(want_h, w, 1e-6)
    f32 = [a.astype(mx.float32) for a in (h, want_h, normed, want)]
    np.testing.assert_array_equal(np.array(f32[0]), np.array(f32[1]))
    # One rounding of the output apart at most (the sum of squares is reduced in another order).
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 8e-3}[dtype]
    np.testing.assert_allclose(np.array(f32[2]), np.array(f32[3]), rtol=tol, atol=tol)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="this MLX has no CUDA backend")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s[-1]) for s in SHAPES])
def test_cuda(shape, dtype):
    mx.set_default_device(mx.gpu)
    check(shape, dtype)
