"""The Metal quantized-KV kernel source, run on the CPU under the SIMT emulation
(kernels-metal/emulation), against float64 attention over the dequantised cache.

What this proves and what it cannot: as test_metal_emulation.py says for the bf16 kernel (the
algorithm, indexing, strides, masks, GQA mapping and barrier protocol as emulated; not Apple's
compiler, real half/bfloat paths, the launcher or speed)."""

import mlx.core as mx
import numpy as np
import pytest
from attn_kernels import range_mask
from conftest import TOLERANCE
from emulation import CSRC, KERNELS_METAL, build_runner, write_row_ranges
from reference import attention_f64
from test_metal_emulation import MASK_KINDS, mask_storage, quantized, run_runner, storage


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    return build_runner(
        tmp_path_factory,
        KERNELS_METAL / "emulation" / "run_decode_attention_quantized.cpp",
        f"-I{CSRC}",
    )


def to_storage(a: mx.array) -> bytes:
    if a.dtype == mx.uint32:
        return np.array(a).astype(np.uint32).tobytes()
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).tobytes()
    return np.array(a).tobytes()


def run_kernel(
    exe,
    tmp_path,
    q,
    k_triple,
    v_triple,
    context,
    mask,
    mask_kind,
    causal,
    dtype,
    groups,
    bits,
    group_size,
    scale=None,
    starts=None,
    ends=None,
):
    """The runner on these inputs: mx.quantize triples of (B, Hkv, capacity, ·) of which the
    call reads the first `context` positions; starts/ends: per-row ranges or None."""
    b, hq, length, d = q.shape
    hkv, capacity = k_triple[0].shape[1], k_triple[0].shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    row_ranges = write_row_ranges(tmp_path, starts, ends)
    (tmp_path / "config.txt").write_text(
        f"{dtype} {groups} {b} {hq} {hkv} {length} {context} {d} {capacity} {int(causal)} "
        f"{MASK_KINDS.get(mask_kind, 0)} {float(scale)!r} {bits} {group_size} {row_ranges}\n"
    )
    (tmp_path / "q.bin").write_bytes(storage(q, dtype))
    for name, array in zip(
        ("kc", "ks", "kb", "vc", "vs", "vb"), (*k_triple, *v_triple), strict=True
    ):
        (tmp_path / f"{name}.bin").write_bytes(to_storage(array))
    (tmp_path / "mask.bin").write_bytes(mask_storage(mask, mask_kind))
    return run_runner(exe, tmp_path, dtype, (b, hq, length, d))


