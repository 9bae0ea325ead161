"""The Metal attention step (kernels-metal/attention_step.metal, then decode_attention.metal, as
the launcher sequences them) run on the CPU under the SIMT emulation, against the float64 step.

What this proves and what it cannot: as test_metal_emulation.py says for the attention kernel
(no Apple compiler, precise sin/cos and real half/bfloat paths, the launcher, speed: a Mac's).
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from conftest import TOLERANCE
from emulation import CSRC, KERNELS_METAL, build_runner
from reference import to_numpy
from step_reference import ragged_step_f64, ring_step_f64, step_f64
from test_metal_emulation import from_storage, quantized, storage
from tiers import few_rows

EPS, BASE = 1e-6, 1_000_000.0


@pytest.fixture(scope="session")
def step_emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory, KERNELS_METAL / "emulation" / "run_attention_step.cpp", f"-I{CSRC}"
    )


def read(path, dtype, shape):
    return from_storage(path.read_bytes(), dtype, shape)


CASES = [
    # (batch, Hq, Hkv, L, D, offset, capacity, dtype, groups, q/k norm)
    (1, 8, 2, 1, 128, 255, 256, "bfloat16", 32, True),
    (1, 4, 4, 3, 64, 100, 256, "float32", 8, True),
    (1, 8, 2, 8, 128, 256, 512, "float16", 16, True),
    (2, 4, 1, 2, 80, 17, 256, "bfloat16", 8, True),
    (1, 32, 8, 1, 128, 0, 256, "float16", 32, True),
    # Without q/k norm (Llama, Qwen2): no weight files, the kernel must not read them.
    (1, 32, 8, 1, 128, 255, 256, "bfloat16", 32, False),
    (1, 8, 2, 3, 64, 254, 512, "float32", 8, False),
    (2, 4, 1, 8, 80, 300, 512, "float16", 16, False),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "d", "offset", "cap", "dtype", "groups", "qk_norm"),
    few_rows(CASES, *(CASES[i] for i in (1, 3, 4, 6))),  # quick: each dtype, norms or none
)
def test_metal_step_under_emulation(
    step_emulator, tmp_path, b, hq, hkv, length, d, offset, cap, dtype, groups, qk_norm
):
    rng = np.random.default_rng(offset * 7 + length + d + groups)
    arrays = {
        "q": rng.standard_normal((b, length, hq * d)),
        "k": 2.0 * rng.standard_normal((b, length, hkv * d)),
        "v": rng.standard_normal((b, length, hkv * d)),
        "q_norm": 1.0 + 0.2 * rng.standard_normal(d),
        "k_norm": 1.0 + 0.2 * rng.standard_normal(d),
        "k_cache": rng.standard_normal((b, hkv, cap, d)),
        "v_cache": rng.standard_normal((b, hkv, cap, d)),
    }
    if not qk_norm:
        del arrays["q_norm"], arrays["k_norm"]
    for name, a in arrays.items():
        (tmp_path / f"{name}.bin").write_bytes(storage(a, dtype))
    scale = float(1.0 / np.sqrt(d))
    (tmp_path / "config.txt").write_text(
        f"{dtype} {groups} {scale!r} {b} {length} {hq} {hkv} {d} {offset} {cap} {int(qk_norm)} "
        f"{EPS!r} {BASE!r}\n"
    )
    subprocess.run([str(step_emulator), str(tmp_path)], check=True, timeout=120)

    inputs = {name: mx.array(quantized(a, dtype).astype(np.float32)) for name, a in arrays.items()}
    expected, exp_k, exp_v = step_f64(
        *(inputs.get(name) for name in ("q", "k", "v", "q_norm", "k_norm", "k_cache", "v_cache")),
        offset,
        EPS,
        BASE,
    )
    out = read(tmp_path / "out.bin", dtype, (b, length, hq * d))
    new_k = read(tmp_path / "k_cache.bin", dtype, (b, hkv, cap, d))
    new_v = read(tmp_path / "v_cache.bin", dtype, (b, hkv, cap, d))
    tol = {key: 2 * value for key, value in TOLERANCE[getattr(mx, dtype)].items()}
    key_tol = dict(atol=2e-4, rtol=2e-4) if dtype == "float32" else tol
    np.testing.assert_allclose(out, expected, **tol)
    end = offset + length
    np.testing.assert_allclose(new_k[:, :, offset:end], exp_k[:, :, offset:end], **key_tol)
    np.testing.assert_array_equal(new_v[:, :, offset:end], exp_v[:, :, offset:end])
    before_k, before_v = to_numpy(inputs["k_cache"]), to_numpy(inputs["v_cache"])
    for got, before in ((new_k, before_k), (new_v, before_v)):
        np.testing.assert_array_equal(got[:, :, :offset], before[:, :, :offset])
        np.testing.assert_array_equal(got[:, :, end:], before[:, :, end:])


def emulate_float32(emulator, tmp_path, rng, shape, offset, position=None):
    """The emulated float32 step with q/k norms on random inputs of `shape` (b, hq, hkv, L, D,
    capacity, simdgroups), written at `offset` (a ring's slot with `position`); any starts.bin
    and offsets.bin already in tmp_path. Returns the inputs as MLX arrays (q, k, v, both norm
    weights, both caches) and the step's out, k_cache and v_cache."""
    b, hq, hkv, length, d, cap, groups = shape
    arrays = {
        "q": rng.standard_normal((b, length, hq * d)),
        "k": 2.0 * rng.standard_normal((b, length, hkv * d)),
        "v": rng.standard_normal((b, length, hkv * d)),
        "q_norm": 1.0 + 0.2 * rng.standard_normal(d),
        "k_norm": 1.0 + 0.2 * rng.standard_normal(d),
        "k_cache": rng.standard_normal((b, hkv, cap, d)),
        "v_cache": rng.standard_normal((b, hkv, cap, d)),
    }
    for name, a in arrays.items():
        (tmp_path / f"{name}.bin").write_bytes(storage(a, "float32"))
    scale = float(1.0 / np.sqrt(d))
    ring = "" if position is None else f" {position}"
    (tmp_path / "config.txt").write_text(
        f"float32 {groups} {scale!r} {b} {length} {hq} {hkv} {d} {offset} {cap} 1 "
        f"{EPS!r} {BASE!r}{ring}\n"
    )
    subprocess.run([str(emulator), str(tmp_path)], check=True, timeout=120)
    inputs = [mx.array(arrays[n].astype(np.float32)) for n in arrays]
    outputs = (
        read(tmp_path / "out.bin", "float32", (b, length, hq * d)),
        read(tmp_path / "k_cache.bin", "float32", (b, hkv, cap, d)),
        read(tmp_path / "v_cache.bin", "float32", (b, hkv, cap, d)),
    )
    return inputs, outputs


def test_metal_step_ragged_rows_under_emulation(step_emulator, tmp_path):
    """Per-row starts and write positions: each row rotated at its own position (from its
    start), written at its own place and attending to its own range."""
    b, hq, hkv, length, d, cap, groups = 3, 8, 2, 2, 64, 256, 8
    starts, offsets = np.array([0, 17, 90], np.int32), np.array([200, 33, 90], np.int32)
    (tmp_path / "starts.bin").write_bytes(starts.tobytes())
    (tmp_path / "offsets.bin").write_bytes(offsets.tobytes())
    shape = (b, hq, hkv, length, d, cap, groups)
    rng = np.random.default_rng(12)
    inputs, (out, new_k, new_v) = emulate_float32(
        step_emulator, tmp_path, rng, shape, offsets.max()
    )
    expected, exp_k, exp_v = ragged_step_f64(*inputs, starts, offsets, EPS, BASE)
    np.testing.assert_allclose(out, expected, **TOLERANCE[mx.float32])
    for r in range(b):
        at = slice(int(offsets[r]), int(offsets[r]) + length)
        np.testing.assert_allclose(new_k[r, :, at], exp_k[r, :, at], atol=2e-4, rtol=2e-4)
        np.testing.assert_array_equal(new_v[r, :, at], exp_v[r, :, at])


def test_metal_step_ring_under_emulation(step_emulator, tmp_path):
    """A full ring (position): the new token rotated at its sequence position, written at its
    slot, attending every position of the caches."""
    hq, hkv, d, window, slot, groups = 8, 4, 256, 45, 17, 8
    position = 4 * window + slot
    shape = (1, hq, hkv, 1, d, window, groups)
    rng = np.random.default_rng(13)
    inputs, (out, new_k, new_v) = emulate_float32(
        step_emulator, tmp_path, rng, shape, slot, position
    )
    expected, exp_k, exp_v = ring_step_f64(*inputs, slot, position, EPS, BASE)
    np.testing.assert_allclose(out, expected, **TOLERANCE[mx.float32])
    at = slice(slot, slot + 1)
    np.testing.assert_allclose(new_k[:, :, at], exp_k[:, :, at], atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(new_v[:, :, at], exp_v[:, :, at])
    for got, before in ((new_k, to_numpy(inputs[5])), (new_v, to_numpy(inputs[6]))):
        np.testing.assert_array_equal(got[:, :, :slot], before[:, :, :slot])
        np.testing.assert_array_equal(got[:, :, slot + 1 :], before[:, :, slot + 1 :])
