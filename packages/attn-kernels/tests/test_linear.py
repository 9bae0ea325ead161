"""decode_linear and decode_linear_quantized (the CPU linear kernel through MLX) against float64
on random inputs: every CPU path this machine runs, every dtype, 1 to 17 rows of x in leading
dimensions of any shape, widths that are not multiples of the vector steps, both bit widths and
every group size, strided and transposed inputs, NaN, a SwiGLU gate, and the argument errors."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from attn_kernels import _ext, decode_linear, decode_linear_quantized
from reference import to_numpy
from tiers import few_rows

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# One rounding of the output to its dtype, plus float32 accumulation over K terms.
ROUNDING = {mx.float32: 2**-23, mx.float16: 2**-10, mx.bfloat16: 2**-7}


@pytest.fixture(params=_ext.cpu_paths())
def path(request, monkeypatch):
    monkeypatch.setenv("ATTN_KERNELS_CPU_PATH", request.param)
    return request.param


def int8_rounding(x, w, unit):
    """The most x rounded to int8 (a scale per `unit` values of a row, |error| <= scale / 2
    each) can move x @ w.T: sum over units of max|x in the unit| / 254 * sum |w in the unit|, w
    the weights the rounded x meets (scale * code: cpu_linear_check.cpp emulates the rounding
    exactly)."""
    k = x.shape[-1]
    blocks = -(-k // unit)
    pad = blocks * unit - k
    top = np.abs(np.pad(x, ((0, 0), (0, pad)))).reshape(len(x), blocks, unit).max(axis=-1)
    weight = np.abs(np.pad(w, ((0, 0), (0, pad)))).reshape(len(w), blocks, unit).sum(axis=-1)
    return top @ weight.T / 254.0 * (1 + 1e-6)


def int8_unit(group):
    """Values per int8 scale of x: a group, or 64 where a group is longer (every x86 path)."""
    return min(group, 64)


def rounds_x_to_int8(path, dtype, bits):
    """x86's vector paths take 4-bit codes against x rounded to int8 for half-precision x."""
    return bits == 4 and dtype != mx.float32 and path in ("avx2", "avx512")


def check(got: mx.array, x, w, bias, dtype, int8_w=None, unit=32, x_rounded=False):
    """got against float64 x @ w.T + bias (x, w, bias as float64 arrays of the rounded inputs);
    int8_w: the weights x rounded to int8 (a scale per `unit` values) meets, where it is;
    x_rounded: x is exact here but rounded to the dtype in the kernel (a SwiGLU's hidden row)."""
    expected = x @ w.T + (0.0 if bias is None else bias)
    magnitude = np.abs(x) @ np.abs(w).T + (0.0 if bias is None else np.abs(bias))
    tol = ROUNDING[dtype] * np.abs(expected) + 1e-5 * magnitude + 1e-30
    if x_rounded:
        tol += ROUNDING[dtype] * np.abs(x) @ np.abs(w).T
    if int8_w is not None:
        tol += int8_rounding(x, int8_w, unit)
    err = np.abs(to_numpy(got) - expected)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at {worst}"


