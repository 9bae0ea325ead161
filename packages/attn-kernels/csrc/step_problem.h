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
};

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
