"""decode_attention_custom and the oracle against a float64 reference, on every backend here."""

import itertools
import os
import platform
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import SCHEDULES, _ext, decode_attention_custom, scaled_dot_product_attention
from attn_kernels.cuda_backend import managed_outputs
from conftest import TOLERANCE, settled
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import attention_f64, to_numpy
from tiers import few, few_rows

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _gpu_available() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


def schedules(device):
    """Every GPU schedule on the GPU; the CPU kernel has one."""
    return SCHEDULES if device == mx.gpu else ("auto",)


# The CPU kernel's instruction-set paths this CPU runs (x86-64: avx512, avx2, portable; arm64:
# neon), best first; ATTN_KERNELS_CPU_PATH picks one, read when the op is evaluated.
CPU_PATHS = tuple(_ext.cpu_paths())


def kernel_paths(device):
    """On the CPU, every path this CPU runs, ATTN_KERNELS_CPU_PATH set to each in turn (evaluate
    inside the loop: the op reads it when evaluated); on a GPU, once."""
    if device != mx.cpu:
        yield "gpu"
        return
    saved = os.environ.get("ATTN_KERNELS_CPU_PATH")
    try:
        for path in CPU_PATHS:
            os.environ["ATTN_KERNELS_CPU_PATH"] = path
            yield path
    finally:
        if saved is None:
            os.environ.pop("ATTN_KERNELS_CPU_PATH", None)
        else:
            os.environ["ATTN_KERNELS_CPU_PATH"] = saved


DEVICES = [
    pytest.param(mx.cpu, id="cpu"),
    pytest.param(
        mx.gpu,
        id="gpu",
        marks=pytest.mark.skipif(not _gpu_available(), reason="this MLX has no GPU backend"),
    ),
]


def make_inputs(seed, b, hq, hkv, length, s, d, dtype, mask_kind):
    keys = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((b, hq, length, d), key=keys[0]).astype(dtype)
    k = mx.random.normal((b, hkv, s, d), key=keys[1]).astype(dtype)
    v = mx.random.normal((b, hkv, s, d), key=keys[2]).astype(dtype)
    if mask_kind == "explicit":
        # Additive, per head and row, with some keys removed outright.
        mask = mx.random.normal((b, hq, length, s), key=keys[3])
        mask = mx.where(mx.random.uniform(shape=mask.shape, key=keys[3]) < 0.2, -mx.inf, mask)
    elif mask_kind == "causal":
        mask = "causal"
    else:
        mask = None
    return q, k, v, mask


def check(out, expected, dtype, factor=1.0, label="", oracle_on=None):
    """oracle_on: the device that computed `out` with the readable path. MLX's CUDA matmuls take
    float32 through TF32 (10-bit mantissa), so a GPU oracle in float32 is only good to ~1e-3."""
    if oracle_on is not None and oracle_on != mx.cpu and dtype == mx.float32:
        dtype_tol = TOLERANCE[mx.float16]
    else:
        dtype_tol = TOLERANCE[dtype]
    tol = {key: value * factor for key, value in dtype_tol.items()}
    assert out.dtype == dtype
    np.testing.assert_allclose(to_numpy(out), expected, **tol, err_msg=label)


# The reference grid: D=128; L in {1, 8}; GQA 1 and 4 and Qwen3-4B's 32/8; the chapter's contexts.
GRID = [
    (length, heads, s, mask_kind)
    for length, heads, s, mask_kind in itertools.product(
        [1, 8],
        [(4, 4), (8, 2), (32, 8)],
        [1, 31, 32, 127, 128, 129, 255, 256],
        ["none", "causal", "explicit"],
    )
    if s >= length
]


