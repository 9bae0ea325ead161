// The geometry of an attention call, once for every backend: which query rows there are, which
// cache positions each of them may see, where the queries and the mask live. Free of MLX and of
// the standard library beyond <cstdint>, so that the C++ ops, the CUDA kernels (nvcc), the Metal
// kernels (Apple's compiler: the parameter blocks below are these structs) and the emulations
// all read this one file. Pointers are not part of it: each backend keeps its own (a Metal
// kernel gets buffers, not pointers).
#pragma once

// ATTN_INLINE: inlined into every caller, as the CPU kernel's helpers are: a copy compiled for
// one instruction set must not be shared with the others (cpu_kernel_body.h).
#if defined(__METAL_VERSION__)
typedef long attn_i64;
#define ATTN_HOST_DEVICE
#define ATTN_INLINE inline
#else
#include <cstdint>
typedef int64_t attn_i64;
#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__
#define ATTN_INLINE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE
#define ATTN_INLINE inline __attribute__((always_inline))
#endif
#endif

namespace attn_kernels {

#if !defined(__METAL_VERSION__)
// Largest head dimension any backend accepts (the query slice lives in registers).
constexpr int kMaxHeadDim = 256;
#endif

// An explicit mask's element type (0: no mask). Boolean: true keeps a key.
enum MaskKind {
  kMaskNone = 0,
  kMaskFloat32 = 1,
  kMaskFloat16 = 2,
  kMaskBFloat16 = 3,
  kMaskBool = 4
};

// Which per-row bounds of the cache a call has (AttentionGeometry::row_ranges): a first valid
// position per batch row (mlx-lm's left padding), an end per row (rows of different lengths).
enum RowRanges { kRowStarts = 1, kRowEnds = 2 };

// Query row r = b * q_heads + h (batch-major), query position i < query_len; it reads key/value
// row r / group. Keys and values hold `context` positions; batch row b sees [start_b, end_b) of
// them (row_range: [0, context) without per-row ranges), causal: up to end_b - query_len + i.
struct AttentionGeometry {
  int rows, kv_rows;  // batch * q_heads, batch * kv_heads
  int q_heads, kv_heads, group;
  int query_len, context, head_dim;  // L, S, D
  int causal;
  int mask_kind;   // MaskKind
  int row_ranges;  // RowRanges bits
  int ends_add;    // added to every per-row end (an AttentionStep's ends are its rows' offsets)
  float scale;
  attn_i64 q_strides[4];  // elements of (batch, head, position, dim)
  attn_i64 m_strides[4];  // the mask's (zeros without one)

#if !defined(__METAL_VERSION__)
  // Offset of query row `row`, position i (dimension 0).
  ATTN_INLINE attn_i64 q_offset(int row, int i) const {
    return (row / q_heads) * q_strides[0] + (row % q_heads) * q_strides[1] + i * q_strides[2];
  }
  // Offset of key/value row `kv_row` (position 0, element 0) for one array's strides.
  ATTN_INLINE attn_i64 kv_offset(const attn_i64* strides, int kv_row) const {
    return (kv_row / kv_heads) * strides[0] + (kv_row % kv_heads) * strides[1];
  }
  // Offset of the mask for query row `row`, position i (key position 0).
  ATTN_INLINE attn_i64 mask_offset(int row, int i) const {
    return (row / q_heads) * m_strides[0] + (row % q_heads) * m_strides[1] + i * m_strides[2];
  }
#endif
};

// Cache positions [start, end) of one batch row.
struct CacheRange {
  int start, end;
};

// The range of batch row b: its own bounds where the call has them (ends[b] + ends_add; each
// clamped to [0, context], so a bad value never reaches past the cache), else [0, context).
// Ints: a pointer of any address space to the caller's int32 values (unread without its flag).
template <typename Ints>
ATTN_INLINE CacheRange row_range(Ints starts, Ints ends, int row_ranges, int ends_add, int b,
                                 int context) {
  CacheRange r;
  r.start = 0;
  r.end = context;
  if (row_ranges & kRowStarts) {
    const int s = starts[b];
    r.start = s < 0 ? 0 : s > context ? context : s;
  }
  if (row_ranges & kRowEnds) {
    const int e = ends[b] + ends_add;
    r.end = e < r.start ? r.start : e > context ? context : e;
  }
  return r;
}

// The one visibility rule: the first and last cache positions (inclusive; empty when
// last < first) that query position i of a row whose cache range is [start, end) sees. Causal
// queries are bottom-right aligned: the last of the L queries sees the whole range.
struct KeyRange {
  int first, last;
};
ATTN_INLINE KeyRange visible_keys(CacheRange row, int query_len, int i, int causal) {
  KeyRange k;
  k.first = row.start;
  k.last = causal ? row.end - query_len + i : row.end - 1;
  return k;
}

// One decode step's new tokens and caches (AttentionStep; the attention over the caches after the
// write is make_step_geometry's). q (B, L, Hq·D), k and v (B, L, Hkv·D) with element strides of
// (batch, position, feature); the caches (B, Hkv, capacity, D) with element strides, a quantized
// cache's codes (B, Hkv, capacity, D·bits/32) and its scales and biases (B, Hkv, capacity,
// D/group_size, strides sb_strides for all four). Token i of batch row b goes to cache position
// offset + i (with kRowEnds: offsets[b] + i, the row's own) and is rotated by RoPE at that
// position minus the row's start (0 without kRowStarts), as mlx-lm's batch caches count.
// A ring (a sliding window that has wrapped: mlx-lm's RotatingKVCache past its size) holds its
// keys out of temporal order: its one new token goes to slot `offset`, is rotated at its sequence
// position (offset + rope_shift), and attends every position of the caches.
struct StepGeometry {
  int batch, length, q_heads, kv_heads, head_dim;
  int offset;    // the write position (per-row offsets: the largest of them)
  int capacity;  // the caches' positions (no write lands past them)
  int ring;        // 1: the caches are a full ring; the attention reads [0, capacity)
  int rope_shift;  // added to every RoPE position (a ring's sequence position minus its slot)
  int qk_norm;     // 1: RMS-normalise q and k first (Qwen3); 0: rotate them as given
  int row_ranges;  // RowRanges bits: per-row starts; per-row offsets (the rows' write positions)
  int bits, group_size;  // a quantized cache (bits 4 or 8); 0, 0: a cache of the dtype
  float eps;             // RMSNorm's (unused without qk_norm)
  float log2_base;       // log2 of the RoPE base
  attn_i64 q_strides[3], k_strides[3], v_strides[3];
  attn_i64 kc_strides[4], vc_strides[4], sb_strides[4];
};

// Where token 0 of batch row b goes in the caches (its own offset with kRowEnds, clamped into
// [0, offset]: offsets the op could not check, an array still to be computed, write no further
// than the largest it was built with; else `offset`), and the position RoPE rotates it by: that
// plus rope_shift minus the row's start (kRowStarts). Ints as in row_range; StepGeometry's fields
// as scalars (no references: Metal's would need an address space).
template <typename Ints>
ATTN_INLINE int step_write_position(int row_ranges, int offset, Ints offsets, int b) {
  if (!(row_ranges & kRowEnds)) return offset;
  const int own = offsets[b];
  return own < 0 ? 0 : own > offset ? offset : own;
}
template <typename Ints>
ATTN_INLINE int step_rope_position(int row_ranges, int offset, int rope_shift, Ints starts,
                                   Ints offsets, int b) {
  return step_write_position(row_ranges, offset, offsets, b) + rope_shift -
         ((row_ranges & kRowStarts) ? starts[b] : 0);
}

#if !defined(__METAL_VERSION__)
// The one host builder of an attention geometry: queries (batch, q_heads, query_len, head_dim)
// with element strides q_strides (nullptr: contiguous), key/value heads, the cache positions the
// call reads, no mask and no per-row ranges (set mask_kind, m_strides and row_ranges after).
inline AttentionGeometry make_geometry(int batch, int q_heads, int kv_heads, int query_len,
                                       int context, int head_dim, float scale, bool causal,
                                       const attn_i64* q_strides) {
  AttentionGeometry g{};
  g.rows = batch * q_heads;
  g.kv_rows = batch * kv_heads;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.group = kv_heads > 0 ? q_heads / kv_heads : 0;
  g.query_len = query_len;
  g.context = context;
  g.head_dim = head_dim;
  g.causal = causal ? 1 : 0;
  g.mask_kind = kMaskNone;
  g.row_ranges = 0;
  g.ends_add = 0;
  g.scale = scale;
  const attn_i64 contiguous[4] = {attn_i64{q_heads} * query_len * head_dim,
                                  attn_i64{query_len} * head_dim, head_dim, 1};
  for (int a = 0; a < 4; ++a) {
    g.q_strides[a] = q_strides ? q_strides[a] : contiguous[a];
    g.m_strides[a] = 0;
  }
  return g;
}

// The attention an AttentionStep runs after its cache write: the rotated queries (B, Hq, L, D)
// contiguous, causal, over the caches' first offset + L positions (per row: from the row's start
// to its offset + L, the row ends being its offsets; a ring: all of them), scale given.
inline AttentionGeometry make_step_geometry(const StepGeometry& s, float scale) {
  const int context = s.ring ? s.capacity : s.offset + s.length;
  AttentionGeometry g = make_geometry(s.batch, s.q_heads, s.kv_heads, s.length, context,
                                      s.head_dim, scale, true, nullptr);
  g.row_ranges = s.row_ranges;
  g.ends_add = s.length;
  return g;
}
#endif

}  // namespace attn_kernels
