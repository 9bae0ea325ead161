"""attention_step (AttentionStep) against the unfused chain (mx.fast RMSNorm and RoPE, slice
update, decode_attention_custom) and a float64 step, on every backend here, with q/k norms
(Qwen3) and without (Llama, Qwen2); cache donation."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import attention_step, attention_step_cache_copies, attention_step_folds
from conftest import TOLERANCE
from reference import to_numpy
from step_reference import make_step, ring_step_f64, step_f64, unfused_step
from tiers import few_rows

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
EPS, BASE = 1e-6, 1_000_000.0  # Qwen3's
CAPACITY_STEP = 256  # qwen3_model.cache.KVCache.step


def _gpu_available() -> bool:
    return mx.cuda.is_available() or mx.metal.is_available()


DEVICES = [
    pytest.param(mx.cpu, id="cpu"),
    pytest.param(
        mx.gpu,
        id="gpu",
        marks=pytest.mark.skipif(not _gpu_available(), reason="this MLX has no GPU backend"),
    ),
]


def capacity_for(end):
    return -(-end // CAPACITY_STEP) * CAPACITY_STEP


def check_step(inputs, offset, device, label, scale=None, owned_caches=False, base=BASE):
    """The op against the unfused chain and float64; base: the RoPE base, or the periods (a
    list: rope_freqs)."""
    q, k_cache, v_cache = inputs[0], inputs[5], inputs[6]
    dtype, length = q.dtype, q.shape[1]
    before_k, before_v = to_numpy(k_cache), to_numpy(v_cache)
    rope = dict(rope_base=base) if isinstance(base, float) else dict(rope_freqs=base)
    out, new_k, new_v = attention_step(
        *inputs,
        offset,
        eps=EPS,
        scale=scale,
        owned_caches=owned_caches,
        stream=device,
        **rope,
    )
    mx.eval(out, new_k, new_v)
    chain = unfused_step(*inputs, offset, EPS, base, scale)
    expected, exp_k, exp_v = step_f64(*inputs, offset, EPS, base, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert new_k.shape == k_cache.shape and new_v.shape == v_cache.shape
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(to_numpy(out), expected, **tol, err_msg=label + " vs float64")
    np.testing.assert_allclose(
        to_numpy(out), to_numpy(chain[0]), **tol, err_msg=label + " vs the unfused chain"
    )
    # The new positions as the chain writes them (one rounding apart in half precision). In
    # float32 the angle itself (float32 position x frequency, as MLX forms it) moves by an ulp of
    # the position (3e-5 rad at 300) when exp2 rounds the frequency the other way; the rest of
    # the caches intact.
    end = offset + length
    got_k, got_v = to_numpy(new_k), to_numpy(new_v)
    key_tol = dict(atol=2e-4, rtol=2e-4) if dtype == mx.float32 else TOLERANCE[dtype]
    np.testing.assert_allclose(
        got_k[:, :, offset:end],
        to_numpy(chain[1])[:, :, offset:end],
        **key_tol,
        err_msg=label + " new keys",
    )
    np.testing.assert_allclose(
        got_k[:, :, offset:end], exp_k[:, :, offset:end], **key_tol, err_msg=label + " keys f64"
    )
    np.testing.assert_array_equal(got_v[:, :, offset:end], exp_v[:, :, offset:end])
    for got, before in ((got_k, before_k), (got_v, before_v)):
        np.testing.assert_array_equal(got[:, :, :offset], before[:, :, :offset])
        np.testing.assert_array_equal(got[:, :, end:], before[:, :, end:])
    # The caller still holds the input caches, so they were copied and are unchanged.
    np.testing.assert_array_equal(to_numpy(k_cache), before_k)
    np.testing.assert_array_equal(to_numpy(v_cache), before_v)


# Offsets (and capacities as the model's cache grows them): first token, mid-block, the last
# positions of the first 256-position block, the first of the second, and further on.
def offsets_for(length):
    return [0, 100, CAPACITY_STEP - length, CAPACITY_STEP - 1, CAPACITY_STEP, 300]


GRID = [
    (dtype, heads, length, offset)
    for dtype, heads, length in itertools.product(DTYPES, [(4, 4), (8, 2), (32, 8)], [1, 3, 8])
    for offset in sorted(set(offsets_for(length)))
]


# The quick tier: every dtype and length, at the step that fills the last slot before the
# capacity boundary (Hq/Hkv 8/2) and past it (32/8).
GRID_QUICK = [
    (dtype, heads, length, offset)
    for dtype, heads, length, offset in GRID
    if (heads, offset) in (((8, 2), CAPACITY_STEP - length), ((32, 8), 300))
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,heads,length,offset",
    few_rows(GRID, *GRID_QUICK),
    ids=[f"{str(t).split('.')[-1]}-hq{h[0]}-hkv{h[1]}-L{n}-o{o}" for t, h, n, o in GRID],
)
def test_matches_chain(device, dtype, heads, length, offset):
    hq, hkv = heads
    capacity = capacity_for(offset + length)
    inputs = make_step(offset + length, 1, hq, hkv, length, 128, capacity, dtype)
    check_step(inputs, offset, device, f"D=128 Hq={hq} Hkv={hkv} L={length} offset={offset}")


def without_norms(inputs):
    """The same step for a model without q/k norm (Llama, Qwen2): both weights None."""
    q, k, v, _, _, k_cache, v_cache = inputs
    return q, k, v, None, None, k_cache, v_cache


# The norm-free step over a representative part of GRID: every dtype and length, two GQA
# shapes, offsets at the first token, mid-block and on both sides of the capacity boundary.
NORM_FREE_GRID = [
    (dtype, heads, length, offset)
    for dtype, heads, length in itertools.product(DTYPES, [(8, 2), (32, 8)], [1, 3, 8])
    for offset in sorted({0, 100, CAPACITY_STEP - length, CAPACITY_STEP, 300})
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,heads,length,offset",
    few_rows(NORM_FREE_GRID, *[r for r in NORM_FREE_GRID if r[1] == (32, 8) and r[3] == 256]),
    ids=[f"{str(t).split('.')[-1]}-hq{h[0]}-hkv{h[1]}-L{n}-o{o}" for t, h, n, o in NORM_FREE_GRID],
)
def test_without_norms_matches_chain(device, dtype, heads, length, offset):
    hq, hkv = heads
    capacity = capacity_for(offset + length)
    inputs = without_norms(make_step(offset + length, 1, hq, hkv, length, 128, capacity, dtype))
    label = f"no norm D=128 Hq={hq} Hkv={hkv} L={length} offset={offset}"
    check_step(inputs, offset, device, label)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("length", [1, 5])
def test_without_norms_head_dims_and_batch(device, dtype, d, length):
    """No q/k norm at D = 64 and 80, batch 2, a scale other than 1/sqrt(D), and an eps the
    normalising op would refuse (0: unused without norms)."""
    inputs = without_norms(make_step(d + length, 2, 8, 2, length, d, 512, dtype))
    out, _, _ = attention_step(*inputs, 7, eps=0.0, rope_base=BASE, scale=0.1, stream=device)
    mx.eval(out)
    check_step(inputs, 260, device, f"no norm D={d} L={length} B=2", scale=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_norms_change_the_result(device):
    """The flag reaches the kernel: the same projections with unit norm weights (RMSNorm still
    rescales each head) and without norms give different outputs and keys, each its oracle's."""
    inputs = make_step(11, 1, 8, 2, 1, 64, 256, mx.float32)
    q, k, v, _, _, k_cache, v_cache = inputs
    ones = mx.ones((64,), mx.float32)
    normed = (q, k, v, ones, ones, k_cache, v_cache)
    results = []
    for args in (normed, without_norms(inputs)):
        out, new_k, _ = attention_step(*args, 40, eps=EPS, rope_base=BASE, stream=device)
        expected, exp_k, _ = step_f64(*args, 40, EPS, BASE)
        np.testing.assert_allclose(to_numpy(out), expected, atol=4e-5, rtol=4e-5)
        np.testing.assert_allclose(to_numpy(new_k)[:, :, 40], exp_k[:, :, 40], atol=2e-4)
        results.append((to_numpy(out), to_numpy(new_k)[:, :, 40]))
    assert np.abs(results[0][1] - results[1][1]).max() > 0.1
    assert np.abs(results[0][0] - results[1][0]).max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("length", [1, 5])
