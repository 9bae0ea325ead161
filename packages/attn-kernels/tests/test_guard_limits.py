"""The dispatch guard's table, every backend: each side of every limit."""

import mlx.core as mx
import pytest
from attn_kernels import guard
from attn_kernels.guard import LIMITS, use_fused

BACKENDS = sorted(LIMITS)
MASK = mx.zeros((1, 1, 1, 1))


def test_every_backend_has_a_table():
    assert set(LIMITS) == {"cpu", "cuda", "metal"}


@pytest.mark.parametrize("where", BACKENDS)
def test_query_and_context_limits(where):
    lim = LIMITS[where]
    d, dt = lim.head_dims[0], lim.dtypes[0]
    for mask in (None, "causal"):
        assert use_fused(1, 1, d, mask, where, dtype=dt)
        assert use_fused(lim.max_query, lim.max_context, d, mask, where, dtype=dt)
        assert not use_fused(lim.max_query + 1, lim.max_context, d, mask, where, dtype=dt)
        assert not use_fused(1, lim.max_context + 1, d, mask, where, dtype=dt)
        assert not use_fused(2 * lim.max_query, 2 * lim.max_query, d, mask, where)  # a prompt


@pytest.mark.parametrize("where", BACKENDS)
def test_explicit_mask_limits(where):
    lim = LIMITS[where]
    d = lim.head_dims[0]
    if lim.max_masked_query == 0:
        assert not use_fused(1, 1, d, MASK, where)
        return
    assert use_fused(1, 1, d, MASK, where)
    assert use_fused(lim.max_masked_query, lim.max_masked_context, d, MASK, where)
    assert not use_fused(lim.max_masked_query + 1, lim.max_masked_context, d, MASK, where)
    assert not use_fused(1, lim.max_masked_context + 1, d, MASK, where)
    # The explicit-mask region lies inside the unmasked one.
    assert lim.max_masked_query <= lim.max_query
    assert lim.max_masked_context <= lim.max_context


@pytest.mark.parametrize("where", BACKENDS)
def test_head_dim_dtype_and_mask_kind(where):
    lim = LIMITS[where]
    d = lim.head_dims[0]
    assert not use_fused(1, 1, 2 * d + 1, None, where)
    assert use_fused(1, 1, d, None, where, dtype=lim.dtypes[0])
    unmeasured = [
        t
        for t in (mx.float32, mx.float16, mx.bfloat16)
        if t not in lim.dtypes and lim.region(d, t, 1) is None
    ]
    for t in unmeasured:
        assert not use_fused(1, 1, d, None, where, dtype=t)
    assert not use_fused(1, 1, d, "sliding", where)
    assert not use_fused(0, 1, d, None, where)  # nothing to attend
    assert not use_fused(2, 1, d, "causal", where)  # L > S


@pytest.mark.parametrize("where", BACKENDS)
def test_further_shapes(where):
    """Limits.shapes: each (head dim, dtype, swept L) inside its own row's contexts, mask None or
    "causal" and one row only; a length between two swept ones where both rows hold S; none
    past the longest swept length; a head dim no record covers never."""
    lim = LIMITS[where]
    for d, t, q, lo, hi in lim.shapes:
        assert lim.region(d, t, q) == (lo, hi)
        assert use_fused(q, hi, d, "causal", where, dtype=t)
        assert use_fused(q, max(lo, q), d, "causal", where, dtype=t)
        if lo > q:
            assert not use_fused(q, lo - 1, d, "causal", where, dtype=t)
        assert not use_fused(q, hi + 1, d, "causal", where, dtype=t)
        assert not use_fused(q, hi, d, mx.zeros((1, 1, q, hi)), where, dtype=t)
        assert not use_fused(q, hi, d, "causal", where, dtype=t, batch=2)
    for d, t in {(d, t) for d, t, *_ in lim.shapes}:
        rows = {q: (lo, hi) for d2, t2, q, lo, hi in lim.shapes if (d2, t2) == (d, t)}
        for length in range(1, max(rows) + 1):
            below = rows[max(q for q in rows if q <= length)]
            above = rows[min(q for q in rows if q >= length)]
            for s in (1, 32, 128, 1024, 16384, 32768, 131072):
                inside = all(lo <= s <= hi for lo, hi in (below, above)) and s >= length
                assert use_fused(length, s, d, "causal", where, dtype=t) == inside, (d, t, s)
        assert lim.region(d, t, max(rows) + 1) is None
    assert all(lim.region(48, t, 1) is None for t in (mx.float32, mx.float16, mx.bfloat16))


