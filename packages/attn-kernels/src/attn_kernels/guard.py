"""Where the fused kernel runs: the measured region per backend, and the call that checks it.

Outside the region a caller uses the fallback, `mx.fast.scaled_dot_product_attention` (the
fastest correct path MLX has; the readable path is the test oracle and the chapter's baseline,
not a fallback). So every limit below is a crossover against `mx.fast`: the largest measured
point where the fused kernel was faster in every pass, and nothing past the largest measured
point (records in benchmark_results/, MLX 0.32.4, B=1, Hq=32, D=128, bf16).

cpu (2 vCPUs, Intel Xeon with AVX-512 bf16, as the notes of the time say; the records name
    only the CPU model):
    cpu-2core-qwen3-4b-attention-L1-mlx-0.32.4.json (and -run2, -1-call-per-eval-run3/-run4,
    -8-calls-per-eval): L=1, 3.1x (S=32) to 36.8x (S=16384) faster, every pass, every S <= 16384,
    the largest measured. cpu-2core-qwen3-4b-attention-L2-L8-causal-mlx-0.32.4.json: L = 2, 4, 8
    causal, 4.0x to 41.9x, every pass, every S <= 16384; the query and context sweeps agree.
    Explicit masks: cpu-2core-qwen3-4b-attention-explicit-mask-mlx-0.32.4.json, L=1 at S = 128
    and 1024 (5.9x, 19.3x, every pass).
cuda (H200):
    h200-qwen3-4b-attention-L1-mlx-0.32.4.json: L=1, 1.10x (S=1) to 3.41x (S=4096) and 1.15x at
    S=131072, the largest measured, every pass; chained calls
    (h200-qwen3-4b-attention-L1-long-chained, -L1-short-chained) 1.05x at S=131072 to 2.84x.
    h200-qwen3-4b-attention-L2-L8-causal-mlx-0.32.4.json: L = 2, 4, 8, 1.22x to 3.55x, every pass,
    every S <= 131072 (-L2-L8-long-chained: 3.2x to 11.2x). The short-context grid and sweeps
    (-grid-L1, -grid-L8-causal, -context-sweep, -query-sweep, -L1-short-independent) agree on
    the medians; the passes lost are near-ties at the per-call floor: S=129 L=1 in -grid-L1
    (1.00x, 1 of 2) and S = 32..192 L=1 in -context-sweep (1.04x-1.07x, 4-5 of 6 won).
    Explicit masks: h200-qwen3-4b-attention-explicit-mask-mlx-0.32.4.json, L = 1 and 2 at
    S = 128, 1024, 4096 (2.35x to 6.11x, every pass).
metal: no record of ours (no Mac here); the chapter's M4 Pro evidence (against the readable
    path, not mx.fast) covers L <= 2, S <= 256, no explicit mask. Kept until a Mac record exists.

Batches of rows with their own cache ranges (max_batch, max_batch_context; B = 1 is the region
above), against mx.fast with the boolean (B, 1, L, S) mask the ranges stand for, rows of lengths
between S/4 and S (bench-operators --batch B --ragged), L = 1 causal:
cpu (2-vCPU AMD EPYC, AVX2): cpu-2core-qwen3-4b-attention-B{4,16,32}-ragged-mlx-0.32.4.json: 17x
    (B=4, S=256) to 44x (B=32, S=1024), every pass, S <= 4096, the largest measured.
cuda (H200): h200-qwen3-4b-attention-B{8,32}-ragged-mlx-0.32.4.json: 4.65x (B=8, S=512) to 12.1x
    (B=32, S=8192), every pass, S <= 8192; beside them -B{8,32}-full (every row the whole
    cache, no ranges and no mask: 1.06x-2.87x): the ragged call at B=32, S=2048 takes 69.3 µs,
    less than the full batch's 78.1 (its rows hold fewer positions).

Over a quantized KV cache (decode_attention_quantized; QUANTIZED_LIMITS), the fallback is the
cache dequantised, then mx.fast:
cpu: cpu-2core-qwen3-4b-attention-quantized-{8,4}-bit-mlx-0.32.4.json: L=1, S = 1024..32768,
    every pass won against the dequantise-then-readable path (7.4-23x), mlx-lm's quantized path
    (22-36x) and mx.fast on bf16 K/V (4.7-8.2x), which the dequantise-then-mx.fast fallback
    cannot beat. On AVX2 (the kernel on the float kernel's body):
    cpu-2core-qwen3-4b-attention-quantized-{8,4}-bit-avx2-mlx-0.32.4.json, every pass won,
    15-27x mx.fast; L = 2, 4, 8 causal at S = 1024, 8192, 32768:
    cpu-2core-qwen3-4b-attention-quantized-{8,4}-bit-L2-L8-causal-avx2-mlx-0.32.4.json, every pass
    won against mx.fast on bf16 K/V (8 bits 15-28x, 4 bits 15-29x), so L <= 8. Head dims 64 and
    256 (QUANTIZED_FURTHER_HEAD_DIMS), on a 2-vCPU Xeon with AVX-512, through its AVX-512 and
    its AVX2 path: cpu-2core-{avx512,avx2}-attention-quantized-D{64,256}-{4,8}-bit-mlx-0.32.4.json,
    bf16, group 64, L = 1 and 8 causal at S = 1024, 8192, 32768: every pass won against mx.fast on
    bf16 K/V, D 64 10.2-28.8x (AVX2 path 9.05-22.9x), D 256 19.9-40.9x (17.0-32.9x). D 96 in
    group 32 (the one group that divides it; 80 takes none), a 2-vCPU EPYC with AVX-512, the same
    passes: cpu-2core-{avx512,avx2}-attention-quantized-D96-group-32-{4,8}-bit-mlx-0.32.4.json,
    every pass won, 11.1-32.4x (AVX2 path 8.6-27.0x), without GQA (Phi-3's heads, 4 bits)
    cpu-2core-avx512-attention-quantized-D96-G1-group-32-4-bit-mlx-0.32.4.json 5.7-24.5x; mlx-lm's
    quantized path 55-244x slower than ours (the 4-bit AVX-512 record).
cuda: benchmark_results/raw/h200-quantized-merge-split.txt (c139b75, the default kernel mmat4
    with the context split for two blocks per SM): L=1, group 64, 8 / 4 bits, S = 4096, 32768, 131072:
    16.0 / 16.1, 32.0 / 26.3, 83.1 / 56.8 µs against 32-48 (4096, 32768) and 136 for mx.fast on
    bf16 K/V (chained calls: 27.1 / 28.7, 47.9 / 43.2, 98.4 / 76.4 against 41-59 and 145-147),
    which the dequantise-then-mx.fast fallback cannot beat; groups 32 and 128 at S = 131072:
    83.6 / 57.3 and 77.6 / 51.2 µs (other S not timed; the same kernel with more or fewer scales
    to read); below S = 4096 and L > 1 not measured (the kernel's time there is launch-bound, as
    is mx.fast's, and the fallback adds the dequantisation).
metal: no record yet: always the fallback.

Head dims and dtypes (Limits.shapes; the reference shape above is D=128 bf16, Qwen3's), mask None
or "causal", B = 1, against mx.fast, Hq = 32 and groups (Hq / Hkv) 1, 2, 4 and 8:
cpu (2-vCPU AMD EPYC, Zen 3, AVX2): cpu-2core-attention-coverage-mlx-0.32.4.json (bench-coverage):
    D in {64, 80, 96, 128, 256} x bf16 / f16 / f32 x L in {1, 4, 8} x S in {32 .. 16384}, 900
    points: ours won every pass at every point, 1.8x (S=32, f32, L=1) to 41x; each (D, dtype) is
    admitted to L <= 8, S <= 16384, the largest measured (llm-eval's test_coverage derives these
    regions from the record and checks them against this table). Its mx.fast had mask "causal" at
    L = 1, which on CPUs times as mlx-lm's None does (raw/h100-attention-L1-mask-none-vs-causal.txt).
cuda (an H100, sm_90 as the H200): h100-attention-coverage-chained-D{64,80,96,128,256}-
    mlx-0.32.4.json (969841e; D 80 at 15f4d94, whose split rule gives D 80 three blocks an SM;
    bench-coverage --chain: a decode step's latency, S = 32 .. 131072, mx.fast with mlx-lm's
    masks: None at L = 1, "causal" above): 1354 of the 1440 points won or tied. Rows per swept L
    (1, 4, 8; a length between two swept ones needs both rows to hold S): bf16/f16 everywhere
    from S = 1 at L = 4 and 8 and from 128 at L = 1 (S = 32 lost: 0.79-0.93x, the per-call floor;
    D 80 and 256 from 1), except D 80's L = 1, which ends at 32768 (0.88-0.89x at 131072, G 8:
    ours 95 µs against 83); f32 (the SIMT kernel) where it won: from 1024 at L = 1 for D 64/128
    and only 1024 for D 96, to 8192 at L = 8 for D 80/96 and 4096 for D 256. The guard admits 1328
    of the 1440 points (92%), the reference shape's S = 32 at L = 1 among them (0.88-0.92x here;
    its limits come from the H200's records above). Sweeps before 969841e gave mx.fast "causal"
    at L = 1, which MLX 0.32.4 runs slower than None from S = 8192
    (raw/h100-attention-L1-mask-none-vs-causal.txt), and no longer count.
metal: D=128 bf16 only.

Linear layers of a decode step (decode_linear, decode_linear_quantized; LINEAR_LIMITS), against
MLX's own matmuls (x @ W.T, mx.quantized_matmul); dense weights on a GPU, and Metal, keep MLX's:
cpu (2-vCPU AMD EPYC, Zen 3, AVX2): cpu-2core-qwen3-0.6b-linear-mlx-0.32.4.json: Qwen3-0.6B's
    q/k/v, o, gate/up, down and LM head, bf16 / f16 / f32 weights and 4- and 8-bit codes (group
    64, bf16 activations), 1 and 8 rows: ours faster in every sample (the slowest of ours at
    least 3.0x faster than the fastest of MLX's), medians 3.3x (q/k/v and o, f32, 1 row) to 699x
    (LM head, 4-bit, 8 rows); more rows than 8, and codes with f16 or f32 scales, not measured.
cuda (an H100, sm_90 as the H200): h100-qwen3-4b-linear-gpu-mlx-0.32.4.json and
    h100-qwen3-4b-linear-gpu-group-128-mlx-0.32.4.json (bench-linear --device gpu at 20962df, the
    tensor-core kernel of kernels-cuda/linear_quantized.cuh against mx.quantized_matmul, Qwen3-4B's
    fused q/k/v, o, fused gate/up, down and LM head, 4- and 8-bit codes, groups 64 and 128, bf16 x,
    6 samples each, each sample 16 calls, each computing its x from the previous output): over a
    step's projections (36 x each layer's median + the LM head) MLX takes 1.06-1.81x ours' time at
    2-32 rows in both groups and widths, the two kernels that chain the calls included (1.13-2.88x
    without them); at 1 row the two tie (0.91-1.02x). MLX's qmv reads the weights once a row up to
    7 rows (5-7 not measured: its time only grows from 4), its qmm (a 128-row tile) from 8. By
    layer MLX still wins the LM head from 16 rows (0.5-0.8x) and 4-bit gate/up at 16-32 (0.9-1.0x).
    In the serving mix (32 requests of 256-2048 + 64 tokens, Qwen3-4B 4-bit group 128): every row
    count through ours decoded 8 slots 20-28% faster in three runs (rows 2-8), and at 32 slots
    h100-qwen3-4b-4bit-serve-linear-all-rows-32x256-2048+64-mlx-0.32.4.json (ac545d2, 2 rounds)
    gave mlx-lm's BatchGenerator under enable() 1298 decode tok/s against 901 with 9-32 rows left
    to MLX (a step's median 11.6 ms against 21.5), ours 1304 against 1215: rows 2-32. More than 32
    rows take a second pass of the kernel (not measured). f16 x not measured. Records before
    20962df chained calls with mx.depends, which does not order kernels on CUDA: their calls ran
    side by side and flattered MLX's qmm (the 2-4-row limit came from them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Limits:
    max_query: int  # query length L (tokens per step), mask None or "causal"
    max_context: int  # cached context S after this step's tokens are appended
    head_dims: tuple[int, ...]
    dtypes: tuple[mx.Dtype, ...]
    # An explicit mask array: its own, smaller measured region ((0, 0): never).
    max_masked_query: int
    max_masked_context: int
    # Batch rows B > 1 of one call, each with its own cache range (starts / per-row offsets),
    # measured against mx.fast with the mask the ranges stand for (what mlx-lm's batch
    # generation runs), up to max_batch_context positions.
    max_batch: int = 1
    max_batch_context: int = 0
    # Further (head dim, dtype, query length, min_context, max_context) regions, mask None or
    # "causal", B = 1: the coverage sweep's (bench-coverage), one row per swept query length,
    # where head_dims x dtypes above is the reference shape whose masks and batches were measured
    # too. min_context > 1 where shorter contexts were lost.
    shapes: tuple[tuple[int, mx.Dtype, int, int, int], ...] = ()

    @functools.cached_property
    def _rows(self) -> dict[tuple[int, mx.Dtype], dict[int, tuple[int, int]]]:
        """shapes by (head dim, dtype): {query length: (min_context, max_context)}; built once
        (region() runs in every layer of every decode step)."""
        rows: dict[tuple[int, mx.Dtype], dict[int, tuple[int, int]]] = {}
        for d, t, q, lo, hi in self.shapes:
            rows.setdefault((d, t), {})[q] = (lo, hi)
        return rows

    def region(self, head_dim: int, dtype: mx.Dtype, query_len: int) -> tuple[int, int] | None:
        """(min_context, max_context) of a further shape at query length L: a swept length's own
        row; between two swept lengths, the contexts both rows hold (none past the longest or
        below the shortest swept); None where it has none."""
        rows = self._rows.get((head_dim, dtype), {})
        below = [q for q in rows if q <= query_len]
        above = [q for q in rows if q >= query_len]
        if not below or not above:
            return None
        (lo1, hi1), (lo2, hi2) = rows[max(below)], rows[min(above)]
        lo, hi = max(lo1, lo2), min(hi1, hi2)
        return (lo, hi) if lo <= hi else None


SWEPT_QUERY_LENGTHS = (1, 4, 8)  # bench-coverage's


def _swept(head_dim: int, dtype: mx.Dtype, *regions: tuple[int, int]):
    """Limits.shapes' rows of one (head dim, dtype): the (min S, max S) the coverage sweep
    derived at each of its query lengths."""
    lengths = zip(SWEPT_QUERY_LENGTHS, regions, strict=True)
    return tuple((head_dim, dtype, q, lo, hi) for q, (lo, hi) in lengths)


LIMITS: dict[str, Limits] = {
    "cpu": Limits(
        8,
        16384,
        (128,),
        (mx.bfloat16,),
        1,
        1024,
        32,
        4096,
        shapes=tuple(
            row
            for d in (64, 80, 96, 128, 256)
            for t in (mx.bfloat16, mx.float16, mx.float32)
            if (d, t) != (128, mx.bfloat16)
            for row in _swept(d, t, (1, 16384), (1, 16384), (1, 16384))
        ),
    ),
    "cuda": Limits(
        8,
        131072,
        (128,),
        (mx.bfloat16,),
        2,
        4096,
        32,
        8192,
        shapes=(  # (L = 1, L = 4, L = 8)'s (min S, max S): h100-attention-coverage-chained-*
            *_swept(64, mx.bfloat16, (128, 131072), (1, 131072), (1, 131072)),
            *_swept(64, mx.float16, (128, 131072), (1, 131072), (1, 131072)),
            *_swept(64, mx.float32, (1024, 131072), (1, 131072), (1, 131072)),
            *_swept(80, mx.bfloat16, (1, 32768), (1, 131072), (1, 131072)),
            *_swept(80, mx.float16, (1, 32768), (1, 131072), (1, 131072)),
            *_swept(80, mx.float32, (1, 131072), (1, 131072), (1, 8192)),
            *_swept(96, mx.bfloat16, (128, 131072), (1, 131072), (1, 131072)),
            *_swept(96, mx.float16, (128, 131072), (1, 131072), (1, 131072)),
            *_swept(96, mx.float32, (1024, 1024), (1, 131072), (1, 8192)),
            *_swept(128, mx.float16, (128, 131072), (1, 131072), (1, 131072)),
            *_swept(128, mx.float32, (1024, 131072), (1, 131072), (1, 131072)),
            *_swept(256, mx.bfloat16, (1, 131072), (1, 131072), (1, 131072)),
            *_swept(256, mx.float16, (1, 131072), (1, 131072), (1, 131072)),
            *_swept(256, mx.float32, (1, 131072), (1, 131072), (1, 4096)),
        ),
    ),
    "metal": Limits(2, 256, (128,), (mx.bfloat16,), 0, 0),
}


# Over a quantized cache: (max query length, max context); (0, 0) means never. Mask None or
# "causal" only.
# Head dims the quantized kernels were timed at beyond the reference shape's (LIMITS' head_dims,
# D 128; bf16, LIMITS' dtypes): 64, 96 (group 32, the one that divides it) and 256 on the CPU
# (the records above).
QUANTIZED_FURTHER_HEAD_DIMS: dict[str, tuple[int, ...]] = {
    "cpu": (64, 96, 256),
    "cuda": (),
    "metal": (),
}
QUANTIZED_LIMITS: dict[str, tuple[int, int]] = {
    "cpu": (8, 32768),
    "cuda": (1, 131072),
    "metal": (0, 0),
}
# Group sizes where the quantized kernel's accuracy and speed were checked. CUDA: all three
# (timed above; test_against_dequantized_reference passed on the H200 under mmat4 at c139b75,
# group 32 at 4 bits included, which failed to launch before 173a529's shared-memory opt-in).
QUANTIZED_GROUP_SIZES: dict[str, tuple[int, ...]] = {
    "cpu": (32, 64, 128),
    "cuda": (32, 64, 128),
    "metal": (),
}

# Linear layers: (most rows of x, the (dtype, bits) formats measured; bits 0: dense weights in
# dtype, 4 or 8: mx.quantize's codes with scales in dtype, groups QUANTIZED_GROUP_SIZES'), from
# LINEAR_MIN_ROWS rows on.
LINEAR_LIMITS: dict[str, tuple[int, tuple[tuple[mx.Dtype, int], ...]]] = {
    "cpu": (
        8,
        ((mx.bfloat16, 0), (mx.float16, 0), (mx.float32, 0), (mx.bfloat16, 4), (mx.bfloat16, 8)),
    ),
    "cuda": (32, ((mx.bfloat16, 4), (mx.bfloat16, 8))),
    "metal": (0, ()),
}
LINEAR_MIN_ROWS: dict[str, int] = {"cpu": 1, "cuda": 2, "metal": 1}

# CUDA graph limits (kernels, "MB" of inputs) of the stream batched decode steps run on
# (attn_kernels.graph_limits): a whole step as one graph. Qwen3-4B 4-bit, 32 slots, H100: with
# MLX's sm_90 defaults (100, 1000) qwen3_model's generator decoded 1479-1657 tok/s, every other
# call waiting 20-30 ms in MLX's encoding; with either limit alone raised 1397-1688; with both
# (a step of ~400 kernels and ~560 MB commits once) 3072 and, in one process beside MLX's limits'
# 1479/1578, rounds of 3017 and 1405 (h100-qwen3-4b-4bit-serve-graph-limits-...; raw/
# h100-serve-32-slots-probes.txt; docs/serving-cuda.md: the slow state is not found yet).
BATCH_GRAPH_LIMITS = (4096, 1 << 20)

# Backends whose AttentionStep kernel has run (Metal's launcher has not run on a Mac yet).
STEP_BACKENDS = ("cpu", "cuda")
# Backends with an AttentionStepQuantized kernel (none for Metal).
QUANTIZED_STEP_BACKENDS = ("cpu", "cuda")


def backend() -> str:
    """ "cpu", "cuda" or "metal": where the default device runs."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def use_fused(
    query_len: int,
    context: int,
    head_dim: int,
    mask,
    backend: str | None = None,
    *,
    dtype: mx.Dtype | None = None,
    batch: int = 1,
) -> bool:
    """True where the fused kernel was measured to beat mx.fast on `backend` (default: the
    default device's): L = query_len, S = context (after this step's tokens), mask None,
    "causal" or an array, `batch` rows of their own ranges (starts, ends). dtype None skips the
    dtype check (the caller knows it is bf16)."""
    where = _default_backend() if backend is None else backend
    if where not in LIMITS:
        raise ValueError(f"unknown backend {where!r}: use one of {', '.join(LIMITS)}")
    limits = LIMITS[where]
    if query_len < 1 or context < query_len:
        return False
    plain = mask is None or (isinstance(mask, str) and mask == "causal")
    if head_dim not in limits.head_dims or (dtype is not None and dtype not in limits.dtypes):
        region = limits.region(head_dim, mx.bfloat16 if dtype is None else dtype, query_len)
        if region is None or batch > 1 or not plain:
            return False
        min_context, max_context = region
        return min_context <= context <= max_context
    if batch > 1 and (batch > limits.max_batch or context > limits.max_batch_context):
        return False
    if plain:
        return query_len <= limits.max_query and context <= limits.max_context
    if isinstance(mask, mx.array):
        return query_len <= limits.max_masked_query and context <= limits.max_masked_context
    return False


