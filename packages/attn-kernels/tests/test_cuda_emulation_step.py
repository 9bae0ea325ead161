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
from quantize_reference import mlx_quantize
from step_reference import make_step, ragged_step_f64, ring_step_f64, rope_angles, step_f64
from tiers import few_rows

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
    # head dims that are not multiples of 64 (Phi-3's 96, 80): contiguous slices, narrower loads
    (1, 8, 2, 4, 96, mx.bfloat16, 3, 64, True),
    (1, 4, 4, 1, 96, mx.float16, 2, 64, False),
    (1, 4, 4, 3, 80, mx.float16, 2, 64, True),
    (1, 8, 2, 8, 80, mx.bfloat16, 1, 0, True),
    (1, 8, 4, 2, 256, mx.bfloat16, 2, 64, True),  # Gemma's: V loaded after the scores
    (1, 8, 2, 1, 256, mx.float16, 4, 64, False),  # 4 vectors: one merge part at D = 256
    (1, 8, 2, 2, 256, mx.bfloat16, 3, 64, True),  # 8: the merge in two parts of 4
]


def run_step(emulator, tmp_path, config: str, inputs, hq: int, **int32_files):
    """The runner on `inputs` (q, k, v, both norm weights, both caches; written as float32) with
    the config line and any int32 files (starts, offsets): the folded kernel and the chain must
    write the same output and caches bit for bit, and split-mma-16's kernel the chain's output
    where it runs. Returns its stdout and the folded kernel's
    output as (B, L, Hq * D) and caches."""
    (tmp_path / "config.txt").write_text(config + "\n")
    for name, x in zip(("q", "k", "v", "qw", "kw", "kc", "vc"), inputs, strict=True):
        (tmp_path / f"{name}.bin").write_bytes(np.array(x.astype(mx.float32)).tobytes())
    for name, values in int32_files.items():
        (tmp_path / f"{name}.bin").write_bytes(np.asarray(values, np.int32).tobytes())
    run = subprocess.run(
        [str(emulator), str(tmp_path)], check=True, timeout=600, capture_output=True, text=True
    )
    b, length = inputs[0].shape[:2]
    cache = inputs[5].shape
    d = cache[-1]

    def result(name, shape):
        return np.fromfile(tmp_path / f"{name}.bin", dtype=np.float32).reshape(shape)

    heads_first = (b, hq, length, d)
    for name, shape in (("out", heads_first), ("kc", cache), ("vc", cache)):
        np.testing.assert_array_equal(
            result(f"{name}_fold", shape), result(f"{name}_chain", shape), err_msg=name
        )
    # split-mma-16 (more than 8 vectors per KV head): each vector's scores, weights and sums run
    # in the same order as in 8-vector tiles, so the same bits.
    if hq // cache[1] * length > 8 and d <= 128:
        np.testing.assert_array_equal(
            result("out_wide", heads_first), result("out_chain", heads_first), err_msg="wide"
        )
    out = result("out_fold", heads_first).transpose(0, 2, 1, 3).reshape(b, length, hq * d)
    return run.stdout, out, result("kc_fold", cache), result("vc_fold", cache)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "d", "dtype", "splits", "chunk", "qk_norm"),
    few_rows(CASES, CASES[2], CASES[11], CASES[12], CASES[14], CASES[16], CASES[18]),
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
    inputs = list(make_step(end + d + splits, b, hq, hkv, length, d, capacity, dtype))
    config = (
        f"{b} {hq} {hkv} {length} {offset} {d} {int(dtype == mx.bfloat16)} {splits} {capacity} "
        f"{int(qk_norm)}"
    )
    stdout, out, kc, vc = run_step(emulator, tmp_path, config, inputs, hq)
    got_splits, got_chunk = (int(n) for n in stdout.split()[1:4:2])
    assert got_splits == splits, stdout
    if splits > 1:  # the new positions reach the last chunk's first position
        assert got_chunk == chunk and offset <= (splits - 1) * chunk < end, stdout

    if not qk_norm:
        inputs[3] = inputs[4] = None
    expected, exp_k, exp_v = step_f64(*inputs, offset, EPS, BASE)
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(out, expected, **tol, err_msg="vs float64")
    np.testing.assert_allclose(
        kc[:, :, offset:end], exp_k[:, :, offset:end], **TOLERANCE[dtype], err_msg="new keys"
    )
    np.testing.assert_array_equal(vc[:, :, offset:end], exp_v[:, :, offset:end])
    before_k, before_v = (np.array(x.astype(mx.float32)) for x in inputs[5:])
    for got, before in ((kc, before_k), (vc, before_v)):
        np.testing.assert_array_equal(got[:, :, :offset], before[:, :, :offset])
        np.testing.assert_array_equal(got[:, :, end:], before[:, :, end:])