def test_head_dims_and_batch(device, dtype, d, length):
    """D = 64, 128 and 80 (not a multiple of 32); batch 2; a scale other than 1/sqrt(D)."""
    inputs = make_step(d + length, 2, 8, 2, length, d, 512, dtype)
    check_step(inputs, 260, device, f"D={d} L={length} B=2", scale=0.1)


def llama3_periods(d, base=500000.0, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3's scaled RoPE periods (mlx-lm's Llama3RoPE), in float64: long wavelengths
    stretched by factor, short ones kept, the band between blended."""
    periods = base ** (np.arange(0, d, 2) / d)
    wavelengths = 2 * np.pi * periods
    smooth = (original / wavelengths - low) / (high - low)
    blended = periods / ((1 - smooth) / factor + smooth)
    scaled = np.where(wavelengths > original / low, periods * factor, periods)
    middle = (wavelengths > original / high) & (wavelengths < original / low)
    return [float(p) for p in np.where(middle, blended, scaled)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("offset", [300, 9000])
def test_rope_periods(device, dtype, d, offset):
    """rope_freqs (each pair's period: Llama 3's scaled frequencies) against mx.fast.rope with the
    same freqs and float64, at a short and a long position; the base's own periods give what
    rope_base gives."""
    inputs = make_step(d + offset, 1, 8, 2, 3, d, capacity_for(offset + 3), dtype)
    check_step(inputs, offset, device, f"llama3 D={d}", base=llama3_periods(d))
    plain = [BASE ** (2 * j / d) for j in range(d // 2)]
    with mx.stream(device):
        by_base = attention_step(*inputs, offset, eps=EPS, rope_base=BASE)[0]
        by_periods = attention_step(*inputs, offset, eps=EPS, rope_freqs=mx.array(plain))[0]
    # 1 / period and the base's power may round a frequency an ulp apart, which at position 9000
    # moves an angle by up to ~1e-3 rad (float32: check_step's key tolerance)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == mx.float32 else TOLERANCE[dtype]
    np.testing.assert_allclose(to_numpy(by_periods), to_numpy(by_base), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_views(device, dtype):
    """q/k/v as slices of one fused projection, caches as views: a slice of a larger buffer
    (keys) and heads-last storage transposed (values). Neither cache can be donated."""
    b, hq, hkv, length, d, capacity, offset = 1, 8, 2, 3, 64, 256, 200
    q, k, v, q_w, k_w, k_cache, v_cache = make_step(7, b, hq, hkv, length, d, capacity, dtype)
    qkv = mx.concatenate([q, k, v], axis=-1)
    q_view = qkv[..., : hq * d]
    k_view = qkv[..., hq * d : (hq + hkv) * d]
    v_view = qkv[..., (hq + hkv) * d :]
    big = mx.concatenate([k_cache, mx.zeros_like(k_cache)], axis=2)
    k_cache_view = big[:, :, :capacity]
    v_cache_view = mx.array(v_cache.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    mx.eval(qkv, big, v_cache_view)
    check_step(
        (q_view, k_view, v_view, q_w, k_w, k_cache_view, v_cache_view), offset, device, "views"
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
def test_decode_loop_donates(device, dtype):
    """A decode loop that keeps only the returned caches updates them in place: the same buffer
    every step, no copy counted; the outputs match a chain run on the same inputs. Across the
    capacity boundary the caller grows the caches (as KVCache does), which costs one copy."""
    b, hq, hkv, d = 1, 8, 2, 64
    q_w = (1.0 + 0.2 * mx.random.normal((d,), key=mx.random.key(1))).astype(dtype)
    k_w = (1.0 + 0.2 * mx.random.normal((d,), key=mx.random.key(2))).astype(dtype)
    k_cache = mx.zeros((b, hkv, CAPACITY_STEP, d), dtype)
    v_cache = mx.zeros((b, hkv, CAPACITY_STEP, d), dtype)
    chain_k, chain_v = mx.array(k_cache), mx.array(v_cache)
    mx.eval(k_cache, v_cache, chain_k, chain_v, q_w, k_w)

    first = address(k_cache)
    offset = 0
    for step in range(8):
        length = 4 if step == 0 else 1
        offset = CAPACITY_STEP - 3 if step == 2 else offset
        keys = mx.random.split(mx.random.key(100 + step), 3)
        q = mx.random.normal((b, length, hq * d), key=keys[0]).astype(dtype)
        k = mx.random.normal((b, length, hkv * d), key=keys[1]).astype(dtype)
        v = mx.random.normal((b, length, hkv * d), key=keys[2]).astype(dtype)
        if offset + length > k_cache.shape[2]:  # grow, as KVCache does (a new buffer)
            pad = mx.zeros((b, hkv, CAPACITY_STEP, d), dtype)
            k_cache = mx.concatenate([k_cache, pad], axis=2)
            v_cache = mx.concatenate([v_cache, pad], axis=2)
            chain_k = mx.concatenate([chain_k, pad], axis=2)
            chain_v = mx.concatenate([chain_v, pad], axis=2)
            mx.eval(k_cache, v_cache)
            first = address(k_cache)
        copies = attention_step_cache_copies()
        out, k_cache, v_cache = attention_step(
            q, k, v, q_w, k_w, k_cache, v_cache, offset, eps=EPS, rope_base=BASE, stream=device
        )
        mx.eval(out)
        assert attention_step_cache_copies() == copies, f"step {step} copied a cache"
        assert address(k_cache) == first, f"step {step}: a new key buffer"
        expected, chain_k, chain_v = unfused_step(
            q, k, v, q_w, k_w, chain_k, chain_v, offset, EPS, BASE
        )
        tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
        np.testing.assert_allclose(to_numpy(out), to_numpy(expected), **tol)
        key_tol = dict(atol=2e-4, rtol=2e-4) if dtype == mx.float32 else TOLERANCE[dtype]
        np.testing.assert_allclose(to_numpy(k_cache), to_numpy(chain_k), **key_tol)
        np.testing.assert_array_equal(to_numpy(v_cache), to_numpy(chain_v))
        offset += length


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("owned", [False, True], ids=["shared", "owned"])
def test_held_cache_is_copied(device, owned):
    """A cache the caller still holds is copied (counted) and left as it was, owned_caches or
    not (it promises only that views of the caches are not read past the offset)."""
    inputs = make_step(3, 1, 4, 2, 1, 64, 256, mx.float16)
    copies = attention_step_cache_copies()
    check_step(inputs, 17, device, "held", owned_caches=owned)
    assert attention_step_cache_copies() == copies + 2


def address(a):
    view = np.array(a, copy=False)
    address = view.__array_interface__["data"][0]
    del view
    return address


def step_inputs(seed, b, hq, hkv, length, d, dtype):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((b, length, hq * d), key=keys[0]).astype(dtype)
    k = mx.random.normal((b, length, hkv * d), key=keys[1]).astype(dtype)
    v = mx.random.normal((b, length, hkv * d), key=keys[2]).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("owned", [False, True], ids=["shared", "owned"])
def test_view_of_the_written_positions(device, owned):
    """A buffer shared by another array but no other holder of the cache array itself: what an
    evaluated view leaves, and what MLX leaves while an earlier step that read the cache still
    runs. MLX's rule copies; owned_caches updates in place, and the view, which covers only
    the positions before the offset, still reads what it read."""
    b, hq, hkv, length, d, offset = 1, 8, 2, 3, 64, 37
    *head, k_cache, v_cache = make_step(5, b, hq, hkv, length, d, CAPACITY_STEP, mx.float16)
    chain = unfused_step(*head, k_cache, v_cache, offset, EPS, BASE, None)
    mx.eval(chain)
    views = (k_cache[:, :, :offset], v_cache[:, :, :offset])
    mx.eval(views)
    before = [to_numpy(x) for x in views]
    first = address(k_cache), address(v_cache)
    copies = attention_step_cache_copies()
    out, k_cache, v_cache = attention_step(
        *head,
        k_cache,
        v_cache,
        offset,
        eps=EPS,
        rope_base=BASE,
        owned_caches=owned,
        stream=device,
    )
    mx.eval(out, k_cache, v_cache)
    assert attention_step_cache_copies() == copies + (0 if owned else 2)
    assert ((address(k_cache), address(v_cache)) == first) == owned
    tol = {key: 2 * value for key, value in TOLERANCE[mx.float16].items()}
    np.testing.assert_allclose(to_numpy(out), to_numpy(chain[0]), **tol)
    np.testing.assert_allclose(to_numpy(k_cache), to_numpy(chain[1]), **TOLERANCE[mx.float16])
    np.testing.assert_array_equal(to_numpy(v_cache), to_numpy(chain[2]))
    for view, was in zip(views, before, strict=True):
        np.testing.assert_array_equal(to_numpy(view), was)


@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_loop_owned_caches(device):
    """mlx-lm's pipelining: step n+1 is evaluated while step n still runs (a long context keeps
    it running). MLX holds step n's buffers until it completes, so its rule copies the next
    step's caches (on the CPU the first loop shows it: the test's precondition); with
    owned_caches nothing is copied, every step writes the first buffers, and the outputs and
    caches are the unfused chain's."""
    b, hq, hkv, length, d, dtype = 1, 8, 2, 8, 64, mx.float16
    capacity, steps = 32768, 4
    start = capacity - steps * length - 5
    _, _, _, q_w, k_w, k_base, v_base = make_step(9, b, hq, hkv, length, d, capacity, dtype)
    tokens = [step_inputs(300 + i, b, hq, hkv, length, d, dtype) for i in range(steps)]
    mx.eval(tokens)
    copies, outs = {}, []
    for owned in (False, True):
        k_cache, v_cache = k_base + 0, v_base + 0  # buffers of their own
        mx.eval(k_cache, v_cache)
        first = address(k_cache), address(v_cache)
        before = attention_step_cache_copies()
        outs = []
        for i, (q, k, v) in enumerate(tokens):
            out, k_cache, v_cache = attention_step(
                q,
                k,
                v,
                q_w,
                k_w,
                k_cache,
                v_cache,
                start + i * length,
                eps=EPS,
                rope_base=BASE,
                owned_caches=owned,
                stream=device,
            )
            mx.async_eval(out)
            outs.append(out)
        mx.eval(outs, k_cache, v_cache)
        copies[owned] = attention_step_cache_copies() - before
        if owned:
            assert (address(k_cache), address(v_cache)) == first
    if device == mx.cpu:
        assert copies[False] > 0, "no step was in flight: the test missed its subject"
    assert copies[True] == 0
    chain_k, chain_v = k_base, v_base
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    for i, (q, k, v) in enumerate(tokens):
        expected, chain_k, chain_v = unfused_step(
            q, k, v, q_w, k_w, chain_k, chain_v, start + i * length, EPS, BASE
        )
        np.testing.assert_allclose(
            to_numpy(outs[i]), to_numpy(expected), **tol, err_msg=f"step {i}"
        )
    np.testing.assert_allclose(to_numpy(k_cache), to_numpy(chain_k), **TOLERANCE[dtype])
    np.testing.assert_array_equal(to_numpy(v_cache), to_numpy(chain_v))