def use_step(
    query_len: int,
    context: int,
    head_dim: int,
    mask,
    backend: str | None = None,
    *,
    dtype: mx.Dtype | None = None,
    batch: int = 1,
) -> bool:
    """True where a decode step with a plain K/V cache goes through `attention_step` (q/k norm,
    RoPE, cache write and attention in one op): inside use_fused's region, mask "causal" or None
    with one query (the op is causal; None with L > 1 lets every query see every key), on a
    backend in STEP_BACKENDS; `batch` rows of their own ranges as in use_fused. Used by
    qwen3_model and attn_kernels.mlx_lm's fused step alike."""
    where = _default_backend() if backend is None else backend
    causal = (isinstance(mask, str) and mask == "causal") or (mask is None and query_len == 1)
    return (
        causal
        and where in STEP_BACKENDS
        and use_fused(query_len, context, head_dim, mask, where, dtype=dtype, batch=batch)
    )


def use_fused_quantized(
    query_len: int,
    context: int,
    mask,
    backend: str | None = None,
    *,
    head_dim: int | None = None,
    dtype: mx.Dtype | None = None,
    group_size: int | None = None,
) -> bool:
    """True where decode_attention_quantized was measured to beat the fallback on `backend`
    (head dim in LIMITS' list or QUANTIZED_FURTHER_HEAD_DIMS, dtype in LIMITS' list, group size
    in QUANTIZED_GROUP_SIZES; None skips that check)."""
    where = _default_backend() if backend is None else backend
    if where not in QUANTIZED_LIMITS:
        raise ValueError(f"unknown backend {where!r}: use one of {', '.join(QUANTIZED_LIMITS)}")
    if group_size is not None and group_size not in QUANTIZED_GROUP_SIZES[where]:
        return False
    measured = LIMITS[where]
    further = QUANTIZED_FURTHER_HEAD_DIMS[where]
    if head_dim is not None and head_dim not in measured.head_dims and head_dim not in further:
        return False
    if dtype is not None and dtype not in measured.dtypes:
        return False
    max_query, max_context = QUANTIZED_LIMITS[where]
    plain = mask is None or (isinstance(mask, str) and mask == "causal")
    return plain and 1 <= query_len <= max_query and query_len <= context <= max_context