def test_cuda_lengths_between_swept_ones():
    """D 80 float32 on CUDA: L = 8 lost past S = 8192, so L = 5..7 stop there too; L = 2, 3 take
    L = 1's and 4's (both to 131072). D 64 bf16: L = 1 from S = 128 (S = 32 lost), so L = 2, 3
    from 128 as well, L = 4 from 1."""
    lim = LIMITS["cuda"]
    assert [lim.region(80, mx.float32, q) for q in (2, 5, 7, 8)] == [
        (1, 131072), (1, 8192), (1, 8192), (1, 8192)]  # fmt: skip
    assert [lim.region(64, mx.bfloat16, q) for q in (1, 2, 3, 4)] == [
        (128, 131072), (128, 131072), (128, 131072), (1, 131072)]  # fmt: skip


@pytest.mark.parametrize("where", BACKENDS)
def test_batch_limits(where):
    """Batches of rows with their own ranges: inside max_batch and max_batch_context only (one
    row is the single-request region); the batch region lies inside it."""
    lim = LIMITS[where]
    d, dt = lim.head_dims[0], lim.dtypes[0]
    assert use_fused(1, lim.max_context, d, "causal", where, dtype=dt, batch=1)
    if lim.max_batch <= 1:
        assert not use_fused(1, 1, d, "causal", where, dtype=dt, batch=2)
        return
    assert use_fused(1, lim.max_batch_context, d, "causal", where, dtype=dt, batch=lim.max_batch)
    assert not use_fused(1, lim.max_batch_context, d, "causal", where, dtype=dt,
                         batch=lim.max_batch + 1)  # fmt: skip
    assert not use_fused(1, lim.max_batch_context + 1, d, "causal", where, dtype=dt, batch=2)
    assert lim.max_batch_context <= lim.max_context