def bad(**changes):
    dtype = mx.float16
    args = dict(
        q=mx.zeros((1, 2, 4 * 64), dtype),
        k=mx.zeros((1, 2, 2 * 64), dtype),
        v=mx.zeros((1, 2, 2 * 64), dtype),
        q_norm_weight=mx.ones((64,), dtype),
        k_norm_weight=mx.ones((64,), dtype),
        k_cache=mx.zeros((1, 2, 256, 64), dtype),
        v_cache=mx.zeros((1, 2, 256, 64), dtype),
        offset=10,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(q=mx.zeros((1, 2, 4, 64), mx.float16)), "q must have shape"),
        (dict(k=mx.zeros((1, 2, 3 * 64), mx.float16)), "k and v must have shape"),
        (dict(v=mx.zeros((1, 2, 128), mx.float32)), "v must have q's dtype"),
        (dict(q=mx.zeros((1, 2, 256), mx.int32)), "q must be float32"),
        (dict(q=mx.zeros((1, 2, 250), mx.float16)), "not a multiple of head_dim"),
        (dict(q=mx.zeros((1, 2, 3 * 64), mx.float16)), "multiple of the caches' key/value"),
        (dict(q_norm_weight=mx.ones((1, 64), mx.float16)), "q_norm_weight must have shape"),
        (dict(k_norm_weight=mx.ones((32,), mx.float16)), "must have the same size"),
        (
            dict(
                q_norm_weight=mx.ones((63,), mx.float16),
                k_norm_weight=mx.ones((63,), mx.float16),
            ),
            "must be even",
        ),
        (dict(k_cache=mx.zeros((1, 2, 256), mx.float16)), "k_cache must have shape"),
        (dict(v_cache=mx.zeros((1, 2, 128, 64), mx.float16)), "must have the same shape"),
        (
            dict(k_cache=mx.zeros((1, 2, 256, 32)), v_cache=mx.zeros((1, 2, 256, 32))),
            "k_cache must have q's dtype",
        ),
        (
            dict(
                k_cache=mx.zeros((1, 2, 256, 32), mx.float16),
                v_cache=mx.zeros((1, 2, 256, 32), mx.float16),
            ),
            "head_dim 32 differs",
        ),
        (
            dict(
                k_cache=mx.zeros((2, 2, 256, 64), mx.float16),
                v_cache=mx.zeros((2, 2, 256, 64), mx.float16),
            ),
            "batch 2 differs",
        ),
        (dict(offset=255), "offset \\+ length must fit"),
        (dict(offset=-1), "offset \\+ length must fit"),
        (dict(q=mx.zeros((1, 0, 256), mx.float16)), "at least one position"),
    ],
)
def test_bad_inputs(changes, message):
    with pytest.raises(ValueError, match=message):
        attention_step(**bad(**changes), eps=EPS, rope_base=BASE)