def use_step_quantized(
    query_len: int,
    context: int,
    head_dim: int,
    mask,
    backend: str | None = None,
    *,
    dtype: mx.Dtype | None = None,
    group_size: int | None = None,
) -> bool:
    """True where a decode step with a quantized cache goes through `attention_step_quantized`
    (q/k norm, RoPE, the quantized cache write and attention in one op): inside
    use_fused_quantized's region, causal as use_step, on a backend in QUANTIZED_STEP_BACKENDS;
    head_dim a multiple of 64 on a GPU (the CPU's step takes any multiple of the group)."""
    where = _default_backend() if backend is None else backend
    causal = (isinstance(mask, str) and mask == "causal") or (mask is None and query_len == 1)
    return (
        causal
        and where in QUANTIZED_STEP_BACKENDS
        and (head_dim % 64 == 0 or where == "cpu")
        and use_fused_quantized(
            query_len, context, mask, where, head_dim=head_dim, dtype=dtype, group_size=group_size
        )
    )


def linear_rows(backend: str | None = None) -> int:
    """The most rows of x decode_linear runs for on `backend` (default: the default device's);
    0 where it has no record (Metal): callers skip the rest of the question there."""
    return LINEAR_LIMITS[_default_backend() if backend is None else backend][0]


def linear_min_rows(backend: str | None = None) -> int:
    """The fewest rows of x decode_linear runs for on `backend` (default: the default device's):
    1 on the CPU; 2 on CUDA, where MLX's qmv ties with ours at one row."""
    return LINEAR_MIN_ROWS[_default_backend() if backend is None else backend]


def use_linear(
    rows: int,
    dtype: mx.Dtype,
    bits: int = 0,
    group_size: int | None = None,
    backend: str | None = None,
) -> bool:
    """True where decode_linear (bits 0) or decode_linear_quantized (bits 4, 8) was measured to
    beat MLX's own matmul on `backend`: `rows` rows of x (a decode step's tokens), weights in
    the measured (dtype, bits) formats, a quantized layer's group size as
    QUANTIZED_GROUP_SIZES; rows from LINEAR_MIN_ROWS to the limit's."""
    where = _default_backend() if backend is None else backend
    if where not in LINEAR_LIMITS:
        raise ValueError(f"unknown backend {where!r}: use one of {', '.join(LINEAR_LIMITS)}")
    max_rows, formats = LINEAR_LIMITS[where]
    if bits and group_size not in QUANTIZED_GROUP_SIZES[where]:
        return False
    return LINEAR_MIN_ROWS[where] <= rows <= max_rows and (dtype, bits) in formats


_default_backend = backend