def test_batch_limits_name_their_records():
    """Each backend's batch region cites records that exist (benchmark_results/)."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[3] / "benchmark_results"
    for name in ("cpu-2core-qwen3-4b-attention-B32-ragged", "h200-qwen3-4b-attention-B32-ragged"):
        assert (results / f"{name}-mlx-0.32.4.json").is_file()
        assert name.replace("B32", "B{").split("{")[0] in guard.__doc__


def test_cuda_table_lifted_to_the_records():
    """The H200 records (guard.py's docstring) have the kernel ahead of mx.fast at S=131072 for
    L <= 8, and with explicit masks at S <= 4096 for L <= 2."""
    assert LIMITS["cuda"].max_context == 131072 and LIMITS["cuda"].max_query == 8
    assert (LIMITS["cuda"].max_masked_query, LIMITS["cuda"].max_masked_context) == (2, 4096)


def test_default_backend_follows_the_default_device(monkeypatch):
    mx.set_default_device(mx.cpu)
    assert guard.backend() == "cpu"
    d = LIMITS["cpu"].head_dims[0]
    assert use_fused(1, LIMITS["cpu"].max_context, d, None) == use_fused(
        1, LIMITS["cpu"].max_context, d, None, "cpu"
    )
    monkeypatch.setattr(guard, "_default_backend", lambda: "cuda")
    assert use_fused(1, LIMITS["cuda"].max_context, d, None)
    assert not use_fused(1, LIMITS["cuda"].max_context, d, None, "cpu")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        use_fused(1, 1, 128, None, "tpu")


def test_quantized_group_sizes():
    """The quantized kernel only for the group sizes its records and tests cover (32, 64 and
    128 on CUDA and the CPU); a group size not given skips the check."""
    for where in ("cuda", "cpu"):
        for group_size in (32, 64, 128):
            assert guard.use_fused_quantized(1, 4096, None, where, group_size=group_size)
        assert not guard.use_fused_quantized(1, 4096, None, where, group_size=16)
    assert guard.use_fused_quantized(1, 4096, None, "cuda")
    # L = 2-8 causal measured on the CPU only (speculative decoding's verify step)
    assert guard.use_fused_quantized(8, 4096, "causal", "cpu", group_size=64)
    assert not guard.use_fused_quantized(9, 4096, "causal", "cpu", group_size=64)
    assert not guard.use_fused_quantized(2, 4096, "causal", "cuda", group_size=64)
    assert not guard.use_fused_quantized(1, 4096, None, "metal", group_size=64)
    assert set(guard.QUANTIZED_GROUP_SIZES) == set(guard.QUANTIZED_LIMITS)


def test_quantized_head_dims():
    """The quantized kernel at the head dims its records time: 64, 96 (group 32), 128 and 256 on
    the CPU, 128 on CUDA; bf16 only (the dtype the records quantize from); the quantized step
    wherever the op runs on the CPU, multiples of 64 on GPUs."""
    for d in (64, 128, 256):
        assert guard.use_fused_quantized(1, 4096, None, "cpu", head_dim=d, dtype=mx.bfloat16)
        assert guard.use_step_quantized(8, 4096, d, "causal", "cpu", dtype=mx.bfloat16)
    assert guard.use_fused_quantized(8, 32768, "causal", "cpu", head_dim=96, group_size=32)
    assert guard.use_step_quantized(1, 4096, 96, None, "cpu", group_size=32)
    assert not guard.use_step_quantized(1, 4096, 96, None, "cuda", group_size=32)
    assert not guard.use_fused_quantized(1, 4096, None, "cpu", head_dim=80)
    assert not guard.use_fused_quantized(1, 4096, None, "cuda", head_dim=96)
    assert not guard.use_fused_quantized(1, 4096, None, "cpu", head_dim=64, dtype=mx.float16)
    assert not guard.use_fused_quantized(1, 4096, None, "cuda", head_dim=64)
    assert set(guard.QUANTIZED_FURTHER_HEAD_DIMS) == set(guard.QUANTIZED_LIMITS)


def test_quantized_step_region():
    """attention_step_quantized inside the quantized region, one causal token, head dims that
    are multiples of 64, on the CPU and CUDA only."""
    bf16 = mx.bfloat16
    for where in ("cpu", "cuda"):
        assert guard.use_step_quantized(1, 4096, 128, None, where, dtype=bf16, group_size=64)
        assert guard.use_step_quantized(1, 4096, 128, "causal", where, dtype=bf16, group_size=32)
        assert not guard.use_step_quantized(2, 4096, 128, None, where, dtype=bf16, group_size=64)
        assert not guard.use_step_quantized(1, 4096, 128, None, where, dtype=bf16, group_size=16)
    _, max_context = guard.QUANTIZED_LIMITS["cpu"]
    assert not guard.use_step_quantized(1, max_context + 1, 128, None, "cpu", dtype=bf16)
    assert not guard.use_step_quantized(1, 4096, 128, None, "metal", dtype=bf16, group_size=64)
    assert set(guard.QUANTIZED_STEP_BACKENDS) <= set(guard.QUANTIZED_LIMITS)


def test_linear_limits():
    """decode_linear on the CPU: 1-8 rows, the measured formats and group sizes; on CUDA 4- and
    8-bit codes with bf16 x at 2-32 rows (MLX's qmv ties at 1; past 32 a second pass); Metal keeps
    MLX's matmuls (linear_rows 0 lets callers skip the question there)."""
    rows = guard.linear_rows("cpu")
    assert rows == 8 and guard.linear_rows("cuda") == 32 and guard.linear_rows("metal") == 0
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        assert guard.use_linear(1, dtype, backend="cpu")
        assert not guard.use_linear(2, dtype, backend="cuda")  # dense: MLX's matmul
    for bits in (4, 8):
        assert guard.use_linear(2, mx.bfloat16, bits, 64, backend="cuda")
        assert guard.use_linear(4, mx.bfloat16, bits, 128, backend="cuda")
        assert guard.use_linear(8, mx.bfloat16, bits, 128, backend="cuda")
        assert guard.use_linear(32, mx.bfloat16, bits, 128, backend="cuda")
        assert not guard.use_linear(1, mx.bfloat16, bits, 64, backend="cuda")
        assert not guard.use_linear(33, mx.bfloat16, bits, 64, backend="cuda")
        assert not guard.use_linear(2, mx.float16, bits, 64, backend="cuda")  # not measured
    assert guard.use_linear(rows, mx.bfloat16, 4, 64, backend="cpu")
    assert guard.use_linear(3, mx.bfloat16, 8, 128, backend="cpu")
    assert not guard.use_linear(rows + 1, mx.bfloat16, backend="cpu")
    assert not guard.use_linear(0, mx.bfloat16, backend="cpu")
    assert not guard.use_linear(1, mx.float16, 4, 64, backend="cpu")  # no record for f16 codes
    assert not guard.use_linear(1, mx.bfloat16, 4, 16, backend="cpu")  # a group size MLX lacks
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        guard.use_linear(1, mx.bfloat16, backend="tpu")
