"""The CUDA quantized-KV kernels' device code (kernels-cuda/decode_attention_quantized_kernel.cuh:
the SIMT kernel; decode_attention_quantized_mmat.cuh: the tensor-core kernel, its mma.sync,
ldmatrix and movmatrix emulated with shuffles, cp.async a plain copy), run on the CPU under
kernels-cuda/emulation/cuda_emu.h, against float64 attention over the dequantised cache.

What this proves: the kernel's indexing, code unpacking, group scales and biases, GQA tiles,
lane-group and warp reductions (shuffles among 32 emulated threads), the block and split merges
(the last block to arrive) and the causal/mask handling, for float32 storage and context splits
chosen here. What it cannot: nvcc's code, real bf16/f16 conversions, vector loads' alignment on
device memory, memory-model effects beyond barriers and fences, plan_quantized() and the launch
through MLX, and speed; the GPU tests (test_quantized.py on a CUDA device) cover those.
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import range_mask
from emulation import CSRC, KERNELS_CUDA, build_runner
from reference import assert_matches_nonfinite, attention_f64
from tiers import few, few_rows


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory,
        KERNELS_CUDA / "emulation" / "run_decode_attention_quantized.cpp",
        f"-I{CSRC}",
    )


# Every case: (batch, Hq, Hkv, L, S, D, bits, group_size, causal, mask, splits).
CASES = [
    (1, 32, 8, 1, 100, 128, 8, 64, False, False, 1),
    (1, 32, 8, 1, 1000, 128, 4, 64, False, False, 4),
    (1, 8, 2, 3, 77, 64, 8, 32, True, False, 2),
    (1, 6, 3, 2, 45, 256, 4, 128, True, False, 3),
    (2, 4, 4, 1, 1, 32, 4, 32, False, False, 1),
    (1, 12, 2, 5, 333, 96, 8, 32, True, False, 5),
    (1, 8, 2, 2, 300, 128, 4, 32, False, True, 3),
]


# The tensor-core kernel (mmat: fed by a cp.async pipeline through shared memory): every bits x
# group size, D 64/128/256, L 1-8, GQA tiles of 8 (two at 16 vectors), contexts of fewer
# positions than one stage, of many stages per warp, cut inside a stage and inside a 16-byte run
# of scales (S and chunks not multiples of 16), splits, causal, masks.
MMA_CASES = [
    (1, 32, 8, 1, 1000, 128, 8, 64, False, False, 3),
    (1, 32, 8, 1, 1000, 128, 4, 64, False, False, 1),
    (1, 8, 2, 3, 77, 64, 8, 32, True, False, 2),
    (1, 6, 3, 2, 45, 256, 4, 128, True, False, 1),
    (2, 4, 4, 1, 1, 64, 4, 32, False, False, 1),
    (1, 16, 1, 2, 333, 128, 8, 32, True, False, 2),
    (1, 8, 2, 2, 300, 128, 4, 32, False, True, 3),
    (1, 8, 2, 1, 259, 256, 8, 64, False, True, 2),
    (1, 4, 1, 1, 517, 128, 8, 128, False, False, 2),
    (1, 8, 1, 8, 203, 128, 4, 64, True, False, 2),
    (1, 32, 8, 2, 130, 128, 4, 128, True, False, 2),
    # merges of more chunks than a batch of registers: the rest staged in shared memory (33
    # chunks of one 4-vector tile), and past what shared memory holds (40 chunks of 8 vectors
    # at 8 bits: 8 in registers, 8 staged, 24 in batches)
    (1, 4, 1, 1, 2100, 128, 4, 64, False, False, 33),
    (1, 8, 1, 2, 2530, 128, 8, 64, True, False, 40),
]


# Each kernel over its cases, against float64 (run_case): 8x2 (the SIMT kernel), and the
# tensor-core kernel sized for 2 blocks per SM (mmat: 3-8 stages per warp) and for 4 (mmat4, the
# CUDA default: 2 at 8 bits with D = 128), so the stage ring wraps differently.
KERNEL_CASES = [("8x2", c) for c in CASES] + [
    (kind, c) for kind in ("mmat", "mmat4") for c in MMA_CASES
]
# The quick tier: each kernel on a small causal GQA case with a split, and a mask on two of them.
KERNEL_QUICK = [
    ("8x2", CASES[2]),
    ("8x2", CASES[6]),
    ("mmat", MMA_CASES[2]),
    ("mmat4", MMA_CASES[2]),
    ("mmat4", MMA_CASES[6]),
]


@pytest.mark.parametrize(("kind", "case"), few_rows(KERNEL_CASES, *KERNEL_QUICK))
def test_cuda_quantized_kernel_under_emulation(emulator, tmp_path, kind, case):
    run_case(emulator, tmp_path, case, kind=kind)


@pytest.mark.parametrize("kind", few(["8x2", "mmat", "mmat4"], "mmat4"))
def test_cuda_quantized_kernel_merges_a_d256_tile_in_parts(emulator, tmp_path, kind):
    """D = 256 with 8 vectors a KV head, split in 3: the last block merges the tile in two parts
    of 4 vectors (finish(): at 128 threads its two items a thread cover 4 vectors of D = 256)."""
    run_case(emulator, tmp_path, (1, 8, 2, 2, 300, 256, 8, 64, True, False, 3), kind=kind,
             exact_splits=True)  # fmt: skip


@pytest.mark.parametrize(("bits", "q_scale"), few_rows([(4, 1000.0), (8, 15000.0)], (4, 1000.0)))
def test_cuda_quantized_kernel_with_large_queries(emulator, tmp_path, bits, q_scale):
    """Queries whose f16 operands would overflow (|q| up to ~4000 at 4 bits, where the slots
    facing even nibbles carry a factor 16, and ~50000 at 8 bits) are scaled down by a power of two
    first, each vector by its own: the heads here span 1x to q_scale, so one tile mixes scaled
    and unscaled vectors (small keys keep the scores moderate)."""
    case = (1, 8, 2, 1, 300, 128, bits, 64, False, False, 2)
    head_scale = mx.array([1.0, 0.25 * q_scale, 0.5 * q_scale, q_scale] * 2).reshape(1, 8, 1, 1)
    run_case(emulator, tmp_path, case, kind="mmat4", q_scale=head_scale, k_scale=1.0 / q_scale)


@pytest.mark.parametrize("kind", ["8x2", "mmat4"])
def test_cuda_quantized_kernel_nan_query(emulator, tmp_path, kind):
    """The contract's NaN rule (attention.py): a NaN in a query makes its whole row NaN, never
    zeros (one vector of a tile of eight, in a split call); the other rows are untouched."""
    out = run_case(emulator, tmp_path, (1, 8, 2, 1, 300, 128, 4, 64, False, False, 2), kind=kind,
                   nan_at=(0, 5, 0, 7))  # fmt: skip
    assert np.isnan(out[0, 5, 0]).all()
    assert np.isfinite(np.delete(out[0], 5, axis=0)).all()


@pytest.mark.parametrize("kind", few(["8x2", "mmat", "mmat4"], "mmat4"))
@pytest.mark.parametrize("causal", few([False, True], True))
def test_cuda_quantized_kernel_row_ranges(emulator, tmp_path, kind, causal):
    """Per-row ranges: rows starting inside a 16-position sub-step (the mmat kernel copies whole
    ones and scores the positions before the start -inf), one empty (zeros), rows ending inside
    a split's chunk, against the mask they stand for."""
    ranges = ([0, 37, 300, 123], [300, 211, 300, 130])
    run_case(emulator, tmp_path, (4, 8, 2, 2, 300, 128, 4, 64, causal, False, 3), kind=kind,
             ranges=ranges)  # fmt: skip