def test_bad_schedule_and_constants():
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        attention_step(**bad(), eps=EPS, rope_base=BASE, schedule="fast")
    with pytest.raises(ValueError, match="eps must be positive"):
        attention_step(**bad(), eps=0.0, rope_base=BASE)
    with pytest.raises(ValueError, match="eps is needed with the norm weights"):
        attention_step(**bad(), rope_base=BASE)
    for norms in ({}, dict(q_norm_weight=None, k_norm_weight=None)):
        with pytest.raises(ValueError, match="rope_base must be positive"):
            attention_step(**bad(**norms), eps=EPS, rope_base=-1.0)
    for rope, message in (
        ({}, "exactly one of rope_base and rope_freqs"),
        (dict(rope_base=BASE, rope_freqs=[1.0] * 32), "exactly one of rope_base and rope_freqs"),
        (dict(rope_freqs=[1.0] * 3), "rope_freqs must hold head_dim / 2 = 32 periods, got 3"),
        (dict(rope_freqs=[1.0] * 31 + [0.0]), "rope_freqs must be positive and finite"),
        (dict(rope_freqs=mx.ones((2, 2))), "rope_freqs must be one-dimensional"),
    ):
        with pytest.raises(ValueError, match=message):
            attention_step(**bad(), eps=EPS, **rope)


