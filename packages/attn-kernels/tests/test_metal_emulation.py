"""The Metal kernel source, run on the CPU under the SIMT emulation (kernels-metal/emulation).

What this proves: the kernel's algorithm, indexing, strides, masks, GQA mapping, SIMD-group
reductions and threadgroup-barrier protocol give the right answer when every thread of a
threadgroup runs with Metal's execution semantics as emulated (32-lane SIMD groups that reduce
together, a full-threadgroup barrier, per-threadgroup memory). What it cannot: that Apple's
Metal compiler accepts the file, the exact precision of fast::exp and of real half/bfloat
hardware paths, GPU memory-model subtleties beyond barriers, threadgroup-memory limits at
launch, and speed. Those need a Mac (see .github/workflows/macos-metal.yml).
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import range_mask
from conftest import TOLERANCE
from emulation import CSRC, KERNELS_METAL, build_runner, write_row_ranges
from reference import assert_matches_nonfinite, attention_f64
from tiers import few, few_rows

MASK_KINDS = {"none": 0, "float32": 1, "float16": 2, "bfloat16": 3, "bool": 4}


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory, KERNELS_METAL / "emulation" / "run_decode_attention.cpp", f"-I{CSRC}"
    )


def storage(a: np.ndarray, dtype: str) -> bytes:
    """float64 data as the kernel's storage type (bfloat16: round-to-nearest-even bits)."""
    if dtype == "float32":
        return a.astype(np.float32).tobytes()
    if dtype == "float16":
        return a.astype(np.float16).tobytes()
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def from_storage(data: bytes, dtype: str, shape) -> np.ndarray:
    """The kernel's storage type's bytes as float64 (bfloat16: its bits above 16 zero bits)."""
    raw = np.frombuffer(data, dtype=STORAGE[dtype])
    if dtype == "bfloat16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float64).reshape(shape)


def quantized(a: np.ndarray, dtype: str) -> np.ndarray:
    return from_storage(storage(a, dtype), dtype, a.shape)


def mask_storage(mask, mask_kind: str) -> bytes:
    """mask.bin's bytes: one zero byte for no mask."""
    if mask is None:
        return b"\0"
    if mask_kind == "bool":
        return mask.astype(np.bool_).tobytes()
    return storage(mask, mask_kind)


def run_runner(exe, folder, dtype: str, shape) -> np.ndarray:
    """Run an emulation runner on its input files in `folder`; its out.bin as float64."""
    subprocess.run([str(exe), str(folder)], check=True, timeout=120)
    return from_storage((folder / "out.bin").read_bytes(), dtype, shape)


def run_kernel(
    exe,
    tmp_path,
    q,
    k_buf,
    v_buf,
    context,
    mask,
    mask_kind,
    causal,
    dtype,
    groups,
    scale,
    starts=None,
    ends=None,
):
    """The runner on these inputs: K/V are (B, Hkv, capacity, D) buffers of which the call reads
    the first `context` positions; starts/ends: per-row ranges (int sequences) or None."""
    b, hq, length, d = q.shape
    hkv, capacity = k_buf.shape[1], k_buf.shape[2]
    row_ranges = write_row_ranges(tmp_path, starts, ends)
    (tmp_path / "config.txt").write_text(
        f"{dtype} {groups} {b} {hq} {hkv} {length} {context} {d} {capacity} {int(causal)} "
        f"{MASK_KINDS.get(mask_kind, 0)} {float(scale)!r} {row_ranges}\n"
    )
    (tmp_path / "q.bin").write_bytes(storage(q, dtype))
    (tmp_path / "k.bin").write_bytes(storage(k_buf, dtype))
    (tmp_path / "v.bin").write_bytes(storage(v_buf, dtype))
    (tmp_path / "mask.bin").write_bytes(mask_storage(mask, mask_kind))
    return run_runner(exe, tmp_path, dtype, (b, hq, length, d))


