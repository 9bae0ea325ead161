// What every backend's attention-step preprocessing needs, free of MLX headers so that .cu files
// can include it (the attention itself is a DecodeProblem, decode_problem.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_problem.h"

namespace attn_kernels {

// One decode step's new tokens: q (B, L, Hq·D), k and v (B, L, Hkv·D) as the projections lay
// them out (element strides of batch, position and feature; slices of a fused q/k/v projection
// are fine). Each q and k head is RMS-normalised (weights q_weight/k_weight of D; only where
// qk_norm, as Qwen3 does: Llama and Qwen2 have no q/k norm, and the weights are null), rotated by
// RoPE at position offset + i (non-traditional: dimension j pairs with j + D/2) and stored:
// q into q_out (B, Hq, L, D) contiguous, k and v into the caches (B, Hkv, capacity, D, element
// strides kc_strides/vc_strides) at position offset + i.
struct StepProblem {
  const void* q;
  const void* k;
  const void* v;
  const void* q_weight;
  const void* k_weight;
  void* q_out;
  void* k_cache;
  void* v_cache;
  ElementType dtype;
  int batch, length, q_heads, kv_heads, head_dim, offset;
  bool qk_norm;
  float eps;  // RMSNorm's (unused without qk_norm)
  float log2_base;  // log2 of the RoPE base
  // rope_inverse_frequency of pairs j < head_dim / 2, from the host (set_inverse_frequencies,
  // in the CUDA eval: its kernels read it, no power per pair on the device; the CPU kernel forms
  // its angles itself).
  float inv_freq[128];
  int64_t q_strides[3], k_strides[3], v_strides[3];
  int64_t kc_strides[4], vc_strides[4];
  // A quantized cache (mlx-lm's QuantizedKVCache: mx.quantize triples; bits 4 or 8, 0 for a cache
  // of the dtype): k_cache and v_cache hold the uint32 codes (B, Hkv, capacity, D·bits/32), and
  // each row's group_size values share a scale and a bias (q's dtype, (B, Hkv, capacity,
  // D/group_size), element strides sb_strides for all four arrays).
  int bits, group_size;
  void* k_scales;
  void* k_biases;
  void* v_scales;
  void* v_biases;
  int64_t sb_strides[4];
};

// mx.quantize's affine parameters of one group from its smallest and largest value, in MLX's
// operations and order (mlx/backend/cpu/quantized.cpp and cuda/quantized/affine_quantize.cu:
// the same formula; the CPU's extremes start at -inf/+inf and it rounds half to even, the CUDA
// kernel's maximum starts at 0 and it rounds half away from zero): the scale snapped so that
// the extreme with the larger magnitude is an exact multiple of it, which becomes the bias. The
// codes are then round((w - bias) / scale) clamped to [0, 2^bits - 1] with these unrounded
// float32 values; scale and bias are stored rounded to the dtype. `divide` and `round` are the
// backend's (the CUDA build has fast math: its divisions must be asked to round correctly).
struct AffineGroup {
  float scale, bias;
};
template <typename Divide, typename Round>
ATTN_HOST_DEVICE inline AffineGroup affine_group(
    float w_min, float w_max, int bits, Divide divide, Round round) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const bool min_edge = fabsf(w_min) > fabsf(w_max);
  float scale = fmaxf(divide(w_max - w_min, n_bins), 1e-7f);
  scale = min_edge ? scale : -scale;
  const float edge = min_edge ? w_min : w_max;
  const float q0 = round(divide(edge, scale));
  return q0 == 0.0f ? AffineGroup{scale, 0.0f} : AffineGroup{divide(edge, q0), edge};
}

// RoPE's inverse frequency of pair j (of D/2), formed as MLX's RoPE forms it: 2^(-j/(D/2) · log2
// base) with the exponent in float32. The power is taken in double and rounded once: at position
// p an ulp of the frequency moves the angle by p ulps.
ATTN_HOST_DEVICE inline float rope_inverse_frequency(int j, int half, float log2_base) {
  const float d = static_cast<float>(j) / static_cast<float>(half);
  return static_cast<float>(exp2(static_cast<double>(-d * log2_base)));
}

// The angle of RoPE pair j at `position`: the position times the inverse frequency in float32, as
// MLX's RoPE forms it, so that the fused step rotates by mx.fast.rope's angles.
ATTN_HOST_DEVICE inline float rope_angle(int position, int j, int half, float log2_base) {
  return static_cast<float>(position) * rope_inverse_frequency(j, half, log2_base);
}

}  // namespace attn_kernels