def test_fold_is_a_cuda_choice():
    """fold picks CUDA's kernels: on the CPU True, False and None give the same bits and no step
    is counted as folded."""
    offset, capacity = 61, 128
    inputs = make_step(5, 1, 8, 2, 3, 64, capacity, mx.bfloat16)
    folds = attention_step_folds()
    results = []
    for fold in (None, False, True):
        out = attention_step(*inputs, offset, eps=EPS, rope_base=BASE, fold=fold, stream=mx.cpu)
        results.append([to_numpy(x) for x in out])
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(got, want)
    assert attention_step_folds() == folds


@pytest.mark.parametrize("missing", ["q_norm_weight", "k_norm_weight"])
def test_one_norm_weight_alone(missing):
    """Both norm weights or neither: the error names the one that is None."""
    given = "k_norm_weight" if missing == "q_norm_weight" else "q_norm_weight"
    with pytest.raises(ValueError, match=f"{missing} is None while {given} is not"):
        attention_step(**bad(**{missing: None}), eps=EPS, rope_base=BASE)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(k_cache=mx.zeros((1, 2, 256, 63)), v_cache=mx.zeros((1, 2, 256, 63))), "even"),
        (dict(q=mx.zeros((1, 2, 250), mx.float16)), "not a multiple of head_dim"),
        (dict(k_cache=mx.zeros((1, 2, 256), mx.float16)), "k_cache must have shape"),
    ],
)
def test_bad_inputs_without_norms(changes, message):
    """Without norm weights head_dim is the caches' last size, checked as the weights' is."""
    changes = {key: a.astype(mx.float16) for key, a in changes.items()}
    args = bad(q_norm_weight=None, k_norm_weight=None, **changes)
    with pytest.raises(ValueError, match=message):
        attention_step(**args, rope_base=BASE)


