// DecodeAttention for Apple GPUs: the chapter's kernel, written from its description.
//
// One threadgroup per query vector (query row b*Hq + h, query position i); G SIMD groups of 32
// lanes. The vector sees its batch row's cache range (attention_geometry.h: row_range,
// visible_keys). Each lane keeps a strided slice of the scaled query (dims lane, lane+32, ...) in
// registers; SIMD group g visits positions g, g+G, ...; per position: lane-partial products,
// simd_sum, optional mask, causal bound, then the online update with each factor computed once
// (fast::exp). Group partials (max, denominator, accumulator) go to threadgroup memory; the first
// SIMD group computes the common max and the rescale factors, one thread the denominator, and
// the first D threads each combine one output dimension.
//
// Storage types: float, half, and ushort holding bfloat16 bits (loaded and stored directly,
// converted in registers; arithmetic is float32). Threadgroup memory: G * (D + 2) + G + 1
// floats; the launcher keeps it within 32 KB (D = 256 runs at most 16 groups).
//
// The same file compiles on the host (emulation/metal_shim.h) for the CPU emulation tests.
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#define THREADGROUP_BUFFER(index) [[threadgroup(index)]]
#else  // host emulation: `threadgroup` is an empty address-space macro there
#define THREADGROUP_BUFFER(index)
#endif
#include "decode_attention_params.h"

using namespace metal;
using namespace attn_kernels;

constant constexpr int kMaxPerLane = 8;  // D <= 256 over 32 lanes

inline float to_float(float x) {
  return x;
}
inline float to_float(half x) {
  return float(x);
}
inline float to_float(ushort bf16_bits) {
  return as_type<float>(uint(bf16_bits) << 16);
}