# (Hq, Hkv, D, dtype, splits, window, slot): a full ring (position), its slot in the first, a
# middle or the last chunk, so that the folded kernel's block that writes it is not always the
# first.
RING_CASES = [
    (8, 4, 256, mx.bfloat16, 2, 300, 0),  # Gemma 3's heads and head dim
    (8, 4, 256, mx.bfloat16, 3, 300, 299),
    (32, 8, 128, mx.float16, 4, 521, 200),
    (4, 4, 80, mx.bfloat16, 1, 37, 5),
]


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype", "splits", "window", "slot"),
    few_rows(RING_CASES, RING_CASES[0], RING_CASES[2]),  # slot 0 of 2 chunks, 200 of 4
)
def test_ring_under_emulation(emulator, tmp_path, hq, hkv, d, dtype, splits, window, slot):
    """A full ring: the new token rotated at its sequence position, written at its slot, and
    attending every position of the caches, in both kernels alike."""
    position = 5 * window + slot
    inputs = list(make_step(window + slot, 1, hq, hkv, 1, d, window, dtype))
    config = f"1 {hq} {hkv} 1 {slot} {d} {int(dtype == mx.bfloat16)} {splits} {window} 1 {position}"
    _, out, kc, vc = run_step(emulator, tmp_path, config, inputs, hq)
    expected, exp_k, exp_v = ring_step_f64(*inputs, slot, position, EPS, BASE)
    tol = {key: 2 * value for key, value in TOLERANCE[dtype].items()}
    np.testing.assert_allclose(out, expected, **tol, err_msg="vs float64")
    at = slice(slot, slot + 1)
    np.testing.assert_allclose(kc[:, :, at], exp_k[:, :, at], **TOLERANCE[dtype])
    np.testing.assert_array_equal(vc[:, :, at], exp_v[:, :, at])
    before_k, before_v = (np.array(x.astype(mx.float32)) for x in inputs[5:])
    for got, before in ((kc, before_k), (vc, before_v)):
        np.testing.assert_array_equal(got[:, :, :slot], before[:, :, :slot])
        np.testing.assert_array_equal(got[:, :, slot + 1 :], before[:, :, slot + 1 :])


# (batch, Hq, Hkv, L, D, splits): rows of their own ranges (a start and a write position per
# row), split or not, so that a chunk holds some rows' new positions and not others'.
RAGGED_CASES = [
    (3, 8, 2, 1, 128, 1),
    (4, 16, 2, 2, 64, 3),
    (2, 8, 8, 8, 128, 2),
    (3, 4, 4, 2, 96, 2),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "d", "splits"), few_rows(RAGGED_CASES, RAGGED_CASES[0])
)
def test_ragged_rows_under_emulation(emulator, tmp_path, b, hq, hkv, length, d, splits):
    """Per-row starts and write positions (mlx-lm's left padding, rows of different lengths):
    each row rotated at its own position, written at its own place and attending to its own range,
    in both kernel paths (the preprocessing kernel then attend_mma, and the folded kernel)."""
    rng = np.random.default_rng(b * 13 + length + splits)
    offsets = rng.integers(length, 180, b).astype(np.int32)
    starts = rng.integers(0, offsets + 1).astype(np.int32)
    offset = int(offsets.max())
    capacity = offset + length + 3
    inputs = make_step(b + d, b, hq, hkv, length, d, capacity, mx.bfloat16)
    config = f"{b} {hq} {hkv} {length} {offset} {d} 1 {splits} {capacity} 1"
    _, out, kc, vc = run_step(
        emulator, tmp_path, config, inputs, hq, starts=starts, offsets=offsets
    )
    expected, exp_k, exp_v = ragged_step_f64(*inputs, starts, offsets, EPS, BASE)
    tol = {key: 2 * value for key, value in TOLERANCE[mx.bfloat16].items()}
    np.testing.assert_allclose(out, expected, **tol, err_msg="vs float64")
    for r in range(b):
        at = slice(int(offsets[r]), int(offsets[r]) + length)
        np.testing.assert_allclose(kc[r, :, at], exp_k[r, :, at], **TOLERANCE[mx.bfloat16])
        np.testing.assert_array_equal(vc[r, :, at], exp_v[r, :, at])


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


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 128), (4, 32)])
def test_quantize_reference_is_mx_quantize_on_the_cpu(bits, group_size):
    """The NumPy transcription's CPU rule gives mx.quantize's CPU bits (so the CUDA rule, which
    differs from it in two named places, is read from MLX's source the same way)."""
    w = (3.0 * mx.random.normal((4, 3, 50, 256), key=mx.random.key(bits))).astype(mx.bfloat16)
    w = mx.concatenate([w, mx.abs(w), -mx.abs(w)], axis=0)  # groups all of one sign too
    codes, scales, biases = mx.quantize(w, group_size=group_size, bits=bits, stream=mx.cpu)
    ref_codes, ref_scales, ref_biases = mlx_quantize(
        np.array(w.astype(mx.float32)), group_size, bits, "cpu"
    )
    np.testing.assert_array_equal(np.array(codes), ref_codes)
    for got, ref in ((scales, ref_scales), (biases, ref_biases)):
        expected = mx.array(ref).astype(mx.bfloat16).astype(mx.float32)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(expected))