def ring_chain(q, k, v, q_w, k_w, k_cache, v_cache, slot, position):
    """What mlx-lm runs on a wrapped RotatingKVCache: q/k norm, RoPE at the sequence position,
    the slice update at the ring's slot, mx.fast's attention over the whole window unmasked."""
    b, d = q.shape[0], k_cache.shape[-1]

    def heads(x, w):
        x = mx.fast.rms_norm(x.reshape(b, 1, -1, d), w, EPS).transpose(0, 2, 1, 3)
        return mx.fast.rope(x, d, traditional=False, base=BASE, scale=1.0, offset=position)

    ring_k, ring_v = mx.array(k_cache), mx.array(v_cache)
    ring_k[:, :, slot : slot + 1] = heads(k, k_w)
    ring_v[:, :, slot : slot + 1] = v.reshape(b, 1, -1, d).transpose(0, 2, 1, 3)
    out = mx.fast.scaled_dot_product_attention(heads(q, q_w), ring_k, ring_v, scale=d**-0.5)
    return out.transpose(0, 2, 1, 3).reshape(q.shape)


# (dtype, Hq/Hkv, D, window, slot, position): mlx-lm's RotatingKVCache once wrapped, windows that
# are not multiples of 32, slots at the ring's first, a middle and its last position.
RING = [
    (mx.bfloat16, (8, 4), 256, 37, 0, 37),  # Gemma 3's heads and head dim
    (mx.bfloat16, (8, 4), 256, 37, 36, 1000),
    (mx.float16, (32, 8), 128, 300, 151, 4247),
    (mx.float32, (4, 4), 64, 129, 128, 128),  # the step that fills the window: slot = position
    (mx.float32, (6, 2), 80, 50, 7, 20007),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,heads,d,window,slot,position",
    few_rows(RING, RING[0], RING[2]),  # slots before the last: the whole ring is attended
    ids=[f"{str(r[0]).split('.')[-1]}-D{r[2]}-w{r[3]}-slot{r[4]}-p{r[5]}" for r in RING],
)
def test_ring(device, dtype, heads, d, window, slot, position):
    """A full ring (position): the new token rotated at its sequence position, written at its
    slot, attending every position of the caches, against float64 and against the chain mlx-lm
    runs there (mx.fast.rope at the position, a slice update at the slot, attention over the whole
    window unmasked); nothing else of the caches changes."""
    hq, hkv = heads
    inputs = make_step(window + slot, 1, hq, hkv, 1, d, window, dtype)
    before = [to_numpy(c) for c in inputs[5:]]
    out, new_k, new_v = attention_step(
        *inputs, slot, position=position, eps=EPS, rope_base=BASE, stream=device
    )
    expected, exp_k, exp_v = ring_step_f64(*inputs, slot, position, EPS, BASE)
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(to_numpy(out), expected, **tol, err_msg="vs float64")
    chain = ring_chain(*inputs, slot, position)
    np.testing.assert_allclose(to_numpy(out), to_numpy(chain), **tol, err_msg="vs the chain")
    key_tol = dict(atol=2e-4, rtol=2e-4) if dtype == mx.float32 else TOLERANCE[dtype]
    got_k, got_v = to_numpy(new_k), to_numpy(new_v)
    written = slice(slot, slot + 1)
    np.testing.assert_allclose(got_k[:, :, written], exp_k[:, :, written], **key_tol)
    np.testing.assert_array_equal(got_v[:, :, written], exp_v[:, :, written])
    for got, was in zip((got_k, got_v), before, strict=True):
        np.testing.assert_array_equal(got[:, :, :slot], was[:, :, :slot])
        np.testing.assert_array_equal(got[:, :, slot + 1 :], was[:, :, slot + 1 :])


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(position=5), "at least capacity - 1 = 255, got 5"),
        (dict(position=254), "at least capacity - 1 = 255, got 254"),
        (dict(position=-1), "position must be >= 0 \\(or None\\), got -1"),
        (dict(position=300.5), "position must be an int or None, got 300.5"),
        (dict(starts=[0]), "no per-row starts or offsets"),
        (dict(offset=[10]), "no per-row starts or offsets"),
    ],
)
def test_bad_ring(changes, message):
    """A ring's position: past every written slot, one token, no per-row ranges."""
    args = bad(q=mx.zeros((1, 1, 4 * 64), mx.float16), k=mx.zeros((1, 1, 2 * 64), mx.float16))
    args["v"] = args["k"]
    args.update({"position": 300, **changes})
    with pytest.raises(ValueError, match=message):
        attention_step(**args, eps=EPS, rope_base=BASE)
    with pytest.raises(ValueError, match="takes one new token, got length 2"):
        attention_step(**bad(), position=300, eps=EPS, rope_base=BASE)


