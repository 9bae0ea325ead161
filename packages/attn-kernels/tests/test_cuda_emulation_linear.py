"""DecodeLinear's CUDA kernels, run on the CPU under kernels-cuda/emulation/cuda_emu.h, against
float64 x @ W.T over the dequantised weights: linear_quantized.cuh (4- and 8-bit codes against a
few rows of x on the tensor cores) and the one-row candidates of kernels-cuda/dev/ (raw codes on
the tensor cores, the group maps applied per chunk of 64; float32 SIMT with codes read as
subnormal floats).

What this proves: the lanes' code and input pairing (the dot product's k order, which A and B
must share), the magic-number dequantisation (its bit operations run as written; the half2
arithmetic rounds as the emulation's float fma then one rounding), group scales and biases,
rows of W past N and rows of x past M (clamped, not stored), K past the last full 128-input
iteration, the warps' split of K and their sum through shared memory, several passes over W for
more than 32 rows, strided and misaligned rows of x, the bias. What it cannot: nvcc's code,
alignment faults, plan_linear_quantized() and speed: the GPU tests (test_linear.py on a CUDA
device) and bench-linear cover those."""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from emulation import CSRC, KERNELS_CUDA, build_runner
from test_linear import ROUNDING, dequantized
from tiers import few


@pytest.fixture(scope="session")
def gemv_emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory, KERNELS_CUDA / "emulation" / "run_linear_gemv.cpp", f"-I{CSRC}"
    )


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory, KERNELS_CUDA / "emulation" / "run_linear_quantized.cpp", f"-I{CSRC}"
    )


def bits16(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16)).tobytes()


def write_inputs(tmp_path, m, n, k, bits, group, dtype, pad=0):
    """Random x (m rows, `pad` extra elements between rows), W quantized and a bias, written as
    the runners read them; returns (x, codes, scales, biases, bias)."""
    keys = mx.random.split(mx.random.key(m * 1000 + n + k + bits + group + pad), 3)
    w = (mx.random.normal((n, k), key=keys[0]) / k**0.5).astype(dtype)
    codes, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((m, k + pad), key=keys[1]).astype(dtype)
    bias = mx.random.normal((n,), key=keys[2]).astype(dtype)
    (tmp_path / "x.bin").write_bytes(bits16(x))
    (tmp_path / "w.bin").write_bytes(np.array(codes).tobytes())
    (tmp_path / "scales.bin").write_bytes(bits16(scales))
    (tmp_path / "biases.bin").write_bytes(bits16(biases))
    (tmp_path / "bias.bin").write_bytes(bits16(bias))
    return x, codes, scales, biases, bias


def check_output(runner, tmp_path, inputs, m, n, k, bits, group, dtype, with_bias):
    """Runs the runner on tmp_path and compares out.bin with float64; returns the output."""
    x, codes, scales, biases, bias = inputs
    subprocess.run([str(runner), str(tmp_path)], check=True, capture_output=True, text=True)
    raw = np.frombuffer((tmp_path / "out.bin").read_bytes(), np.uint16).reshape(m, n)
    got = np.array(mx.array(raw).view(dtype).astype(mx.float32), np.float64)

    x64 = np.array(x.astype(mx.float32), np.float64)[:, :k]
    w64 = dequantized(codes, scales, biases, bits, group)
    b64 = np.array(bias.astype(mx.float32), np.float64) if with_bias else 0.0
    expected = x64 @ w64.T + b64
    # One rounding of each weight to the dtype (the fragments hold them so), float32 sums, one
    # rounding of the output.
    magnitude = np.abs(x64) @ np.abs(w64).T
    tol = ROUNDING[dtype] * (np.abs(expected) + magnitude) + 1e-6
    err = np.abs(got - expected)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at {worst}"
    return got


def run(emulator, tmp_path, m, n, k, bits, group, dtype, nt, mt, warps, pad=0, with_bias=True):
    """linear_quantized.cuh's output for random x and W against float64; returns the output."""
    inputs = write_inputs(tmp_path, m, n, k, bits, group, dtype, pad)
    code = 0 if dtype == mx.bfloat16 else 1
    config = f"{m} {n} {k} {bits} {group} {code} {k + pad} {int(with_bias)} {nt} {mt} {warps}"
    (tmp_path / "config.txt").write_text(config + "\n")
    return check_output(emulator, tmp_path, inputs, m, n, k, bits, group, dtype, with_bias)


