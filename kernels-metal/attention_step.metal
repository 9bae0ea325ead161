// AttentionStep's preprocessing for Apple GPUs: one SIMD group (one threadgroup of 32 threads)
// per (token, head) of the Hq + Hkv heads normalises the q or k row (RMSNorm with mx.fast's
// roundings; only with qk_norm, otherwise the weight buffers are not read), rotates it (RoPE,
// non-traditional: dimension j pairs with j + D/2) and stores it: q to the attention's scratch
// (B, Hq, L, D), k into the cache at the row's write position + i (StepGeometry); a k head's
// group also copies v into the cache. The attention is decode_attention.metal's kernel. Plus a
// strided copy (an undonated cache; the heads-first output reordered when L > 1).
//
// Storage types as in decode_attention.metal (bfloat16 as ushort bits). Helper names carry a
// step_ prefix: the emulation compiles both sources into one program.
//
// The same file compiles on the host (emulation/metal_shim.h) for the CPU emulation tests.
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#endif
#include "attention_step_params.h"

using namespace metal;
using namespace attn_kernels;

constant constexpr int kStepPairsPerLane = 4;  // D <= 256: 128 pairs over 32 lanes

inline float step_to_float(float x) {
  return x;
}
inline float step_to_float(half x) {
  return float(x);
}
inline float step_to_float(ushort bf16_bits) {
  return as_type<float>(uint(bf16_bits) << 16);
}

