// DecodeAttentionQuantized for Apple GPUs: the chapter's kernel over a quantized cache, with GQA
// sharing.
//
// One threadgroup per (key/value row, tile of up to kVectors of its query vectors); G SIMD groups
// of 32 lanes. Lane l owns dimensions l, l + 32, ... of every vector of the tile (scaled queries
// and float32 accumulators in registers). SIMD group g visits positions g, g + G, ...; per
// position each lane dequantises its dimensions of K (scale * code + bias, the code taken from
// its uint32 word), then per vector: lane-partial products, simd_sum, mask, causal bound, the
// online update; then V the same way. Each K/V row is read once for the whole tile. Group
// partials go to threadgroup memory ([group][vector][max, denominator, D accumulators]) and the
// threads combine them per (vector, dimension).
//
// The same file compiles on the host (emulation/metal_shim.h) for the CPU emulation tests.
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#define THREADGROUP_BUFFER(index) [[threadgroup(index)]]
#else
#define THREADGROUP_BUFFER(index)
#endif
#include "decode_attention_quantized_params.h"

using namespace metal;
using namespace attn_kernels;

namespace quantized {

constant constexpr int kMaxPerLane = 8;  // D <= 256 over 32 lanes
constant constexpr int kVectors = 4;     // query vectors per threadgroup

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

// max() drops a NaN argument; softmax must not: a NaN score makes its row NaN, as in the readable
// path (decode_attention.metal's max_nan).
inline float max_nan(float a, float b) {
  return (a > b || a != a) ? a : b;
}

inline float mask_value(const device uchar* mask, int kind, attn_i64 at) {
  switch (kind) {
    case 1: return ((const device float*)mask)[at];
    case 2: return float(((const device half*)mask)[at]);
    case 3: return as_type<float>(uint(((const device ushort*)mask)[at]) << 16);
    case 4: return ((const device bool*)mask)[at] ? 0.0f : -INFINITY;
  }
  return 0.0f;
}

// Dimension d of position j of one quantized row (codes, scales, biases at their row offsets).
template <typename T, int BITS>
inline float dequantize(const device uint* codes, const device T* scales, const device T* biases,
                        constant attn_i64* strides, int j, int d, int group_size) {
  constexpr int kPerWord = 32 / BITS;
  const uint word = codes[j * strides[2] + (d / kPerWord) * strides[3]];
  const float code = float((word >> ((d % kPerWord) * BITS)) & ((1u << BITS) - 1u));
  const int g = d / group_size;
  const float scale = to_float(scales[j * strides[6] + g * strides[7]]);
  const float bias = to_float(biases[j * strides[10] + g * strides[11]]);
  return scale * code + bias;
}

}  // namespace quantized