def dequantized(codes: mx.array, scales: mx.array, biases, bits: int, group: int):
    """The float64 weights the codes stand for, unpacked independently of MLX (biases None:
    scale * code alone)."""
    words = np.array(codes).astype(np.uint64)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    values = values.reshape(words.shape[0], -1).astype(np.float64)
    s = np.repeat(to_numpy(scales), group, axis=-1)
    if biases is None:
        return s * values
    return s * values + np.repeat(to_numpy(biases), group, axis=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lead", "k", "n"),
    [((1,), 33, 13), ((3,), 100, 37), ((2, 4), 256, 21), ((9,), 31, 5), ((17, 1), 64, 40)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_matches_float64(path, dtype, lead, k, n, with_bias):
    keys = mx.random.split(mx.random.key(k + n + len(lead)), 3)
    x = mx.random.normal((*lead, k), key=keys[0]).astype(dtype)
    w = (mx.random.normal((n, k), key=keys[1]) / k**0.5).astype(dtype)
    bias = mx.random.normal((n,), key=keys[2]).astype(dtype) if with_bias else None
    got = decode_linear(x, w, bias)
    assert got.shape == (*lead, n) and got.dtype == dtype
    check(got, to_numpy(x), to_numpy(w), None if bias is None else to_numpy(bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("rows", "groups"), [(1, 3), (2, 4), (5, 1), (8, 5)])
def test_quantized_matches_float64(path, dtype, bits, group, rows, groups):
    k, n = group * groups, 19
    keys = mx.random.split(mx.random.key(bits + group + rows), 3)
    w = (mx.random.normal((n, k), key=keys[0]) / k**0.5).astype(dtype)
    codes, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, 1, k), key=keys[1]).astype(dtype)
    bias = mx.random.normal((n,), key=keys[2]).astype(dtype)
    got = decode_linear_quantized(x, codes, scales, biases, bias, group_size=group, bits=bits)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    wq = dequantized(codes, scales, biases, bits, group)
    x64 = to_numpy(x).reshape(rows, k)
    int8_w = None
    if rounds_x_to_int8(path, dtype, bits):
        int8_w = dequantized(codes, scales, None, bits, group)
    unit = int8_unit(group)
    check(got.reshape(rows, n), x64, wq, to_numpy(bias), dtype, int8_w, unit)
    # No farther from float64 than MLX's own quantized matmul on the same triples (on the CPU
    # it accumulates half-precision inputs less exactly: up to ~0.1 off here in bf16), beyond
    # the int8 rounding where x is rounded.
    theirs = mx.quantized_matmul(
        x, codes, scales, biases, transpose=True, group_size=group, bits=bits
    )
    exact = x64 @ wq.T + to_numpy(bias)
    ours_err = np.abs(to_numpy(got).reshape(rows, n) - exact).max()
    theirs_err = np.abs(to_numpy(theirs + bias).reshape(rows, n) - exact).max()
    sums = np.abs(x64) @ np.abs(wq).T  # float32 accumulation error
    allowed = theirs_err + ROUNDING[dtype] * np.abs(exact).max() + 1e-5 * sums.max()
    assert ours_err <= allowed + (0.0 if int8_w is None else int8_rounding(x64, int8_w, unit).max())


def silu64(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "group", "k"), [(0, 0, 100), (4, 64, 192), (8, 128, 384)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_swiglu_gate_matches_float64(path, dtype, bits, group, k, rows):
    """(silu(gate) * x) @ W.T with gate and x the two halves of one (rows, 2K) array (an MLP's
    fused gate/up output: strided rows, read in place), the hidden row rounded to the dtype."""
    n = 23
    keys = mx.random.split(mx.random.key(k + rows + bits), 3)
    gate_up = (2 * mx.random.normal((rows, 2 * k), key=keys[0])).astype(dtype)
    gate, x = gate_up[:, :k], gate_up[:, k:]
    w = (mx.random.normal((n, k), key=keys[1]) / k**0.5).astype(dtype)
    bias = mx.random.normal((n,), key=keys[2]).astype(dtype)
    hidden = silu64(to_numpy(gate)) * to_numpy(x)
    if bits == 0:
        got = decode_linear(x, w, bias, gate=gate)
        check(got, hidden, to_numpy(w), to_numpy(bias), dtype, x_rounded=True)
        return
    codes, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    got = decode_linear_quantized(
        x, codes, scales, biases, bias, group_size=group, bits=bits, gate=gate
    )
    int8_w = None
    if rounds_x_to_int8(path, dtype, bits):
        int8_w = dequantized(codes, scales, None, bits, group)
    wq = dequantized(codes, scales, biases, bits, group)
    # The kernel's float32 SwiGLU (relative error ~1e-6) may round to int8 on either side of a
    # midpoint: the tolerance's int8 term covers a whole step there (twice the half-step bound).
    unit = int8_unit(group)
    int8_w = None if int8_w is None else 2 * int8_w
    check(got, hidden, wq, to_numpy(bias), dtype, int8_w, unit, x_rounded=True)


def test_swiglu_gate_nan_and_infinities(path):
    """A NaN gate makes its row NaN, and so does silu(-inf), as in MLX (-inf times 0)."""
    w = mx.ones((4, 3))
    gate = mx.array([[float("nan"), 0.0, 1.0], [float("-inf"), 0.0, 1.0], [0.5, 1.0, -40.0]])
    x = mx.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [2.0, 3.0, 1.0]])
    out = np.array(decode_linear(x, w, gate=gate))
    assert np.isnan(out[:2]).all()
    expected = (silu64(np.array([0.5, 1.0, -40.0])) * np.array([2.0, 3.0, 1.0])).sum()
    np.testing.assert_allclose(out[2], expected, rtol=1e-6)