def donated_step(inputs, capacity, offset, schedule, fold=None):
    """One step on fresh caches (the same random ones on every call for a capacity) that nobody
    else holds: donated."""
    *head, _, _ = inputs
    b = head[0].shape[0]
    hkv, d = head[1].shape[2] // head[3].shape[0], head[3].shape[0]
    keys = mx.random.split(mx.random.key(capacity), 2)
    k_cache = mx.random.normal((b, hkv, capacity, d), key=keys[0]).astype(head[0].dtype)
    v_cache = mx.random.normal((b, hkv, capacity, d), key=keys[1]).astype(head[0].dtype)
    mx.eval(k_cache, v_cache)
    copies = attention_step_cache_copies()
    out, k_cache, v_cache = attention_step(
        *head,
        k_cache,
        v_cache,
        offset,
        eps=EPS,
        rope_base=BASE,
        schedule=schedule,
        fold=fold,
        stream=mx.gpu,
    )
    mx.eval(out, k_cache, v_cache)
    assert attention_step_cache_copies() == copies, "a cache was copied: not the decode path"
    return out, k_cache, v_cache


# On CUDA, fold=True with donated caches and L <= 8 runs the folded kernel (attend_mma_step: the
# preprocessing inside the split-mma attention's blocks, counted by attention_step_folds());
# fold=False runs the two kernels (step_preprocess, attend_mma) with the same plan. Offsets
# 64m - L // 2 put the new positions across a multiple of 64, which at these head counts is the
# last chunk's start (chunks of one 64-position block step) once the context splits (m = 32);
# m = 3: one chunk; m = 2047: positions near 131072 (the float32 rotation's range reduction).
FOLD_GRID = [
    (dtype, heads, d, length, m)
    for dtype in (mx.float16, mx.bfloat16)
    for heads in ((32, 8), (8, 8))
    for d in (64, 128)
    for length in (1, 3, 8)
    for m in (3, 32)
] + [(mx.bfloat16, (8, 2), 128, 1, 2047), (mx.float16, (4, 4), 64, 3, 2047)]
# the other head dims the tensor-core kernel compiles (Phi-3's 96 without GQA, 80, Gemma's 256)
FOLD_GRID += [
    (mx.bfloat16, (32, 32), 96, 1, 32), (mx.float16, (8, 2), 96, 8, 3),
    (mx.bfloat16, (8, 2), 80, 3, 32), (mx.bfloat16, (8, 4), 256, 1, 32),
    (mx.float16, (16, 8), 256, 8, 3),
]  # fmt: skip


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the folded step is CUDA's")
@pytest.mark.parametrize(
    "dtype,heads,d,length,m",
    FOLD_GRID,
    ids=[
        f"{str(t).split('.')[-1]}-hq{h[0]}-hkv{h[1]}-D{d}-L{n}-m{m}" for t, h, d, n, m in FOLD_GRID
    ],
)
def test_folded_step_matches_two_kernels_gpu(dtype, heads, d, length, m):
    hq, hkv = heads
    offset = 64 * m - length // 2
    capacity = capacity_for(offset + length)
    inputs = make_step(offset, 1, hq, hkv, length, d, capacity, dtype)
    folds = attention_step_folds()
    folded = donated_step(inputs, capacity, offset, "auto", fold=True)
    assert attention_step_folds() == folds + 1, "fold=True ran two kernels"
    two = donated_step(inputs, capacity, offset, "auto", fold=False)
    assert attention_step_folds() == folds + 1, "fold=False ran the folded kernel"
    # Not bit for bit: on the H200 (354698b) 10 of these 48 cases differed from the two kernels
    # in 0.03-1.3% of the outputs (one k_cache value once) by 1-4 units in the last place (the
    # shared row code compiled in two translation units), while they match under the emulation.
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    for name, got, want in zip(("out", "k_cache", "v_cache"), folded, two, strict=True):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), **TOLERANCE[dtype], err_msg=name)
    *head, _, _ = inputs
    expected = step_f64(*head, two[1], two[2], offset, EPS, BASE)[0]  # caches: positions < offset
    np.testing.assert_allclose(to_numpy(folded[0]), expected, **tol, err_msg="vs float64")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_base_and_head_dim_change_between_calls(device):
    """The inverse frequencies are kept per thread between calls: alternating RoPE bases and head
    dims in one thread must rotate by each call's own, as float64 does."""
    for base, d in [(BASE, 128), (10_000.0, 128), (BASE, 64), (500_000.0, 64), (BASE, 128)]:
        inputs = make_step(3, 1, 4, 2, 1, d, 256, mx.float32)
        out, _, _ = attention_step(*inputs, 37, eps=EPS, rope_base=base, stream=device)
        expected, _, _ = step_f64(*inputs, 37, EPS, base, None)
        np.testing.assert_allclose(
            to_numpy(out), expected, **TOLERANCE[mx.float32], err_msg=f"base {base} D {d}"
        )
