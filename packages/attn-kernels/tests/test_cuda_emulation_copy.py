"""The CUDA strided copy (kernels-cuda/strided_copy.cuh: a cache that could not be donated, the
step's token-first reordering, a linear layer's strided input) run on the CPU under
kernels-cuda/emulation/cuda_emu.h against numpy's view of the same strides: which kernel
copy_by_vectors picks (16 bytes a thread, or an element a thread) and that both copy every
element to its place, grid-stride loops included. What it cannot: nvcc's code and speed."""

import subprocess

import numpy as np
import pytest
from emulation import KERNELS_CUDA, build_runner


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(tmp_path_factory, KERNELS_CUDA / "emulation" / "run_strided_copy.cpp")


def copy(emulator, tmp_path, buffer: np.ndarray, shape, strides, offset=0, blocks=0):
    """The kernel's copy of the (shape, element strides) view `offset` elements into `buffer`,
    and the kernel it ran."""
    config = [buffer.itemsize, *shape, *strides, offset, blocks]
    (tmp_path / "config.txt").write_text(" ".join(map(str, config)) + "\n")
    (tmp_path / "src.bin").write_bytes(buffer.tobytes())
    run = subprocess.run([str(emulator), str(tmp_path)], check=True, capture_output=True, text=True)
    got = np.frombuffer((tmp_path / "dst.bin").read_bytes(), buffer.dtype).reshape(shape)
    view = np.lib.stride_tricks.as_strided(
        buffer[offset:], shape, [s * buffer.itemsize for s in strides]
    )
    return got, view, run.stdout.strip()


def cache(b, h, capacity, d, dtype=np.uint16):
    return np.random.default_rng(b * h + capacity + d).integers(
        0, 60000, b * h * capacity * d, dtype
    )


@pytest.mark.parametrize(
    ("b", "h", "capacity", "length", "d", "start", "kernel"),
    [
        (3, 2, 64, 37, 128, 0, "vectors"),  # a cache's first positions (a slice of its buffer)
        (3, 2, 64, 37, 128, 8, "vectors"),  # from position 8 (mlx-lm's trimmed left padding)
        (2, 3, 40, 33, 72, 5, "vectors"),  # D a multiple of 8, not of 32
        (2, 2, 16, 11, 20, 0, "elements"),  # rows not whole 16-byte vectors
        (1, 2, 24, 24, 64, 0, "vectors"),  # the whole buffer
    ],
)
def test_cache_slices_copy_exactly(emulator, tmp_path, b, h, capacity, length, d, start, kernel):
    buffer = cache(b, h, capacity, d)
    strides = (h * capacity * d, capacity * d, d, 1)
    got, view, ran = copy(emulator, tmp_path, buffer, (b, h, length, d), strides, start * d)
    assert ran == kernel
    np.testing.assert_array_equal(got, view)


def test_misaligned_and_transposed_sources_take_the_element_kernel(emulator, tmp_path):
    buffer = cache(2, 2, 32, 64)
    strides = (2 * 32 * 64, 32 * 64, 64, 1)
    got, view, ran = copy(emulator, tmp_path, buffer, (2, 2, 20, 64), strides, offset=3)
    assert ran == "elements"  # 3 elements in: rows off 16 bytes
    np.testing.assert_array_equal(got, view)
    # The last axis strided (a transposed view)
    got, view, ran = copy(emulator, tmp_path, buffer, (2, 2, 64, 20), (4096, 2048, 1, 64))
    assert ran == "elements"
    np.testing.assert_array_equal(got, view)


def test_heads_first_output_to_token_first(emulator, tmp_path):
    """The step's reordering at L > 1: (B, Hq, L, D) read as (B, L, Hq, D) through strides."""
    b, hq, length, d = 2, 5, 3, 128
    buffer = cache(b, hq, length, d)
    strides = (hq * length * d, d, length * d, 1)
    got, view, ran = copy(emulator, tmp_path, buffer, (b, length, hq, d), strides)
    assert ran == "vectors"
    np.testing.assert_array_equal(got, view)
    heads_first = buffer.reshape(b, hq, length, d)
    np.testing.assert_array_equal(got, heads_first.transpose(0, 2, 1, 3))


@pytest.mark.parametrize(("d", "kernel"), [(36, "vectors"), (6, "elements")])
def test_four_byte_elements(emulator, tmp_path, d, kernel):
    buffer = cache(2, 3, 12, d, np.uint32)
    strides = (3 * 12 * d, 12 * d, d, 1)
    got, view, ran = copy(emulator, tmp_path, buffer, (2, 3, 9, d), strides)
    assert ran == kernel
    np.testing.assert_array_equal(got, view)


@pytest.mark.parametrize("d", [128, 20])
def test_grid_stride_loops_cover_everything(emulator, tmp_path, d):
    """Two blocks for many times their threads' work: the loops past the grid."""
    buffer = cache(3, 4, 48, d)
    strides = (4 * 48 * d, 48 * d, d, 1)
    got, view, _ = copy(emulator, tmp_path, buffer, (3, 4, 45, d), strides, blocks=2)
    np.testing.assert_array_equal(got, view)
