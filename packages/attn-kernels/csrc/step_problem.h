// What every backend's attention-step preprocessing needs, free of MLX headers so that .cu files
// can include it (the attention after it: make_step_attention, make_step_quantized_attention).
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_problem.h"
#include "quantized_problem.h"

namespace attn_kernels {

// One decode step (StepGeometry: attention_geometry.h) with its pointers. Each q and k head is
// RMS-normalised (weights q_weight/k_weight of D; only where qk_norm, as Qwen3 does: Llama and
// Qwen2 have no q/k norm, and the weights are null), rotated by RoPE (non-traditional: dimension j
// pairs with j + D/2) and stored: q into q_out (B, Hq, L, D) contiguous, k and v into the caches
// (quantized where bits is set: k_cache and v_cache then hold the codes, and the scales and
// biases their own arrays).
struct StepProblem : StepGeometry {
  const void* q;
  const void* k;
  const void* v;
  const void* q_weight;
  const void* k_weight;
  void* q_out;
  void* k_cache;
  void* v_cache;
  void* k_scales;
  void* k_biases;
  void* v_scales;
  void* v_biases;
  const int32_t* row_starts;   // (B,) with kRowStarts, else nullptr
  const int32_t* row_offsets;  // (B,) the rows' write positions with kRowEnds, else nullptr
  ElementType dtype;
  // RoPE's inverse frequency of pairs j < head_dim / 2 (set_inverse_frequencies: from the base,
  // or 1 / the periods the caller gave), from the host: no power per pair in the kernels. The
  // angle of pair j at position p is float(p) * inv_freq[j] in float32, as mx.fast.rope forms it.
  float inv_freq[128];

  // Where batch row b writes token 0, and the RoPE position of that token.
  ATTN_INLINE int write_position(int b) const {
    return step_write_position(row_ranges, offset, row_offsets, b);
  }
  ATTN_INLINE int rope_position(int b) const {
    return step_rope_position(row_ranges, offset, rope_shift, row_starts, row_offsets, b);
  }
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

// The attention over the updated caches (make_step_geometry): queries (B, Hq, L, D) contiguous
// at `queries`, keys and values the step's caches, writing (B, Hq, L, D) to `out`.
inline DecodeProblem make_step_attention(const StepProblem& step, const void* queries, void* out,
                                         float scale) {
  DecodeProblem p{};
  static_cast<AttentionGeometry&>(p) = make_step_geometry(step, scale);
  p.queries = queries;
  p.keys = step.k_cache;
  p.values = step.v_cache;
  p.mask = nullptr;
  p.row_starts = step.row_starts;
  p.row_ends = step.row_offsets;
  p.out = out;
  p.dtype = step.dtype;
  for (int i = 0; i < 4; ++i) {
    p.k_strides[i] = step.kc_strides[i];
    p.v_strides[i] = step.vc_strides[i];
  }
  return p;
}

// The quantized step's attention over its updated triples, as make_step_attention.
inline QuantizedProblem make_step_quantized_attention(const StepProblem& step,
                                                      const void* queries, void* out,
                                                      float scale) {
  QuantizedProblem p{};
  static_cast<AttentionGeometry&>(p) = make_step_geometry(step, scale);
  p.queries = queries;
  p.k_codes = static_cast<const uint32_t*>(step.k_cache);
  p.k_scales = step.k_scales;
  p.k_biases = step.k_biases;
  p.v_codes = static_cast<const uint32_t*>(step.v_cache);
  p.v_scales = step.v_scales;
  p.v_biases = step.v_biases;
  p.mask = nullptr;
  p.row_starts = step.row_starts;
  p.row_ends = step.row_offsets;
  p.out = out;
  p.dtype = step.dtype;
  p.bits = step.bits;
  p.group_size = step.group_size;
  for (int i = 0; i < 4; ++i) {
    p.k_strides[0][i] = step.kc_strides[i];
    p.v_strides[0][i] = step.vc_strides[i];
    for (int t = 1; t < 3; ++t) {
      p.k_strides[t][i] = p.v_strides[t][i] = step.sb_strides[i];
    }
  }
  return p;
}

}  // namespace attn_kernels