# (batch, Hq, Hkv, L, S, D, mask, dtype, groups, bits, group_size)
CASES = [
    (1, 8, 2, 1, 129, 128, "none", "bfloat16", 8, 8, 64),
    (1, 8, 2, 1, 129, 128, "none", "bfloat16", 4, 4, 64),
    (2, 2, 2, 1, 31, 128, "none", "float32", 8, 4, 32),
    (1, 8, 2, 8, 31, 128, "causal", "float16", 8, 8, 128),
    (1, 12, 2, 3, 77, 64, "causal", "float32", 4, 8, 32),
    (1, 4, 4, 1, 1, 128, "none", "float16", 8, 4, 128),
    (1, 8, 2, 3, 40, 256, "float32", "float32", 4, 4, 64),
    (1, 4, 2, 2, 33, 96, "bool", "bfloat16", 8, 8, 32),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "length", "s", "d", "mask_kind", "dtype", "groups", "bits", "group_size"),
    CASES,
)
def test_metal_quantized_kernel_under_emulation(
    emulator, tmp_path, b, hq, hkv, length, s, d, mask_kind, dtype, groups, bits, group_size
):
    rng = np.random.default_rng(s * 131 + length * 7 + d + groups + bits)
    capacity = s + 5  # K/V are views of a longer cache buffer
    q = rng.standard_normal((b, hq, length, d))
    as_dtype = lambda a: mx.array(quantized(a, dtype).astype(np.float32)).astype(  # noqa: E731
        getattr(mx, dtype)
    )
    k_triple = mx.quantize(as_dtype(rng.standard_normal((b, hkv, capacity, d))), group_size, bits)
    v_triple = mx.quantize(as_dtype(rng.standard_normal((b, hkv, capacity, d))), group_size, bits)
    causal = mask_kind == "causal"
    mask = None
    if mask_kind == "bool":
        mask = rng.random((b, hq, length, s)) < 0.8
        mask[0, 1, 0, :] = False  # a row with nothing visible: zeros
    elif mask_kind not in ("none", "causal"):
        mask = np.where(
            rng.random((b, hq, length, s)) < 0.2, -np.inf, rng.standard_normal((b, hq, length, s))
        )
    out = run_kernel(
        emulator, tmp_path, q, k_triple, v_triple, s, mask, mask_kind, causal, dtype, groups,
        bits, group_size,
    )  # fmt: skip

    def dequantized(triple):
        codes, scales, biases = (a[:, :, :s] for a in triple)
        return mx.dequantize(
            codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits
        )

    if mask is None:
        ref_mask = "causal" if causal else None
    elif mask_kind == "bool":
        ref_mask = mx.array(mask)
    else:
        ref_mask = mx.array(quantized(mask, mask_kind).astype(np.float32))
    expected = attention_f64(
        mx.array(quantized(q, dtype).astype(np.float32)),
        dequantized(k_triple),
        dequantized(v_triple),
        scale=1.0 / np.sqrt(d),
        mask=ref_mask,
    )
    np.testing.assert_allclose(out, expected, **TOLERANCE[getattr(mx, dtype)])
    if mask_kind == "bool":
        assert np.all(out[0, 1, 0] == 0.0)


def test_nan_query_gives_a_nan_row_under_emulation(emulator, tmp_path):
    """The contract's NaN rule (attention.py): a NaN in a query makes its whole row NaN, never
    zeros; the other rows are untouched."""
    b, hq, hkv, length, s, d, bits, group_size = 1, 8, 2, 1, 70, 64, 4, 32
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, hq, length, d))
    q[0, 5, 0, 7] = np.nan
    triples = [
        mx.quantize(
            mx.array(rng.standard_normal((b, hkv, s, d)).astype(np.float32)), group_size, bits
        )
        for _ in range(2)
    ]
    out = run_kernel(
        emulator, tmp_path, q, *triples, s, None, "none", False, "float32", 8, bits, group_size
    )
    assert np.isnan(out[0, 5, 0]).all()
    others = np.delete(out[0], 5, axis=0)
    assert np.isfinite(others).all()


def test_row_ranges_under_emulation(emulator, tmp_path):
    """Per-row cache ranges against the mask they stand for (an empty row: zeros)."""
    b, hq, hkv, length, s, d, bits, group_size = 3, 8, 2, 1, 70, 64, 8, 32
    rng = np.random.default_rng(4)
    q = rng.standard_normal((b, hq, length, d))
    triples = [
        mx.quantize(
            mx.array(rng.standard_normal((b, hkv, s, d)).astype(np.float32)), group_size, bits
        )
        for _ in range(2)
    ]
    starts, ends = [5, 30, 0], [70, 30, 44]
    out = run_kernel(
        emulator, tmp_path, q, *triples, s, None, "none", True, "float32", 8, bits, group_size,
        starts=starts, ends=ends,
    )  # fmt: skip
    k, v = (mx.dequantize(*t, group_size, bits) for t in triples)
    keep = range_mask(b, length, s, mx.array(starts), mx.array(ends), True)
    expected = attention_f64(mx.array(q.astype(np.float32)), k, v, mask=keep)
    np.testing.assert_allclose(out, expected, **TOLERANCE[mx.float32])
    assert not out[1].any()