def test_strided_and_transposed_inputs(path):
    """x rows a slice apart (read in place) and a transposed weight (copied first)."""
    keys = mx.random.split(mx.random.key(5), 2)
    x = mx.random.normal((4, 3, 72), key=keys[0])[:, 1]
    w = mx.random.normal((72, 30), key=keys[1]).T
    check(decode_linear(x, w), to_numpy(x), to_numpy(w), None, mx.float32)
    codes, scales, biases = mx.quantize(mx.random.normal((24, 128)), group_size=64, bits=8)
    got = decode_linear_quantized(mx.ones((2, 128)), codes.T.T[:, :], scales.T.T, biases, bits=8)
    check(got, np.ones((2, 128)), dequantized(codes, scales, biases, 8, 64), None, mx.float32)


def test_nan_and_empty_rows(path):
    x = mx.array([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0]])
    out = np.array(decode_linear(x, mx.ones((4, 3))))
    assert np.isnan(out[0]).all() and (out[1] == 6.0).all()
    empty = decode_linear(mx.zeros((0, 3)), mx.ones((4, 3)))
    assert empty.shape == (0, 4)


def test_one_pass_serves_many_rows():
    """Rows past 8 run in further passes over W: 20 rows equal each row alone."""
    keys = mx.random.split(mx.random.key(2), 2)
    x = mx.random.normal((20, 96), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.normal((50, 96), key=keys[1]).astype(mx.bfloat16)
    together = np.array(decode_linear(x, w).astype(mx.float32))
    # Each row alone runs the 1-row loop; together they run the 8-row loop: the same sums in a
    # different order, so equal to float32 rounding, then bf16.
    alone = np.concatenate(
        [np.array(decode_linear(x[i : i + 1], w).astype(mx.float32)) for i in range(20)]
    )
    np.testing.assert_allclose(together, alone, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(
    "stream",
    [mx.cpu, mx.Device(mx.cpu), mx.default_stream(mx.Device(mx.cpu))],
    ids=["device-type", "device", "stream"],
)
def test_every_form_of_stream(stream):
    """stream= takes what MLX's ops take: mx.cpu (a DeviceType), a Device or a Stream."""
    x = mx.random.normal((3, 70)).astype(mx.bfloat16)
    w = mx.random.normal((9, 70)).astype(mx.bfloat16)
    codes, scales, biases = mx.quantize(mx.random.normal((9, 128)), group_size=64, bits=4)
    xq = mx.random.normal((3, 128))
    with mx.stream(mx.cpu):
        dense, quantized = decode_linear(x, w), decode_linear_quantized(xq, codes, scales, biases)
    got = decode_linear(x, w, stream=stream)
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)), np.array(dense.astype(mx.float32))
    )
    got = decode_linear_quantized(xq, codes, scales, biases, stream=stream)
    np.testing.assert_array_equal(np.array(got), np.array(quantized))