# (batch, Hq, Hkv, L, offset, D, dtype, qk_norm, bits, group_size)
QUANTIZED_CASES = [
    (1, 8, 2, 1, 100, 128, mx.bfloat16, True, 4, 64),
    (1, 8, 2, 3, 255, 128, mx.float16, True, 8, 64),
    (2, 4, 4, 2, 0, 64, mx.bfloat16, True, 4, 32),
    (1, 16, 4, 1, 7, 256, mx.bfloat16, True, 8, 128),
    (1, 8, 2, 2, 40, 128, mx.float16, False, 4, 128),
    (1, 4, 2, 1, 0, 64, mx.bfloat16, False, 8, 32),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "offset", "d", "dtype", "qk_norm", "bits", "group_size"),
    QUANTIZED_CASES,
    ids=[
        f"B{c[0]}-hq{c[1]}-hkv{c[2]}-L{c[3]}-o{c[4]}-D{c[5]}-{str(c[6]).split('.')[-1]}"
        f"-b{c[8]}-g{c[9]}" + ("" if c[7] else "-nonorm")
        for c in QUANTIZED_CASES
    ],
)
def test_quantized_preprocessing_under_emulation(
    emulator, tmp_path, b, hq, hkv, length, offset, d, dtype, qk_norm, bits, group_size
):
    """step_preprocess with StepProblem::bits (quantize_row) writes, at the new positions, the
    triple that MLX's CUDA mx.quantize (the NumPy transcription) makes of the keys and values the
    same kernel writes into a cache of the dtype, bit for bit; nothing else; the queries as
    without quantization."""
    end = offset + length
    capacity = end + 3
    keys = mx.random.split(mx.random.key(end + d + bits), 5)
    inputs = [
        mx.random.normal((b, length, hq * d), key=keys[0]),
        2.0 * mx.random.normal((b, length, hkv * d), key=keys[1]),
        mx.random.normal((b, length, hkv * d), key=keys[2]) + 0.5,
        1.0 + 0.2 * mx.random.normal((d,), key=keys[3]),
        1.0 + 0.2 * mx.random.normal((d,), key=keys[4]),
    ]
    # Value head 0 all negative: the CUDA rule's maximum starts at 0 (its bias is then 0).
    v = inputs[2].reshape(b, length, hkv, d)
    inputs[2] = mx.concatenate([-mx.abs(v[:, :, :1]) - 0.1, v[:, :, 1:]], axis=2).reshape(
        b, length, hkv * d
    )
    inputs = [x.astype(dtype) for x in inputs]
    (tmp_path / "config.txt").write_text(
        f"{b} {hq} {hkv} {length} {offset} {d} {int(dtype == mx.bfloat16)} {capacity} "
        f"{int(qk_norm)} {bits} {group_size}\n"
    )
    for name, x in zip(("q", "k", "v", "qw", "kw"), inputs, strict=True):
        (tmp_path / f"{name}.bin").write_bytes(np.array(x.astype(mx.float32)).tobytes())
    subprocess.run(
        [str(emulator), "--quantized", str(tmp_path)], check=True, timeout=600, capture_output=True
    )

    def result(name, shape, dtype=np.float32):
        return np.fromfile(tmp_path / f"{name}.bin", dtype=dtype).reshape(shape)

    np.testing.assert_array_equal(
        result("q_quant", (b, hq, length, d)), result("q_plain", (b, hq, length, d))
    )
    words, groups = d * bits // 32, d // group_size
    for c in "kv":
        plain = result(f"{c}c_plain", (b, hkv, capacity, d))
        codes = result(f"{c}codes", (b, hkv, capacity, words), np.uint32)
        scales = result(f"{c}scales", (b, hkv, capacity, groups))
        biases = result(f"{c}biases", (b, hkv, capacity, groups))
        ref_codes, ref_scales, ref_biases = mlx_quantize(
            plain[:, :, offset:end], group_size, bits, "cuda"
        )
        np.testing.assert_array_equal(codes[:, :, offset:end], ref_codes, err_msg=f"{c} codes")
        for got, ref, name in ((scales, ref_scales, "scales"), (biases, ref_biases, "biases")):
            expected = np.array(mx.array(ref).astype(dtype).astype(mx.float32))
            np.testing.assert_array_equal(got[:, :, offset:end], expected, err_msg=f"{c} {name}")
        for got in (codes, scales, biases):  # every other position still zero
            assert not got[:, :, :offset].any() and not got[:, :, end:].any()