# (M, N, K, bits, group, dtype, NT, MT, warps): N not a multiple of 16 or 32, K not of 128
# (a last iteration whose lanes 2-3 are past K), more warps than iterations, every group size,
# both tile sizes, one pass and several.
CASES = [
    (1, 40, 320, 4, 64, mx.bfloat16, 1, 1, 2),
    (3, 40, 320, 8, 32, mx.bfloat16, 1, 1, 3),
    (8, 19, 384, 4, 128, mx.float16, 1, 2, 1),
    (13, 40, 320, 8, 64, mx.float16, 2, 1, 8),
    (32, 72, 256, 4, 32, mx.bfloat16, 4, 2, 2),
    (32, 40, 160, 8, 32, mx.bfloat16, 4, 2, 1),
    (37, 24, 320, 4, 64, mx.float16, 4, 1, 3),
    (21, 33, 384, 8, 128, mx.float16, 4, 2, 4),
]
QUICK = [CASES[0], CASES[3], CASES[4], CASES[5]]


@pytest.mark.parametrize("case", few(CASES, *QUICK))
def test_linear_kernel_under_emulation(emulator, tmp_path, case):
    run(emulator, tmp_path, *case)


@pytest.mark.parametrize(("pad", "bits"), [(8, 4), (1, 8)])
def test_strided_and_misaligned_rows_of_x(emulator, tmp_path, pad, bits):
    """Rows of x 8 elements apart beyond K (16-byte loads) and 1 (element by element)."""
    run(emulator, tmp_path, 5, 40, 192, bits, 64, mx.bfloat16, 1, 1, 2, pad=pad)


def test_without_bias(emulator, tmp_path):
    run(emulator, tmp_path, 4, 24, 128, 4, 64, mx.bfloat16, 1, 1, 1, with_bias=False)


# (N, K, bits, group, dtype, warps, simt_rows): the tensor-core candidate (simt_rows 0) with N not
# a multiple of 16 (rows past N read, not stored), more warps than chunks and fewer (every warp's
# pipeline wrapping), both group sizes, bf16 at 8 bits (codes through float), f16 at both widths;
# the SIMT candidate at 1-8 rows a block, a piece per thread and several, group 32 included.
GEMV_CASES = [
    (40, 320, 4, 64, mx.bfloat16, 2, 0),
    (19, 640, 4, 128, mx.float16, 1, 0),
    (33, 384, 8, 64, mx.bfloat16, 3, 0),
    (24, 1024, 8, 128, mx.float16, 2, 0),
    (16, 128, 4, 64, mx.float16, 4, 0),
    (48, 2048, 8, 64, mx.bfloat16, 1, 0),
    (21, 320, 4, 32, mx.bfloat16, 1, 8),
    (13, 1088, 8, 64, mx.float16, 1, 4),
    (9, 384, 4, 128, mx.float16, 2, 2),
    (5, 2048, 8, 32, mx.bfloat16, 2, 1),
]


@pytest.mark.parametrize(
    "case", few(GEMV_CASES, GEMV_CASES[0], GEMV_CASES[2], GEMV_CASES[3], GEMV_CASES[6])
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_one_row_kernels_under_emulation(gemv_emulator, tmp_path, case, with_bias):
    """kernels-cuda/dev/'s one-row candidates (linear_gemv.cuh, linear_gemv_simt.cuh)."""
    n, k, bits, group, dtype, warps, simt_rows = case
    inputs = write_inputs(tmp_path, 1, n, k, bits, group, dtype)
    code = 0 if dtype == mx.bfloat16 else 1
    config = f"{n} {k} {bits} {group} {code} {int(with_bias)} {warps} {simt_rows}"
    (tmp_path / "config.txt").write_text(config + "\n")
    check_output(gemv_emulator, tmp_path, inputs, 1, n, k, bits, group, dtype, with_bias)
