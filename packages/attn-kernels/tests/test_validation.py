"""The op's own checks (bindings level); the shared bad-input table is test_contract.py."""

import mlx.core as mx
import pytest
from attn_kernels import _ext
from conftest import settled


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


def test_graph_limits_without_cuda_graphs():
    """A CPU stream has no CUDA graphs: nothing set, None; bad arguments name themselves."""
    from attn_kernels import graph_limits

    assert graph_limits(mx.new_stream(mx.cpu), max_ops=10, max_mb=10) is None
    for kwargs, name in (
        (dict(max_ops=0), "max_ops"),
        (dict(max_mb=-1), "max_mb"),
        (dict(max_ops=2.5), "max_ops"),
        (dict(max_mb=True), "max_mb"),
    ):
        with pytest.raises(ValueError, match=name):
            graph_limits(mx.new_stream(mx.cpu), **kwargs)
    with pytest.raises(ValueError, match="stream"):
        graph_limits(mx.cpu)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_graph_limits_on_a_cuda_stream():
    """A new GPU stream starts at MLX's limits (its environment's, or sm_90's 100 ops and 1000
    MB); each given limit is set, the other kept, and work on the stream still evaluates."""
    import os

    from attn_kernels import graph_limits

    stream = mx.new_stream(mx.gpu)
    ops, mb = graph_limits(stream)
    if "MLX_MAX_OPS_PER_BUFFER" not in os.environ and "MLX_MAX_MB_PER_BUFFER" not in os.environ:
        assert ops > 0 and mb > 0
    assert graph_limits(stream, max_ops=ops + 7) == (ops, mb)
    assert graph_limits(stream, max_mb=mb + 3) == (ops + 7, mb)
    assert graph_limits(stream) == (ops + 7, mb + 3)
    with mx.stream(stream):
        x = mx.arange(1000, dtype=mx.float32)
        for _ in range(300):  # more kernels than MLX's default limit, one graph now
            x = x * 1.0001 + 1
        total = x.sum().item()
    expected = mx.arange(1000, dtype=mx.float32)
    for _ in range(300):
        expected = expected * 1.0001 + 1
    assert total == pytest.approx(expected.sum().item(), rel=1e-6)


def test_output_memory_arguments():
    """Without the CUDA backend outputs come from MLX's allocator: nothing to report or switch."""
    from attn_kernels import output_memory

    with pytest.raises(ValueError, match="device"):
        output_memory(device=1)
    if not mx.cuda.is_available():
        assert output_memory() is None
        assert output_memory(device=False) is None


@pytest.mark.parametrize("setting", [True, False])
def test_managed_outputs_restores_the_setting(monkeypatch, setting):
    """managed_outputs() switches to MLX's allocator inside the block and back to the setting it
    found after it, also when the block raises (the extension's switch stands in for CUDA's)."""
    from attn_kernels import cuda_backend

    state = {"device": setting, "live_bytes": 0, "cached_bytes": 0, "allocations": 0}

    def output_memory(device=None):  # as the extension: the state after the switch
        if device is not None:
            state["device"] = device
        return dict(state)

    monkeypatch.setattr(cuda_backend._ext, "output_memory", output_memory)
    with cuda_backend.managed_outputs():
        assert state["device"] is False
    assert state["device"] is setting
    with pytest.raises(RuntimeError), cuda_backend.managed_outputs():
        raise RuntimeError("inside")
    assert state["device"] is setting


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_output_memory_on_cuda():
    """Our outputs in the extension's device memory equal those in MLX's managed memory and the
    oracle; freed blocks are reused (not one allocation per call), an output read on the host
    (MLX moves it to unified memory) still frees, and the switch holds both ways."""
    import numpy as np
    from attn_kernels import decode_attention_custom, output_memory, scaled_dot_product_attention
    from attn_kernels.cuda_backend import managed_outputs

    mx.set_default_device(mx.gpu)  # conftest's fixture starts every test on the CPU
    mx.random.seed(7)
    q = mx.random.normal((3, 8, 1, 64)).astype(mx.float16)
    k = mx.random.normal((3, 2, 1000, 64)).astype(mx.float16)
    v = mx.random.normal((3, 2, 1000, 64)).astype(mx.float16)
    expected = np.array(scaled_dot_product_attention(q, k, v).astype(mx.float32))

    def attend():  # split: partial states behind the output, so never the query's buffer
        return decode_attention_custom(q, k, v, schedule="split")

    assert output_memory(device=True)["device"]
    mx.eval(attend())
    assert output_memory()["allocations"] > 0, output_memory()
    mx.synchronize()
    start = output_memory()
    base = start["live_bytes"]  # outputs other tests still hold
    for _ in range(20):
        mx.eval(attend())
    assert output_memory()["allocations"] < start["allocations"] + 5
    held = attend()
    mx.eval(held)
    assert output_memory()["live_bytes"] > base, output_memory()
    got = np.array(held)  # data(): MLX moves the block into unified memory
    np.testing.assert_allclose(got.astype(np.float32), expected, atol=2e-2)
    del held
    assert settled(lambda: output_memory()["live_bytes"] <= base)
    with managed_outputs():
        assert not output_memory()["device"]
        managed = attend()
        mx.eval(managed)
        assert output_memory()["live_bytes"] <= base  # MLX's allocation, not counted here
        np.testing.assert_allclose(np.array(managed).astype(np.float32), expected, atol=2e-2)
    assert output_memory()["device"]