# The quick tier: each L, GQA and mask kind, at contexts shorter than, equal to and between
# multiples of 32.
GRID_QUICK = [
    (1, (32, 8), 129, "none"),
    (8, (8, 2), 31, "causal"),
    (1, (4, 4), 255, "explicit"),
    (8, (32, 8), 128, "explicit"),
    (1, (8, 2), 1, "causal"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("length", "heads", "s", "mask_kind"), few_rows(GRID, *GRID_QUICK))
def test_reference_grid(device, length, heads, s, mask_kind):
    hq, hkv = heads
    batch = 2 if hq == 4 else 1
    for dtype in DTYPES:
        for seed in (s * 7 + length, s * 7 + length + 1000):
            q, k, v, mask = make_inputs(seed, batch, hq, hkv, length, s, 128, dtype, mask_kind)
            expected = attention_f64(q, k, v, mask=mask)
            with mx.stream(device):
                oracle = scaled_dot_product_attention(q, k, v, mask=mask)
                check(oracle, expected, dtype, label="oracle", oracle_on=device)
                for path, schedule in itertools.product(kernel_paths(device), schedules(device)):
                    out = decode_attention_custom(q, k, v, mask=mask, schedule=schedule)
                    label = f"{dtype} {path} schedule={schedule}"
                    check(out, expected, dtype, label=label)
                    check(out, to_numpy(oracle), dtype, factor=2.0, oracle_on=device, label=label)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "s", few([4096, 32768, pytest.param(131072, marks=pytest.mark.gpu_only)], 4096)
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_long_context(device, s, dtype):
    q, k, v, _ = make_inputs(s, 1, 8, 2, 1, s, 128, dtype, "none")
    q2 = mx.concatenate([q, q], axis=2)
    expected, expected_causal = attention_f64(q, k, v), attention_f64(q2, k, v, mask="causal")
    for schedule in schedules(device):
        with mx.stream(device):
            out = decode_attention_custom(q, k, v, schedule=schedule)
            causal = decode_attention_custom(q2, k, v, mask="causal", schedule=schedule)
        check(out, expected, dtype)
        check(causal, expected_causal, dtype)


@pytest.mark.gpu_only
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s", [8192, 32768])
@pytest.mark.parametrize(("d", "hq", "hkv"), [(256, 4, 4), (256, 8, 2), (96, 8, 8), (80, 8, 2)])
def test_long_context_head_dims(device, s, d, hq, hkv):
    """Head dims other than 128 at long contexts: the tensor-core kernel's chunks and merge at the
    split counts a long call gets (test_long_context covers D = 128). An H100 coverage record
    timed D = 256 at S = 8192 faster than the card's HBM allows (overlapping calls sharing L2,
    results-h200.md); this is the check that such a call reads and weighs every position."""
    q, k, v, _ = make_inputs(s + d, 1, hq, hkv, 8, s, d, mx.bfloat16, "none")
    one = q[:, :, -1:]
    expected, expected_causal = attention_f64(one, k, v), attention_f64(q, k, v, mask="causal")
    for schedule in schedules(device):
        with mx.stream(device):
            out = decode_attention_custom(one, k, v, schedule=schedule)
            causal = decode_attention_custom(q, k, v, mask="causal", schedule=schedule)
        check(out, expected, mx.bfloat16, label=f"L=1 schedule={schedule}")
        check(causal, expected_causal, mx.bfloat16, label=f"L=8 causal schedule={schedule}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("length", "group"), [(3, 4), (5, 3), (7, 3), (2, 8)])
@pytest.mark.parametrize("s", [100, 1500])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_partial_vector_tiles(device, length, group, s, d):
    """More query vectors per KV head (length * group) than one GPU block holds, in counts that
    leave the last tile partly empty, with and without a context split."""
    for mask_kind, dtype in [("causal", mx.bfloat16), ("explicit", mx.float16)]:
        q, k, v, mask = make_inputs(s + d + length, 1, 2 * group, 2, length, s, d, dtype, mask_kind)
        expected = attention_f64(q, k, v, mask=mask)
        for path, schedule in itertools.product(kernel_paths(device), schedules(device)):
            with mx.stream(device):
                out = decode_attention_custom(q, k, v, mask=mask, schedule=schedule)
            check(out, expected, dtype, label=f"{mask_kind} {path} schedule={schedule}")


@pytest.mark.parametrize("device", DEVICES)
def test_many_calls_in_one_eval(device):
    """Independent split calls evaluated together (MLX may run them concurrently on a GPU): each
    call merges its own context chunks, whatever else is in flight."""
    calls, s = 24, 3000
    q, k, v, _ = make_inputs(11, 1, 8, 2, calls, s, 64, mx.bfloat16, "none")
    expected = attention_f64(q, k, v)
    for schedule in schedules(device):
        with mx.stream(device):
            outs = [
                decode_attention_custom(q[:, :, i : i + 1], k, v, schedule=schedule)
                for i in range(calls)
            ]
            mx.eval(outs)
        check(mx.concatenate(outs, axis=2), expected, mx.bfloat16, label=schedule)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 40, 64, 72, 80, 96, 128, 200, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(device, d, dtype):
    q, k, v, mask = make_inputs(d, 1, 6, 3, 3, 77, d, dtype, "causal")
    expected = attention_f64(q, k, v, scale=0.3, mask=mask)
    for path in kernel_paths(device):
        with mx.stream(device):
            out = decode_attention_custom(q, k, v, scale=0.3, mask=mask)
        check(out, expected, dtype, label=path)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_are_read_in_place(device):
    """Cache slices, a (B, S, H, D) layout seen as (B, H, S, D), and a transposed head dim."""
    b, hq, hkv, s, cap, d = 2, 8, 2, 45, 64, 48
    q, k, v, _ = make_inputs(1, b, hq, hkv, 2, s, d, mx.bfloat16, "none")
    k_cache = mx.zeros((b, hkv, cap, d), mx.bfloat16)
    k_cache[:, :, :s, :] = k
    v_cache = mx.zeros((b, hkv, cap, d), mx.bfloat16)
    v_cache[:, :, :s, :] = v
    k_seq_major = mx.array(
        np.ascontiguousarray(np.array(k.astype(mx.float32)).transpose(0, 2, 1, 3))
    )
    k_seq_major = k_seq_major.astype(mx.bfloat16).transpose(0, 2, 1, 3)
    v_dim_major = mx.array(np.ascontiguousarray(np.array(v.astype(mx.float32)).swapaxes(-1, -2)))
    v_dim_major = v_dim_major.astype(mx.bfloat16).swapaxes(-1, -2)
    expected = attention_f64(q, k, v, mask="causal")
    with mx.stream(device):
        for path, (kk, vv) in itertools.product(
            kernel_paths(device),
            [(k_cache[:, :, :s, :], v_cache[:, :, :s, :]), (k_seq_major, v_dim_major)],
        ):
            out = decode_attention_custom(q, kk, vv, mask="causal")
            check(out, expected, mx.bfloat16, label=path)


def data_address(a: mx.array) -> int:
    """Where `a`'s data lives (the buffer protocol shares it; bf16 through a same-size view)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.array(a, copy=False).__array_interface__["data"][0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_fully_written(device, dtype):
    """Free NaN-filled blocks of the output's size just before each call: the allocator hands
    one back as the output, and no NaN may survive in it. MLX's allocator (CPU, Metal, CUDA's
    managed outputs) is checked by address; CUDA's own output blocks by its counters."""
    # S=200 keeps CUDA's allocation at the output's size (no split workspace) for the tensor-core
    # schedule. float32 takes the SIMT one: on the H200 its output never landed on a poisoned
    # block of MLX's allocator, neither at S=200 (split: output and workspace in one allocation)
    # nor at S=60 (unsplit, c4fc9c8; why is not known), so that case would prove nothing.
    on_cuda = device == mx.gpu and mx.cuda.is_available()
    if on_cuda and dtype == mx.float32:
        pytest.skip("CUDA float32: the allocator was never seen reusing the block (H200)")
    q, k, v, _ = make_inputs(5, 1, 32, 8, 1, 200, 128, dtype, "none")
    mx.eval(q, k, v)
    with mx.stream(device):
        if on_cuda:
            written_over_own_blocks(q, k, v)
            with managed_outputs():
                written_over_mlx_blocks(q, k, v)
        else:
            written_over_mlx_blocks(q, k, v)


def written_over_mlx_blocks(q, k, v):
    reused = 0
    for _ in range(10):
        # MLX's buffer cache hands out the oldest cached buffer of a size first: empty it so
        # that the poisoned blocks are the only ones of the output's size.
        mx.clear_cache()
        poison = [mx.full(q.shape, mx.nan, dtype=q.dtype) for _ in range(4)]
        poisoned_at = {data_address(p) for p in poison}
        del poison
        mx.synchronize()  # the GPU backends release buffers when their commands complete
        out = decode_attention_custom(q, k, v)
        mx.eval(out)
        reused += data_address(out) in poisoned_at
        assert not mx.any(mx.isnan(out)).item()
    assert reused, "the NaN-filled block was never reused: the test would prove nothing"
    check(out, attention_f64(q, k, v), q.dtype)


def written_over_own_blocks(q, k, v):
    """CUDA's output blocks (attn_kernels.output_memory) are poisoned by our op itself: a NaN
    query gives NaN rows (the contract). Its cache hands back the block freed last, so no new
    allocation proves the output landed on a poisoned one (reading an address would move it)."""
    from attn_kernels import output_memory

    nan_query = mx.full(q.shape, mx.nan, dtype=q.dtype)
    base = output_memory()["live_bytes"]
    reused = 0
    for _ in range(10):
        out = None  # the last call's output goes back first, then the poisoned blocks on top
        poison = [decode_attention_custom(nan_query, k, v) for _ in range(4)]
        assert mx.all(mx.isnan(mx.stack(poison))).item()
        del poison
        assert settled(lambda: output_memory()["live_bytes"] <= base), output_memory()
        before = output_memory()["allocations"]
        out = decode_attention_custom(q, k, v)
        mx.eval(out)
        reused += output_memory()["allocations"] == before
        assert not mx.any(mx.isnan(out)).item()
    assert reused, "no output came from a poisoned block: the test would prove nothing"
    check(out, attention_f64(q, k, v), q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [mx.bool_, mx.float32, mx.bfloat16])
def test_fully_masked_rows_are_zero(device, mask_dtype):
    """A row whose mask removes every key is defined as zeros (the oracle agrees)."""
    q, k, v, _ = make_inputs(9, 1, 4, 2, 3, 40, 32, mx.float32, "none")
    keep = np.ones((1, 4, 3, 40), dtype=bool)
    keep[0, 1, 2, :] = False  # head 1, row 2: nothing visible
    keep[0, 3, 0, :20] = False
    if mask_dtype == mx.bool_:
        mask = mx.array(keep)
    else:
        mask = mx.array(np.where(keep, 0.0, -np.inf)).astype(mask_dtype)
    with mx.stream(device):
        out = decode_attention_custom(q, k, v, mask=mask)
        oracle = scaled_dot_product_attention(q, k, v, mask=mask)
    expected = attention_f64(q, k, v, mask=mask)
    assert np.all(expected[0, 1, 2] == 0.0)
    check(out, expected, mx.float32)
    check(oracle, expected, mx.float32, oracle_on=device)
    assert np.all(to_numpy(out)[0, 1, 2] == 0.0)
    assert np.all(to_numpy(oracle)[0, 1, 2] == 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_mask(device):
    q, k, v, _ = make_inputs(3, 2, 4, 1, 2, 33, 16, mx.float32, "none")
    mask = mx.random.normal((1, 1, 2, 33))
    with mx.stream(device):
        out = decode_attention_custom(q, k, v, mask=mask)
    check(out, attention_f64(q, k, v, mask=mask), mx.float32)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    length=st.integers(1, 5),
    extra=st.integers(0, 90),
    d=st.integers(1, 140),
    dtype=st.sampled_from(DTYPES),
    mask_kind=st.sampled_from(["none", "causal", "explicit"]),
    seed=st.integers(0, 2**16),
)
def test_property_against_float64(batch, kv_heads, group, length, extra, d, dtype, mask_kind, seed):
    s = length + extra
    q, k, v, mask = make_inputs(
        seed, batch, kv_heads * group, kv_heads, length, s, d, dtype, mask_kind
    )
    out = decode_attention_custom(q, k, v, mask=mask, stream=mx.cpu)
    check(out, attention_f64(q, k, v, mask=mask), dtype)


def own_output_bytes() -> int:
    """Bytes our CUDA outputs hold in the extension's own blocks, which MLX's counters miss."""
    from attn_kernels import output_memory

    state = output_memory()
    return state["live_bytes"] if state else 0


def test_no_score_sized_intermediates():
    """At L=8, S=32768 the oracle's float32 scores are 8 MiB per head group; the kernel allocates
    little beyond its output: on a GPU the split's partial states (split-mma-16 here, 16 chunks:
    8 KV heads x 32 vectors x 16 x 132 floats, 2.1 MiB), an eighth of the scores."""
    q, k, v, _ = make_inputs(0, 1, 32, 8, 8, 32768, 128, mx.bfloat16, "none")
    mx.eval(q, k, v)
    scores_bytes = 32 * 8 * 32768 * 4
    for fn, bound in [
        (decode_attention_custom, scores_bytes // 8),
        (scaled_dot_product_attention, None),
    ]:
        mx.clear_cache()
        mx.reset_peak_memory()
        before, own_before = mx.get_active_memory(), own_output_bytes()
        out = fn(q, k, v, mask="causal")
        mx.eval(out)
        extra = mx.get_peak_memory() - before + own_output_bytes() - own_before
        if bound is None:
            assert extra >= scores_bytes  # the oracle does build them: the measurement sees them
        else:
            assert extra <= bound, f"custom kernel allocated {extra} bytes"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("length", "s"), [(1, 1), (1, 200), (8, 100), (1, 4100), (8, 3000)])
def test_output_over_a_donated_query(device, length, s):
    """A query that nothing else holds (a decode step's q, made in the same graph) becomes the
    output's buffer on CUDA in unsplit calls, as in MLX's own SDPA: the result is still right for
    every schedule, and there the call allocates nothing beyond the query (one buffer, not two:
    the query's size is a multiple of the allocator's rounding)."""
    dtype = mx.bfloat16
    mask = "causal" if length > 1 else None
    q, k, v, _ = make_inputs(s + length, 1, 32, 8, length, s, 128, dtype, "none")
    mx.eval(q, k, v)
    expected = attention_f64(q * 2, k, v, mask=mask)  # * 2 is exact in bf16
    donated = set()
    with mx.stream(device):
        for schedule in schedules(device):
            # Free the previous output before `before`: freed while this call is built, its
            # buffer would serve this call's q * 2 and hide that allocation (on CUDA, extra = 8).
            out = None
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before, own_before = mx.get_active_memory(), own_output_bytes()
            out = decode_attention_custom(q * 2, k, v, mask=mask, schedule=schedule)
            mx.eval(out)
            mx.synchronize()
            extra = mx.get_peak_memory() - before + own_output_bytes() - own_before
            check(out, expected, dtype, label=f"schedule={schedule}")
            assert extra >= out.nbytes, (schedule, extra)  # the query q * 2 at least
            if extra < 2 * out.nbytes:
                donated.add(schedule)
    if device == mx.gpu and mx.cuda.is_available() and s <= 256:
        # Unsplit here: the chapter's schedules always, split-mma up to 4 steps of 64 positions,
        # auto (split-mma, or `split` at S = 1). `split`/`split-gqa` split from ~S = 64.
        unsplit = {"auto", "split-mma", "split-mma-16", "chapter-8", "chapter-16", "chapter-32"}
        assert unsplit <= donated, f"not donated: {sorted(unsplit - donated)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [100, 2100])
def test_non_finite_inputs_match_readable_path(device, dtype, s):
    """NaN or inf in q, k, v, scale or mask: what the readable path gives (a NaN score makes its
    row NaN; +inf in q makes scores of both signs, so NaN), on every CPU path; a row whose mask
    removes every key stays zeros. s = 2100: the context is split over threads."""
    length, hq, hkv, d = 2, 8, 2, 64
    q, k, v, _ = make_inputs(s + 5, 1, hq, hkv, length, s, d, dtype, "none")
    mask = mx.random.normal((1, hq, length, s), key=mx.random.key(s))
    cases = {
        "q nan": dict(q=q.at[0, 1, 1, 3].add(mx.nan)),
        "k nan": dict(k=k.at[0, 0, s // 2, 0].add(mx.nan)),
        "v nan": dict(v=v.at[0, 1, s // 3, d - 1].add(mx.nan)),
        "q inf": dict(q=q.at[0, 0, 0, 0].add(mx.inf)),
        "scale nan": dict(scale=float("nan")),
        "mask nan": dict(mask=mask.at[0, 2, 0, s // 4].add(mx.nan)),
        "mask -inf row": dict(mask=mask.at[0, 3, 1, :].add(-mx.inf)),
    }
    for name, change in cases.items():
        args = dict(q=q, k=k, v=v, scale=None, mask=None) | change
        q_, k_, v_ = args.pop("q"), args.pop("k"), args.pop("v")
        with mx.stream(device):
            readable = to_numpy(scaled_dot_product_attention(q_, k_, v_, **args))
            for path in kernel_paths(device):
                out = to_numpy(decode_attention_custom(q_, k_, v_, **args))
                label = f"{name} {path}"
                assert np.isnan(readable).any() or name == "mask -inf row", label
                np.testing.assert_array_equal(np.isnan(out), np.isnan(readable), err_msg=label)
                finite = ~np.isnan(readable)
                tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
                if dtype == mx.float32 and device == mx.gpu:
                    # MLX's CUDA matmuls take float32 through TF32: the readable path is off by
                    # ~1e-4 there (H200: 3e-4 at most), ours is not.
                    tol = {"rtol": 2e-3, "atol": 2e-3}
                np.testing.assert_allclose(out[finite], readable[finite], **tol, err_msg=label)


def test_cpu_path_choice():
    """ATTN_KERNELS_CPU_PATH: each supported name is taken; a path the CPU lacks or an unknown
    name is refused with a ValueError that names the variable, at evaluation."""
    q = mx.zeros((1, 2, 1, 32))
    k = mx.zeros((1, 1, 8, 32))
    for path in kernel_paths(mx.cpu):
        assert _ext.cpu_path() == path
    lacking = {"x86_64": "neon", "aarch64": "avx512", "arm64": "avx512"}.get(platform.machine())
    for bad in ["sse9"] + ([lacking] if lacking else []):
        os.environ["ATTN_KERNELS_CPU_PATH"] = bad
        try:
            with pytest.raises(ValueError, match=f"ATTN_KERNELS_CPU_PATH={bad}"):
                _ext.cpu_path()
            with pytest.raises(ValueError, match=f"ATTN_KERNELS_CPU_PATH={bad}"):
                mx.eval(decode_attention_custom(q, k, k, stream=mx.cpu))
        finally:
            os.environ.pop("ATTN_KERNELS_CPU_PATH")


def test_cpu_pool_settings():
    """ATTN_KERNELS_POOL_SPIN_US (how long the pool's workers poll before sleeping) and
    ATTN_KERNELS_POOL_PREWAKE_US (workers woken when the op is evaluated) change no result: a
    shape big enough for the pool, evaluated back to back and one at a time, against float64
    under each setting; a value that is not microseconds in [0, 1e6] is refused with a
    ValueError naming the variable, at evaluation."""
    rng = np.random.default_rng(23)
    # 8 KV rows x 1100 positions x 4 query vectors x 128 > 2^22 multiply-adds: split over the pool.
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32))
        for shape in ((1, 32, 1, 128), (1, 8, 1100, 128), (1, 8, 1100, 128))
    )
    expected = attention_f64(q, k, v)
    variables = ("ATTN_KERNELS_POOL_SPIN_US", "ATTN_KERNELS_POOL_PREWAKE_US")
    try:
        for spin, prewake in [("0", "0"), ("0.5", "0"), ("200", "0"), ("0", "300"), ("50", "300")]:
            os.environ.update(dict(zip(variables, (spin, prewake), strict=True)))
            outs = [decode_attention_custom(q, k, v, stream=mx.cpu) for _ in range(3)]
            mx.eval(outs)
            outs.append(decode_attention_custom(q, k, v, stream=mx.cpu))
            for out in outs:
                np.testing.assert_allclose(to_numpy(out), expected, **TOLERANCE[mx.float32])
        for variable in variables:
            for bad in ["fast", "-1", "2e6", "nan"]:
                os.environ[variable] = bad
                with pytest.raises(ValueError, match=f"{variable}={bad}"):
                    mx.eval(decode_attention_custom(q, k, v, stream=mx.cpu))
                os.environ[variable] = "0"
    finally:
        for variable in variables:
            os.environ.pop(variable, None)


def test_cpu_split_settings():
    """ATTN_KERNELS_CALL_THREADS (pool threads per call) and ATTN_KERNELS_CPU_UNITS_PER_THREAD
    (the context split's target) change no result: a pool-sized shape (S = 1100, not a multiple
    of 32) on one thread and on the pool in 1 to 4 context chunks (2 threads), against float64;
    values out of range are refused with a ValueError naming the variable, at evaluation. (The
    C++ check, make test-cpu-kernel, runs calls on part of a 4-thread pool.)"""
    import attn_kernels._ext as ext

    rng = np.random.default_rng(29)
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32))
        for shape in ((1, 32, 1, 128), (1, 8, 1100, 128), (1, 8, 1100, 128))
    )
    expected = attention_f64(q, k, v)
    pool = str(ext.cpu_threads())
    variables = ("ATTN_KERNELS_CALL_THREADS", "ATTN_KERNELS_CPU_UNITS_PER_THREAD")
    try:
        for threads, units in [("1", "8"), (pool, "1"), (pool, "3"), ("", "64"), (pool, "")]:
            os.environ.update(dict(zip(variables, (threads, units), strict=True)))
            out = decode_attention_custom(q, k, v, stream=mx.cpu)
            np.testing.assert_allclose(to_numpy(out), expected, **TOLERANCE[mx.float32])
        for variable, bad in [
            (variables[0], "0"),
            (variables[0], str(ext.cpu_threads() + 1)),
            (variables[0], "two"),
            (variables[1], "65"),
            (variables[1], "-1"),
            (variables[1], "4.5"),
        ]:
            os.environ[variable] = bad
            with pytest.raises(ValueError, match=f"{variable}={bad}"):
                mx.eval(decode_attention_custom(q, k, v, stream=mx.cpu))
            os.environ[variable] = ""
    finally:
        for variable in variables:
            os.environ.pop(variable, None)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or sys.platform != "linux" or shutil.which("objdump") is None,
    reason="the AVX-512 path (and its prefetch) is built on x86-64 Linux only; needs objdump",
)
def test_cpu_kernel_build_contains_prefetch():
    """GCC 12 once deleted the kernel's _mm_prefetch loops as dead code, silently (every result
    stays right; only streaming from DRAM got slower): the built extension must hold them."""
    import attn_kernels._ext as ext

    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", ext.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "prefetcht1" in listing