inline float step_from_float(float x, float) {
  return x;
}
inline half step_from_float(float x, half) {
  return half(x);
}
inline ushort step_from_float(float x, ushort) {
  uint u = as_type<uint>(x);
  if (x != x) {
    return ushort(0x7fc0);
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return ushort(u >> 16);
}

// x rounded to the storage type T and back (T(0) picks the overload).
template <typename T>
inline float step_round(float x) {
  return step_to_float(step_from_float(x, T(0)));
}

template <typename T>
[[kernel]] void attention_step_preprocess(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device T* q_weight [[buffer(3)]],
    const device T* k_weight [[buffer(4)]],
    device T* q_out [[buffer(5)]],
    device T* k_cache [[buffer(6)]],
    device T* v_cache [[buffer(7)]],
    constant AttentionStepParams& p [[buffer(8)]],
    const device int* row_starts [[buffer(9)]],
    const device int* row_offsets [[buffer(10)]],
    uint group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int heads = p.q_heads + p.kv_heads;
  const int token = int(group_id) / heads, head = int(group_id) % heads;
  const int b = token / p.length, i = token % p.length;
  // Each batch row at its own place and RoPE position (the same for all without per-row ranges).
  const int D = p.head_dim, half_d = D / 2;
  const int position = step_write_position(p.row_ranges, p.offset, row_offsets, b) + i;
  const int rotation =
      step_rope_position(p.row_ranges, p.offset, p.rope_shift, row_starts, row_offsets, b) + i;
  const bool is_q = head < p.q_heads;
  const int h = is_q ? head : head - p.q_heads;
  constant attn_i64* s = is_q ? p.q_strides : p.k_strides;
  const device T* x = (is_q ? q : k) + b * s[0] + i * s[1] + attn_i64(h) * D * s[2];
  const device T* w = is_q ? q_weight : k_weight;

  float lo[kStepPairsPerLane], hi[kStepPairsPerLane];
  float sum = 0.0f;
  for (int t = 0; t < kStepPairsPerLane; ++t) {
    const int j = int(lane) + 32 * t;
    lo[t] = j < half_d ? step_to_float(x[j * s[2]]) : 0.0f;
    hi[t] = j < half_d ? step_to_float(x[(j + half_d) * s[2]]) : 0.0f;
    sum += lo[t] * lo[t] + hi[t] * hi[t];
  }
  const float r = p.qk_norm ? rsqrt(simd_sum(sum) / D + p.eps) : 1.0f;
  if (!is_q && (position < 0 || position >= p.capacity)) {
    return;  // a bad per-row offset writes nothing (the attention clamps it too)
  }

  device T* dst;
  attn_i64 ds;
  if (is_q) {
    dst = q_out + ((attn_i64(b) * p.q_heads + h) * p.length + i) * D;
    ds = 1;
  } else {
    dst = k_cache + b * p.kc_strides[0] + h * p.kc_strides[1] + position * p.kc_strides[2];
    ds = p.kc_strides[3];
  }
  for (int t = 0; t < kStepPairsPerLane; ++t) {
    const int j = int(lane) + 32 * t;
    if (j < half_d) {
      // mx.fast.rms_norm's roundings: x·r to T, times the weight in T; RoPE in float, once.
      // Without qk_norm: x as given.
      float a = lo[t], c = hi[t];
      if (p.qk_norm) {
        a = step_round<T>(step_to_float(w[j]) * step_round<T>(a * r));
        c = step_round<T>(step_to_float(w[j + half_d]) * step_round<T>(c * r));
      }
      // The angle as MLX's RoPE forms it: float32 frequency 2^(-j/(D/2) · log2 base) times the
      // position in float32.
      const float frequency = exp2(-(float(j) / float(half_d)) * p.log2_base);
      const float theta = float(rotation) * frequency;
      const float cs = precise::cos(theta), sn = precise::sin(theta);
      dst[j * ds] = step_from_float(a * cs - c * sn, T(0));
      dst[(j + half_d) * ds] = step_from_float(a * sn + c * cs, T(0));
    }
  }
  if (!is_q) {
    const device T* vx = v + b * p.v_strides[0] + i * p.v_strides[1] + attn_i64(h) * D * p.v_strides[2];
    device T* vd = v_cache + b * p.vc_strides[0] + h * p.vc_strides[1] + position * p.vc_strides[2];
    for (int d = int(lane); d < D; d += 32) {
      vd[d * p.vc_strides[3]] = vx[d * p.v_strides[2]];
    }
  }
}

template <typename T>
[[kernel]] void attention_step_copy(
    const device T* src [[buffer(0)]],
    device T* dst [[buffer(1)]],
    constant StridedCopyParams& c [[buffer(2)]],
    uint n [[thread_position_in_grid]]) {
  if (attn_i64(n) >= c.size) {
    return;
  }
  attn_i64 rest = n, at = 0;
  for (int a = 3; a >= 0; --a) {
    at += (rest % c.shape[a]) * c.strides[a];
    rest /= c.shape[a];
  }
  dst[n] = src[at];
}

#define instantiate_attention_step(name, type)                                          \
  template [[host_name("attention_step_preprocess_" #name)]] [[kernel]] void              \
  attention_step_preprocess<type>(                                                       \
      const device type* q [[buffer(0)]],                                                \
      const device type* k [[buffer(1)]],                                                \
      const device type* v [[buffer(2)]],                                                \
      const device type* q_weight [[buffer(3)]],                                         \
      const device type* k_weight [[buffer(4)]],                                         \
      device type* q_out [[buffer(5)]],                                                  \
      device type* k_cache [[buffer(6)]],                                                \
      device type* v_cache [[buffer(7)]],                                                \
      constant AttentionStepParams& p [[buffer(8)]],                                     \
      const device int* row_starts [[buffer(9)]],                                        \
      const device int* row_offsets [[buffer(10)]],                                      \
      uint group_id [[threadgroup_position_in_grid]],                                    \
      uint lane [[thread_index_in_simdgroup]]);                                          \
  template [[host_name("attention_step_copy_" #name)]] [[kernel]] void attention_step_copy<type>( \
      const device type* src [[buffer(0)]],                                              \
      device type* dst [[buffer(1)]],                                                    \
      constant StridedCopyParams& c [[buffer(2)]],                                       \
      uint n [[thread_position_in_grid]]);

instantiate_attention_step(float32, float)
instantiate_attention_step(float16, half)
instantiate_attention_step(bfloat16, ushort)