CASES = [
    # (batch, Hq, Hkv, L, S, D, mask, dtype, groups)
    (1, 8, 2, 1, 129, 128, "none", "bfloat16", 32),
    (1, 8, 2, 1, 129, 128, "none", "bfloat16", 16),
    (1, 8, 2, 1, 129, 128, "none", "bfloat16", 8),
    (2, 2, 2, 1, 31, 128, "none", "float32", 8),
    (1, 8, 2, 8, 31, 128, "causal", "float16", 8),
    (1, 4, 1, 8, 8, 72, "causal", "float32", 8),
    (1, 8, 2, 2, 255, 128, "causal", "bfloat16", 32),
    (1, 4, 4, 1, 1, 128, "none", "float16", 16),
    (1, 8, 2, 3, 40, 256, "float32", "float32", 16),
    (1, 4, 2, 2, 33, 40, "bool", "bfloat16", 8),
    (1, 4, 2, 2, 50, 128, "bfloat16", "bfloat16", 8),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "s", "d", "mask_kind", "dtype", "groups"),
    few_rows(CASES, *(CASES[i] for i in (1, 2, 4, 6, 8, 9))),  # quick: each schedule, mask, dtype
)
def test_metal_kernel_under_emulation(
    emulator, tmp_path, b, hq, hkv, length, s, d, mask_kind, dtype, groups
):
    rng = np.random.default_rng(s * 131 + length * 7 + d + groups)
    capacity = s + 5  # K/V are views of a longer cache buffer
    q = rng.standard_normal((b, hq, length, d))
    k_buf = rng.standard_normal((b, hkv, capacity, d))
    v_buf = rng.standard_normal((b, hkv, capacity, d))
    causal = mask_kind == "causal"
    mask = None
    if mask_kind == "bool":
        mask = rng.random((b, hq, length, s)) < 0.8
        mask[0, 1, 0, :] = False  # a row with nothing visible: zeros
    elif mask_kind not in ("none", "causal"):
        mask = np.where(
            rng.random((b, hq, length, s)) < 0.2, -np.inf, rng.standard_normal((b, hq, length, s))
        )
    scale = 1.0 / np.sqrt(d)
    out = run_kernel(
        emulator, tmp_path, q, k_buf, v_buf, s, mask, mask_kind, causal, dtype, groups, scale
    )

    as_mx = lambda a: mx.array(quantized(a, dtype).astype(np.float32))  # noqa: E731
    if mask is None:
        ref_mask = "causal" if causal else None
    elif mask_kind == "bool":
        ref_mask = mx.array(mask)
    else:
        ref_mask = mx.array(quantized(mask, mask_kind).astype(np.float32))
    expected = attention_f64(
        as_mx(q), as_mx(k_buf[:, :, :s]), as_mx(v_buf[:, :, :s]), scale=scale, mask=ref_mask
    )
    np.testing.assert_allclose(out, expected, **TOLERANCE[getattr(mx, dtype)])
    if mask_kind == "bool":
        assert np.all(out[0, 1, 0] == 0.0)


NONFINITE = [
    ("q", np.nan),
    ("q", np.inf),
    ("k", np.nan),
    ("k", -np.inf),
    ("v", np.nan),
    ("v", np.inf),
    ("scale", np.nan),
    ("scale", np.inf),
    ("mask", np.nan),
    ("mask", np.inf),
    ("bool", np.nan),
]


@pytest.mark.parametrize(("where", "value"), NONFINITE)
def test_nonfinite_values_under_emulation(emulator, tmp_path, where, value):
    """The contract's non-finite rules (attention.py): NaN and +inf scores make their row NaN,
    values reach their dimensions, a boolean mask removes a key whatever its score."""
    b, hq, hkv, length, s, d, groups = 1, 4, 2, 2, 45, 72, 8
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, hq, length, d))
    k_buf = rng.standard_normal((b, hkv, s + 3, d))
    v_buf = rng.standard_normal((b, hkv, s + 3, d))
    scale, mask, mask_kind = 1.0 / np.sqrt(d), None, "none"
    pos = 37  # a later position than the first each SIMD group visits
    if where == "q":
        q[0, 1, 1, 5] = value
    elif where in ("k", "v"):
        (k_buf if where == "k" else v_buf)[0, 0, pos, 5] = value
    elif where == "scale":
        scale = value
    elif where == "mask":
        mask, mask_kind = np.zeros((b, hq, length, s)), "float32"
        mask[0, 1, 1, pos] = value
    else:
        k_buf[0, 0, pos, :] = value
        mask, mask_kind = np.ones((b, hq, length, s), dtype=bool), "bool"
        mask[:, :, :, pos] = False
    out = run_kernel(
        emulator, tmp_path, q, k_buf, v_buf, s, mask, mask_kind, False, "float32", groups, scale
    )
    as_mx = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    ref_mask = None if mask is None else as_mx(mask) if mask.dtype != bool else mx.array(mask)
    expected = attention_f64(
        as_mx(q), as_mx(k_buf[:, :, :s]), as_mx(v_buf[:, :, :s]), scale=scale, mask=ref_mask
    )
    if where != "bool" and not (where == "k" and value == -np.inf):
        assert not np.isfinite(expected).all()  # the case reaches the output
    assert_matches_nonfinite(out, expected, **TOLERANCE[mx.float32])


@pytest.mark.parametrize("causal", few([False, True], True))
def test_row_ranges_under_emulation(emulator, tmp_path, causal):
    """Per-row cache ranges (starts, ends) against the mask they stand for: a row of the whole
    cache, an empty one (zeros), ragged ones."""
    b, hq, hkv, length, s, d, groups = 4, 8, 2, 2, 90, 64, 8
    rng = np.random.default_rng(int(causal))
    q = rng.standard_normal((b, hq, length, d))
    k_buf = rng.standard_normal((b, hkv, s + 3, d))
    v_buf = rng.standard_normal((b, hkv, s + 3, d))
    starts, ends = [0, 40, 7, 60], [90, 40, 51, 62]
    scale = 1.0 / np.sqrt(d)
    out = run_kernel(
        emulator, tmp_path, q, k_buf, v_buf, s, None, "none", causal, "float32", groups, scale,
        starts=starts, ends=ends,
    )  # fmt: skip
    as_mx = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    keep = range_mask(b, length, s, mx.array(starts), mx.array(ends), causal)
    expected = attention_f64(
        as_mx(q), as_mx(k_buf[:, :, :s]), as_mx(v_buf[:, :, :s]), scale=scale, mask=keep
    )
    np.testing.assert_allclose(out, expected, **TOLERANCE[mx.float32])
    assert not out[1].any()