@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="no GPU")
def test_gpu_streams_take_mlx_matmuls():
    x = mx.random.normal((2, 64)).astype(mx.bfloat16)
    w = mx.random.normal((8, 64)).astype(mx.bfloat16)
    got = decode_linear(x, w, stream=mx.gpu).astype(mx.float32)
    expected = mx.matmul(x, w.T, stream=mx.gpu).astype(mx.float32)
    np.testing.assert_array_equal(np.array(got), np.array(expected))
    with mx.stream(mx.gpu):
        gated = decode_linear(x, w, gate=x + 1).astype(mx.float32)
        expected = mx.matmul(mx.sigmoid(x + 1) * (x + 1) * x, w.T).astype(mx.float32)
    np.testing.assert_allclose(np.array(gated), np.array(expected), rtol=2**-6, atol=0.05)


CUDA = pytest.mark.skipif(not mx.cuda.is_available(), reason="no CUDA device")


def check_tensor_cores(got: mx.array, x, w, bias, dtype, x_rounded=False):
    """got against float64 x @ w.T (+ bias) as the tensor-core kernel computes it: each weight
    rounded to the dtype (the mma's operands, as MLX's own qmm has them), float32 sums, one
    rounding of the output; returns the float64 result."""
    exact = x @ w.T + (0.0 if bias is None else bias)
    sums = np.abs(x) @ np.abs(w).T
    tol = ROUNDING[dtype] * (np.abs(exact) + (2 if x_rounded else 1) * sums) + 1e-6
    err = np.abs(to_numpy(got) - exact)
    assert (err <= tol).all(), f"worst error {err.max():.3g}"
    return exact


@CUDA
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("rows", "n", "k", "group"),
    few_rows([(1, 40, 320, 64), (2, 19, 384, 128), (5, 72, 160, 32), (8, 1030, 2560, 64),
              (13, 40, 320, 64), (32, 2560, 1024, 64), (37, 24, 640, 128)],
             (5, 72, 160, 32), (32, 2560, 1024, 64)),
)  # fmt: skip
def test_cuda_kernel_gpu_matches_float64(dtype, bits, rows, n, k, group):
    """The tensor-core kernel (kernels-cuda/linear_quantized.cuh) on the GPU: every tile size
    (1, 2 and 4 tiles of 8 rows; several passes past 32), N and K that are not multiples of the
    tiles, every group size, against float64 and no farther from it than mx.quantized_matmul."""
    keys = mx.random.split(mx.random.key(rows + n + k + bits), 3)
    w = (mx.random.normal((n, k), key=keys[0]) / k**0.5).astype(dtype)
    codes, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, k), key=keys[1]).astype(dtype)
    bias = mx.random.normal((n,), key=keys[2]).astype(dtype)
    with mx.stream(mx.gpu):
        got = decode_linear_quantized(x, codes, scales, biases, bias, group_size=group, bits=bits)
        theirs = (
            mx.quantized_matmul(
                x, codes, scales, biases, transpose=True, group_size=group, bits=bits
            )
            + bias
        )
    assert got.shape == (rows, n) and got.dtype == dtype
    wq = dequantized(codes, scales, biases, bits, group)
    x64 = to_numpy(x)
    exact = check_tensor_cores(got, x64, wq, to_numpy(bias), dtype)
    theirs_err = np.abs(to_numpy(theirs) - exact).max()
    ours_err = np.abs(to_numpy(got) - exact).max()
    assert ours_err <= theirs_err + ROUNDING[dtype] * np.abs(exact).max()


@CUDA
def test_cuda_kernel_gpu_strided_inputs_and_gate():
    """A column slice of x (rows 16-byte aligned, then not), transposed-then-copied codes (not
    row-contiguous: copied on the GPU first) and a SwiGLU gate (mlx-lm's op first on a GPU)."""
    k, n, group = 256, 48, 64
    w = mx.random.normal((n, k)).astype(mx.bfloat16) / 16
    codes, scales, biases = mx.quantize(w, group_size=group, bits=4)
    wq = dequantized(codes, scales, biases, 4, group)
    wide = mx.random.normal((6, k + 16)).astype(mx.bfloat16)  # rows 16-byte aligned
    for x in (wide[:, 8 : 8 + k], wide[:, 1 : 1 + k]):
        got = decode_linear_quantized(x, codes, scales, biases, group_size=group, stream=mx.gpu)
        check_tensor_cores(got, to_numpy(x), wq, None, mx.bfloat16)
    strided = mx.array(np.ascontiguousarray(np.array(codes).T)).T  # same values, column-major
    x = mx.random.normal((3, k)).astype(mx.bfloat16)
    got = decode_linear_quantized(x, strided, scales, biases, group_size=group, stream=mx.gpu)
    check_tensor_cores(got, to_numpy(x), wq, None, mx.bfloat16)
    gate = mx.random.normal((3, k)).astype(mx.bfloat16)
    with mx.stream(mx.gpu):
        got = decode_linear_quantized(x, codes, scales, biases, group_size=group, gate=gate)
    hidden = to_numpy(nn.silu(gate) * x)
    check_tensor_cores(got, hidden, wq, None, mx.bfloat16, x_rounded=True)