# the runner's config code of each kernel
KINDS = {"8x2": 0, "mmat": 2, "mmat4": 4}


def run_case(
    emulator, tmp_path, case, kind, q_scale=1.0, k_scale=1.0, nan_at=None, ranges=None,
    exact_splits=False,
):  # fmt: skip
    """The runner on `case`, against float64; exact_splits: the runner split the context as the
    case asks (it clamps to what the plan would do)."""
    mma = kind != "8x2"
    b, hq, hkv, length, s, d, bits, group_size, causal, masked, splits = case
    capacity = s + 7  # K/V are views of a longer cache buffer
    keys = mx.random.split(mx.random.key(s + d + bits + splits), 4)
    q = mx.random.normal((b, hq, length, d), key=keys[0]) * q_scale
    if nan_at is not None:
        q[nan_at] = mx.nan
    k = mx.random.normal((b, hkv, capacity, d), key=keys[1]) * k_scale
    k = mx.quantize(k, group_size, bits)
    v = mx.quantize(mx.random.normal((b, hkv, capacity, d), key=keys[2]), group_size, bits)
    mask = None
    if masked:
        mask = mx.random.normal((b, hq, length, s), key=keys[3])
        mask = mx.where(mx.random.uniform(shape=mask.shape, key=keys[3]) < 0.2, -mx.inf, mask)
        mask[0, 1, 0, :] = -mx.inf  # a row with nothing visible: zeros
    (tmp_path / "config.txt").write_text(
        f"{b} {hq} {hkv} {length} {s} {d} {bits} {group_size} {int(causal)} {int(masked)} "
        f"{splits} {capacity} {KINDS[kind]} {3 if ranges else 0}\n"
    )
    if ranges:
        for name, values in zip(("starts", "ends"), ranges, strict=True):
            (tmp_path / f"{name}.bin").write_bytes(np.array(values, np.int32).tobytes())
    (tmp_path / "q.bin").write_bytes(np.array(q).tobytes())
    (tmp_path / "mask.bin").write_bytes(np.array(mask).tobytes() if masked else b"\0" * 4)
    for name, array in zip(("kc", "ks", "kb", "vc", "vs", "vb"), (*k, *v), strict=True):
        (tmp_path / f"{name}.bin").write_bytes(np.array(array).tobytes())
    ran = subprocess.run(
        [str(emulator), str(tmp_path)], check=True, timeout=300, capture_output=True, text=True
    )
    if exact_splits:
        assert int(ran.stdout.split()[1]) == splits, ran.stdout
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(b, hq, length, d)

    def storage(x):  # what the runner stores: f16 for the tensor-core kernel
        return x.astype(mx.float16).astype(mx.float32) if mma else x

    def dequantized(triple):
        codes, scales, biases = (a[:, :, :s] for a in triple)
        return mx.dequantize(
            codes, storage(scales), storage(biases), group_size=group_size, bits=bits
        )

    ref_mask = mask if masked else ("causal" if causal else None)
    if ranges:
        assert not masked
        ref_mask = range_mask(b, length, s, *(mx.array(r) for r in ranges), causal)
    expected = attention_f64(storage(q), dequantized(k), dequantized(v), mask=ref_mask)
    # mmat: f16 outputs and f16 weights times scales as the P V operand.
    tolerance = 3e-3 if mma else 2e-5
    assert_matches_nonfinite(out, expected, atol=tolerance, rtol=tolerance)
    if masked:
        assert np.all(out[0, 1, 0] == 0.0)
    return out
