"""AttentionStep's CUDA kernels (kernels-cuda/attention_step_kernel.cuh, decode_attention_mma.cuh)
run on the CPU under kernels-cuda/emulation/cuda_emu.h: the folded kernel (attend_mma_step: the
q/k RMSNorm + RoPE and the cache writes inside the attention's blocks) against the two-kernel
path (step_preprocess, then attend_mma over the updated caches), which must give the same bits,
and both against the float64 step (step_reference.step_f64).

The offsets put the new positions [offset, offset + L) across the boundary of the last two
context chunks (or at the first position of the last), where two blocks of a (kv head, tile)
each write their part of the new rows and read them back. What this cannot prove: nvcc's code,
the GPU's memory ordering between the cache stores and the loads (the GPU tests,
test_attention_step.py -k gpu, compare the two paths on the device), and speed.
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from conftest import TOLERANCE
from emulation import CSRC, KERNELS_CUDA, build_runner
from step_reference import rope_angles, step_f64

EPS, BASE = 1e-6, 1_000_000.0  # as the runner sets them
STEP = 64  # the mma kernel's block step: chunks are multiples of it


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory, KERNELS_CUDA / "emulation" / "run_attention_step.cpp", f"-I{CSRC}"
    )


# (batch, Hq, Hkv, L, D, dtype, splits, chunk, qk_norm): offset = the last chunk's first position
# minus L // 2 (chunk: the kernel's chunk in positions; splits 1: offset 100). GQA 4 (one tile of
# 8 vectors up to L = 2, four at L = 8) and 1; without q/k norm (Llama, Qwen2) too.
CASES = [
    (1, 8, 2, 1, 128, mx.bfloat16, 2, 64, True),
    (1, 8, 2, 8, 128, mx.float16, 3, 64, True),
    (1, 4, 4, 5, 64, mx.bfloat16, 2, 64, True),
    (2, 4, 4, 3, 64, mx.float16, 4, 64, True),
    (1, 8, 2, 4, 64, mx.bfloat16, 1, 0, True),
    (1, 16, 4, 2, 128, mx.float16, 2, 128, True),
    (1, 8, 2, 7, 128, mx.bfloat16, 5, 64, True),
    (1, 2, 2, 1, 128, mx.float16, 3, 64, True),
    (1, 8, 2, 6, 64, mx.float16, 2, 64, True),
    (1, 4, 4, 8, 128, mx.bfloat16, 2, 64, True),
    (1, 8, 2, 3, 128, mx.bfloat16, 2, 64, False),
    (1, 4, 4, 1, 64, mx.float16, 3, 64, False),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "d", "dtype", "splits", "chunk", "qk_norm"),
    CASES,
    ids=[
        f"B{c[0]}-hq{c[1]}-hkv{c[2]}-L{c[3]}-D{c[4]}-{str(c[5]).split('.')[-1]}-s{c[6]}"
        + ("" if c[8] else "-nonorm")
        for c in CASES
    ],
)
def test_folded_step_under_emulation(
    emulator, tmp_path, b, hq, hkv, length, d, dtype, splits, chunk, qk_norm
):
    offset = 100 if splits == 1 else (splits - 1) * chunk - length // 2
    end = offset + length
    capacity = end + 5  # the attention reads a prefix of longer caches
    keys = mx.random.split(mx.random.key(end + d + splits), 7)
    inputs = [
        mx.random.normal((b, length, hq * d), key=keys[0]),
        2.0 * mx.random.normal((b, length, hkv * d), key=keys[1]),
        mx.random.normal((b, length, hkv * d), key=keys[2]),
        1.0 + 0.2 * mx.random.normal((d,), key=keys[3]),
        1.0 + 0.2 * mx.random.normal((d,), key=keys[4]),
        mx.random.normal((b, hkv, capacity, d), key=keys[5]),
        mx.random.normal((b, hkv, capacity, d), key=keys[6]),
    ]
    inputs = [x.astype(dtype) for x in inputs]
    (tmp_path / "config.txt").write_text(
        f"{b} {hq} {hkv} {length} {offset} {d} {int(dtype == mx.bfloat16)} {splits} {capacity} "
        f"{int(qk_norm)}\n"
    )
    for name, x in zip(("q", "k", "v", "qw", "kw", "kc", "vc"), inputs, strict=True):
        (tmp_path / f"{name}.bin").write_bytes(np.array(x.astype(mx.float32)).tobytes())
    run = subprocess.run(
        [str(emulator), str(tmp_path)], check=True, timeout=600, capture_output=True, text=True
    )
    got_splits, got_chunk = (int(n) for n in run.stdout.split()[1:4:2])
    assert got_splits == splits, run.stdout
    if splits > 1:  # the new positions reach the last chunk's first position
        assert got_chunk == chunk and offset <= (splits - 1) * chunk < end, run.stdout

    def result(name, shape):
        return np.fromfile(tmp_path / f"{name}.bin", dtype=np.float32).reshape(shape)

    heads_first, cache = (b, hq, length, d), (b, hkv, capacity, d)
    for name, shape in (("out", heads_first), ("kc", cache), ("vc", cache)):
        np.testing.assert_array_equal(
            result(f"{name}_fold", shape), result(f"{name}_chain", shape), err_msg=name
        )

    if not qk_norm:
        inputs[3] = inputs[4] = None
    expected, exp_k, exp_v = step_f64(*inputs, offset, EPS, BASE)
    out = result("out_fold", heads_first).transpose(0, 2, 1, 3).reshape(b, length, hq * d)
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(out, expected, **tol, err_msg="vs float64")
    kc, vc = result("kc_fold", cache), result("vc_fold", cache)
    np.testing.assert_allclose(
        kc[:, :, offset:end], exp_k[:, :, offset:end], **TOLERANCE[dtype], err_msg="new keys"
    )
    np.testing.assert_array_equal(vc[:, :, offset:end], exp_v[:, :, offset:end])
    before_k, before_v = (np.array(x.astype(mx.float32)) for x in inputs[5:])
    for got, before in ((kc, before_k), (vc, before_v)):
        np.testing.assert_array_equal(got[:, :, :offset], before[:, :, :offset])
        np.testing.assert_array_equal(got[:, :, end:], before[:, :, end:])


@pytest.mark.parametrize(("d", "base"), [(128, 1_000_000.0), (64, 10_000.0), (128, 500_000.0)])
def test_rotations_in_float32(emulator, tmp_path, d, base):
    """rope_cos_sin (float32: a three-part reduction by pi/2 and polynomials) against float64's
    cosine and sine of the same float32 angle, at positions up to 131080 (angles up to 2^17, where
    a careless reduction loses everything), within one unit of 2^-23; and the angles are the
    float32 products of the float64 step (step_reference.rope_angles)."""
    rng = np.random.default_rng(d)
    positions = np.unique(
        np.concatenate(
            [np.arange(0, 300), rng.integers(0, 131081, 3000), np.arange(131000, 131081)]
        )
    ).astype(np.int32)
    (tmp_path / "rotations.txt").write_text(f"{d} {base}\n")
    (tmp_path / "positions.bin").write_bytes(positions.tobytes())
    subprocess.run(
        [str(emulator), "--rotations", str(tmp_path)], check=True, timeout=600, capture_output=True
    )
    got = np.fromfile(tmp_path / "rotations.bin", dtype=np.float32)
    got = got.reshape(len(positions), d // 2, 3).astype(np.float64)
    angle, cos, sin = got[..., 0], got[..., 1], got[..., 2]
    np.testing.assert_array_equal(angle, rope_angles(positions, d, base))
    np.testing.assert_allclose(cos, np.cos(angle), rtol=0, atol=2.0**-23)
    np.testing.assert_allclose(sin, np.sin(angle), rtol=0, atol=2.0**-23)