@CUDA
@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda x, w, q: _ext.decode_linear(x, w, None, None, None, 64, 0, None, stream=mx.gpu),
      "dense weights run MLX's matmul"),
     (lambda x, w, q: _ext.decode_linear(x.astype(mx.float32), q[0], q[1].astype(mx.float32),
                                         q[2].astype(mx.float32), None, 64, 4, None,
                                         stream=mx.gpu), "takes bfloat16 or float16 x"),
     (lambda x, w, q: _ext.decode_linear(x, *q, None, 64, 4, x, stream=mx.gpu),
      "gate runs on the CPU only")],
)  # fmt: skip
def test_cuda_kernel_gpu_refuses_what_it_does_not_take(call, message):
    x = mx.zeros((2, 128), mx.bfloat16)
    w = mx.zeros((8, 128), mx.bfloat16)
    with pytest.raises(ValueError, match=message):
        call(x, w, mx.quantize(w, group_size=64, bits=4))


BAD = [
    (dict(x=mx.zeros((2, 8)), weight=mx.zeros((4, 8), mx.float16)), "weight must have x's dtype"),
    (dict(x=mx.zeros((2, 8)), weight=mx.zeros((4, 9))), "weight must have shape (4, 8)"),
    (
        dict(x=mx.zeros((2, 8)), weight=mx.zeros((4, 8)), bias=mx.zeros((5,))),
        "bias must have shape (4,)",
    ),
    (dict(x=mx.zeros((2, 8), mx.int32), weight=mx.zeros((4, 8))), "x must be float32"),
    (dict(x=mx.zeros((2, 8)), weight=mx.zeros((8,))), "weight must have 2 dimensions"),
    (
        dict(x=mx.zeros((2, 8)), weight=mx.zeros((4, 8)), gate=mx.zeros((1, 8))),
        "gate must have shape (2, 8)",
    ),
    (
        dict(x=mx.zeros((2, 8)), weight=mx.zeros((4, 8)), gate=mx.zeros((2, 8), mx.float16)),
        "gate must have x's dtype",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_dense_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_linear(**kwargs)


BAD_QUANTIZED = [
    (dict(bits=3), "bits must be 0 (dense), 4 or 8"),
    (dict(group_size=48), "group_size must be 32, 64 or 128"),
    (dict(x=mx.zeros((1, 96))), "group_size 64 does not divide x's K = 96"),
    (dict(weight=mx.zeros((6, 16))), "a quantized weight must be uint32"),
    (dict(bits=8), "weight must have shape (6, 32)"),
    (dict(scales=mx.zeros((6, 1))), "scales must have shape (6, 2)"),
    (dict(biases=mx.zeros((6, 2), mx.float16)), "biases must have x's dtype"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_QUANTIZED)
def test_quantized_errors_name_the_argument(changes, message):
    codes, scales, biases = mx.quantize(mx.zeros((6, 128)), group_size=64, bits=4)
    kwargs = dict(x=mx.zeros((1, 128)), weight=codes, scales=scales, biases=biases) | changes
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_linear_quantized(**kwargs)


def test_non_arrays_are_type_errors():
    with pytest.raises(TypeError, match=r"weight must be an mx\.array"):
        decode_linear(mx.zeros((1, 4)), np.zeros((2, 4)))