inline void store(device float* p, float x) {
  *p = x;
}
inline void store(device half* p, float x) {
  *p = half(x);
}
inline void store(device ushort* p, float x) {
  uint u = as_type<uint>(x);
  if (x != x) {
    *p = ushort(0x7fc0);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  *p = ushort(u >> 16);
}

// The score after the mask: an additive mask adds, a boolean one removes the key whatever its
// score (NaN included), as the readable path's mx.where does.
inline float apply_mask(const device uchar* mask, int kind, attn_i64 at, float score) {
  switch (kind) {
    case 1: return score + ((const device float*)mask)[at];
    case 2: return score + float(((const device half*)mask)[at]);
    case 3: return score + as_type<float>(uint(((const device ushort*)mask)[at]) << 16);
    case 4: return ((const device bool*)mask)[at] ? score : -INFINITY;
  }
  return score;
}

// max() is fmax() for floats, which drops a NaN argument; softmax must not (a NaN score makes its
// row NaN, as in the readable path). The library is built with -fno-fast-math (mlx_build_metallib).
inline float max_nan(float a, float b) {
  return (a > b || a != a) ? a : b;
}

template <typename T, int G>
[[kernel]] void decode_attention(
    const device T* queries [[buffer(0)]],
    const device T* keys [[buffer(1)]],
    const device T* values [[buffer(2)]],
    const device uchar* mask [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant DecodeAttentionParams& p [[buffer(5)]],
    const device int* row_starts [[buffer(6)]],
    const device int* row_ends [[buffer(7)]],
    threadgroup float* shared THREADGROUP_BUFFER(0),
    uint vector_id [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_id [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int D = p.head_dim, L = p.query_len, S = p.context;
  const int row = int(vector_id) / L, i = int(vector_id) % L;
  const int batch = row / p.q_heads, head = row % p.q_heads;
  const int kv_head = head / p.group;  // GQA by head mapping

  const device T* q = queries + batch * p.q_strides[0] + head * p.q_strides[1] + i * p.q_strides[2];
  const device T* k = keys + batch * p.k_strides[0] + kv_head * p.k_strides[1];
  const device T* v = values + batch * p.v_strides[0] + kv_head * p.v_strides[1];
  const attn_i64 mask_base = batch * p.m_strides[0] + head * p.m_strides[1] + i * p.m_strides[2];

  float q_slice[kMaxPerLane];
  float acc[kMaxPerLane];
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = int(lane) + 32 * e;
    q_slice[e] = d < D ? to_float(q[d * p.q_strides[3]]) * p.scale : 0.0f;
    acc[e] = 0.0f;
  }
  float running_max = -INFINITY, denominator = 0.0f;
  // The positions this vector sees: its batch row's range (all S without per-row ranges), causal
  // up to the row's end - L + i.
  const CacheRange range = row_range(row_starts, row_ends, p.row_ranges, p.ends_add, batch, S);
  const KeyRange keys_seen = visible_keys(range, L, i, p.causal);

  for (int j = keys_seen.first + int(simd_id); j <= keys_seen.last; j += G) {
    const device T* kj = k + j * p.k_strides[2];
    float partial = 0.0f;
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      if (d < D) {
        partial += q_slice[e] * to_float(kj[d * p.k_strides[3]]);
      }
    }
    float score = simd_sum(partial);
    if (p.mask_kind != 0) {
      score = apply_mask(mask, p.mask_kind, mask_base + j * p.m_strides[3], score);
    }
    if (score == -INFINITY) {
      continue;  // a removed key contributes nothing (uniform across the SIMD group)
    }
    const float new_max = max_nan(running_max, score);
    const float old_factor = fast::exp(running_max - new_max);
    const float weight = fast::exp(score - new_max);
    denominator = denominator * old_factor + weight;
    running_max = new_max;
    const device T* vj = v + j * p.v_strides[2];
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      if (d < D) {
        acc[e] = acc[e] * old_factor + weight * to_float(vj[d * p.v_strides[3]]);
      }
    }
  }

  // Group partials: [group][max, denominator, D accumulators], then G factors and the total.
  const int stride = D + 2;
  threadgroup float* slot = shared + int(simd_id) * stride;
  threadgroup float* factors = shared + G * stride;
  if (lane == 0) {
    slot[0] = running_max;
    slot[1] = denominator;
  }
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = int(lane) + 32 * e;
    if (d < D) {
      slot[2 + d] = acc[e];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_id == 0) {
    const float group_max = int(lane) < G ? shared[int(lane) * stride] : -INFINITY;
    // simd_max drops NaN too: a NaN group max is added back through the sum (NaN + 0 is NaN).
    const float nan_part = simd_sum(group_max != group_max ? group_max : 0.0f);
    const float common = simd_max(group_max) + nan_part;
    if (int(lane) < G) {
      factors[lane] = group_max == -INFINITY ? 0.0f : fast::exp(group_max - common);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) {
      float total = 0.0f;
      for (int g = 0; g < G; ++g) {
        total += shared[g * stride + 1] * factors[g];
      }
      // A NaN or +inf score makes the row NaN, as softmax does (NaN - NaN and inf - inf are NaN),
      // whatever fast::exp returns for such arguments.
      const bool poisoned = common != common || common == INFINITY;
      factors[G] = poisoned ? common - common : total;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (int(tid) < D) {
    float sum = 0.0f;
    for (int g = 0; g < G; ++g) {
      sum += shared[g * stride + 2 + int(tid)] * factors[g];
    }
    const float total = factors[G];
    // Zeros only when no key was kept; a NaN total stays NaN.
    store(out + (attn_i64(row) * L + i) * D + tid, total == 0.0f ? 0.0f : sum / total);
  }
}

#define instantiate_decode_attention(name, type, groups)                          \
  template [[host_name("decode_attention_" #name "_g" #groups)]] [[kernel]] void \
  decode_attention<type, groups>(                                                 \
      const device type* queries [[buffer(0)]],                                   \
      const device type* keys [[buffer(1)]],                                      \
      const device type* values [[buffer(2)]],                                    \
      const device uchar* mask [[buffer(3)]],                                     \
      device type* out [[buffer(4)]],                                             \
      constant DecodeAttentionParams& p [[buffer(5)]],                            \
      const device int* row_starts [[buffer(6)]],                                 \
      const device int* row_ends [[buffer(7)]],                                   \
      threadgroup float* shared THREADGROUP_BUFFER(0),                            \
      uint vector_id [[threadgroup_position_in_grid]],                            \
      uint tid [[thread_index_in_threadgroup]],                                   \
      uint simd_id [[simdgroup_index_in_threadgroup]],                            \
      uint lane [[thread_index_in_simdgroup]]);

#define instantiate_all_groups(name, type)     \
  instantiate_decode_attention(name, type, 8)  \
  instantiate_decode_attention(name, type, 16) \
  instantiate_decode_attention(name, type, 32)

instantiate_all_groups(float32, float)
instantiate_all_groups(float16, half)
instantiate_all_groups(bfloat16, ushort)