template <typename T, int G, int BITS>
[[kernel]] void decode_attention_quantized(
    const device T* queries [[buffer(0)]],
    const device uint* k_codes [[buffer(1)]],
    const device T* k_scales [[buffer(2)]],
    const device T* k_biases [[buffer(3)]],
    const device uint* v_codes [[buffer(4)]],
    const device T* v_scales [[buffer(5)]],
    const device T* v_biases [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    device T* out [[buffer(8)]],
    constant QuantizedAttentionParams& p [[buffer(9)]],
    const device int* row_starts [[buffer(10)]],
    const device int* row_ends [[buffer(11)]],
    threadgroup float* shared THREADGROUP_BUFFER(0),
    uint block [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_id [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace quantized;
  const int D = p.head_dim, L = p.query_len, S = p.context;
  const int vectors = p.group * L;
  const int tiles = (vectors + kVectors - 1) / kVectors;
  const int kv_row = int(block) / tiles, tile = int(block) % tiles;
  const int batch = kv_row / p.kv_heads, kv_head = kv_row % p.kv_heads;

  // Row offsets of the six quantized arrays.
  const device uint* kc = k_codes + batch * p.k_strides[0] + kv_head * p.k_strides[1];
  const device T* ks = k_scales + batch * p.k_strides[4] + kv_head * p.k_strides[5];
  const device T* kb = k_biases + batch * p.k_strides[8] + kv_head * p.k_strides[9];
  const device uint* vc = v_codes + batch * p.v_strides[0] + kv_head * p.v_strides[1];
  const device T* vs = v_scales + batch * p.v_strides[4] + kv_head * p.v_strides[5];
  const device T* vb = v_biases + batch * p.v_strides[8] + kv_head * p.v_strides[9];

  float q[kVectors][kMaxPerLane];
  float acc[kVectors][kMaxPerLane];
  float running_max[kVectors], denominator[kVectors];
  // The batch row's cache range (all S without per-row ranges): every vector of the tile starts
  // at its first position.
  const CacheRange range = row_range(row_starts, row_ends, p.row_ranges, p.ends_add, batch, S);
  int last[kVectors];  // last visible position; -1 for an unused slot
  attn_i64 mask_base[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const int r = tile * kVectors + v;
    const int head = kv_head * p.group + r / L, i = r % L;
    last[v] = r < vectors ? visible_keys(range, L, i, p.causal).last : -1;
    mask_base[v] = batch * p.m_strides[0] + head * p.m_strides[1] + i * p.m_strides[2];
    const device T* qv = queries + batch * p.q_strides[0] + head * p.q_strides[1] + i * p.q_strides[2];
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      q[v][e] = r < vectors && d < D ? to_float(qv[d * p.q_strides[3]]) * p.scale : 0.0f;
      acc[v][e] = 0.0f;
    }
    running_max[v] = -INFINITY;
    denominator[v] = 0.0f;
  }
  int end = -1;  // the last position any vector of the tile sees
  for (int v = 0; v < kVectors; ++v) {
    end = last[v] > end ? last[v] : end;
  }

  for (int j = range.start + int(simd_id); j <= end; j += G) {
    float key[kMaxPerLane];
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      key[e] = d < D ? dequantize<T, BITS>(kc, ks, kb, p.k_strides, j, d, p.group_size) : 0.0f;
    }
    float weight[kVectors], factor[kVectors];
    bool any = false;
    for (int v = 0; v < kVectors; ++v) {
      float partial = 0.0f;
      for (int e = 0; e < kMaxPerLane; ++e) {
        partial += q[v][e] * key[e];
      }
      float score = simd_sum(partial);
      if (j > last[v]) {
        score = -INFINITY;
      } else if (p.mask_kind == kMaskBool) {
        // false removes the key whatever its score (NaN included), as the contract says
        score = ((const device bool*)mask)[mask_base[v] + j * p.m_strides[3]] ? score : -INFINITY;
      } else if (p.mask_kind != kMaskNone) {
        score += mask_value(mask, p.mask_kind, mask_base[v] + j * p.m_strides[3]);
      }
      if (score == -INFINITY) {  // a removed key contributes nothing (uniform across the group)
        weight[v] = 0.0f;
        factor[v] = 1.0f;
        continue;
      }
      const float new_max = max_nan(running_max[v], score);
      factor[v] = fast::exp(running_max[v] - new_max);
      weight[v] = fast::exp(score - new_max);
      denominator[v] = denominator[v] * factor[v] + weight[v];
      running_max[v] = new_max;
      any = true;
    }
    if (!any) {
      continue;
    }
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      if (d >= D) {
        continue;
      }
      const float value = dequantize<T, BITS>(vc, vs, vb, p.v_strides, j, d, p.group_size);
      for (int v = 0; v < kVectors; ++v) {
        acc[v][e] = acc[v][e] * factor[v] + weight[v] * value;
      }
    }
  }

  // Group partials: [group][vector][max, denominator, D accumulators].
  const int stride = D + 2;
  for (int v = 0; v < kVectors; ++v) {
    threadgroup float* slot = shared + (int(simd_id) * kVectors + v) * stride;
    if (lane == 0) {
      slot[0] = running_max[v];
      slot[1] = denominator[v];
    }
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = int(lane) + 32 * e;
      if (d < D) {
        slot[2 + d] = acc[v][e];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int count = vectors - tile * kVectors < kVectors ? vectors - tile * kVectors : kVectors;
  for (int item = int(tid); item < count * D; item += G * 32) {
    const int v = item / D, d = item % D;
    float common = -INFINITY;
    for (int g = 0; g < G; ++g) {
      common = max_nan(common, shared[(g * kVectors + v) * stride]);
    }
    float total = 0.0f, sum = 0.0f;
    for (int g = 0; g < G; ++g) {
      const threadgroup float* slot = shared + (g * kVectors + v) * stride;
      const float f = slot[0] == -INFINITY ? 0.0f : fast::exp(slot[0] - common);
      total += slot[1] * f;
      sum += slot[2 + d] * f;
    }
    const int r = tile * kVectors + v;
    const int row = kv_row * p.group + r / L, i = r % L;
    // Zeros only when no key was kept; a NaN total (a NaN score) stays NaN.
    store(out + (attn_i64(row) * L + i) * D + d, total == 0.0f ? 0.0f : sum / total);
  }
}

#define instantiate_decode_attention_quantized(name, type, groups, bits)                    \
  template [[host_name("decode_attention_quantized_" #name "_g" #groups "_b" #bits)]]      \
  [[kernel]] void decode_attention_quantized<type, groups, bits>(                           \
      const device type* queries [[buffer(0)]],                                             \
      const device uint* k_codes [[buffer(1)]],                                             \
      const device type* k_scales [[buffer(2)]],                                            \
      const device type* k_biases [[buffer(3)]],                                            \
      const device uint* v_codes [[buffer(4)]],                                             \
      const device type* v_scales [[buffer(5)]],                                            \
      const device type* v_biases [[buffer(6)]],                                            \
      const device uchar* mask [[buffer(7)]],                                               \
      device type* out [[buffer(8)]],                                                       \
      constant QuantizedAttentionParams& p [[buffer(9)]],                                   \
      const device int* row_starts [[buffer(10)]],                                          \
      const device int* row_ends [[buffer(11)]],                                            \
      threadgroup float* shared THREADGROUP_BUFFER(0),                                      \
      uint block [[threadgroup_position_in_grid]],                                          \
      uint tid [[thread_index_in_threadgroup]],                                             \
      uint simd_id [[simdgroup_index_in_threadgroup]],                                      \
      uint lane [[thread_index_in_simdgroup]]);

#define instantiate_quantized_all(name, type)                \
  instantiate_decode_attention_quantized(name, type, 4, 4)  \
  instantiate_decode_attention_quantized(name, type, 4, 8)  \
  instantiate_decode_attention_quantized(name, type, 8, 4)  \
  instantiate_decode_attention_quantized(name, type, 8, 8)

instantiate_quantized_all(float32, float)
instantiate_quantized_all(float16, half)
instantiate_quantized_all(bfloat16, ushort)
