// Parameters of the Metal attention-step kernels, shared by the Metal source and the host
// (eval_gpu_attention_step_metal.cpp, the CPU emulation): one layout on both sides.
#pragma once

#include "decode_attention_params.h"

// One decode step's new tokens and caches: the geometry every backend reads
// (attention_geometry.h's StepGeometry; the CPU/CUDA StepProblem adds pointers to it). Buffers:
// q, k, v, the norm weights, q_out, the caches, these parameters, then the per-row starts and
// write offsets (int32; a stand-in that is never read where row_ranges lacks their bit).
typedef attn_kernels::StepGeometry AttentionStepParams;

// A 4-D strided array into a row-contiguous one (an undonated cache; the L > 1 reorder).
struct StridedCopyParams {
  int shape[4];
  attn_i64 strides[4];
  attn_i64 size;
};

#if !defined(__METAL_VERSION__)
// The attention over the updated caches (make_step_geometry, as every backend builds it): queries
// are q_out, keys/values the caches.
inline DecodeAttentionParams step_attention_params(const AttentionStepParams& p, float scale) {
  DecodeAttentionParams a{};
  static_cast<attn_kernels::AttentionGeometry&>(a) = attn_kernels::make_step_geometry(p, scale);
  for (int i = 0; i < 4; ++i) {
    a.k_strides[i] = p.kc_strides[i];
    a.v_strides[i] = p.vc_strides[i];
  }
  return a;
}

// (B, Hq, L, D) attention output read as (B, L, Hq, D): the reorder into o_proj's layout.
inline StridedCopyParams step_reorder_params(const AttentionStepParams& p) {
  const attn_i64 H = p.q_heads, L = p.length, D = p.head_dim;
  return {{p.batch, p.length, p.q_heads, p.head_dim}, {H * L * D, D, L * D, 1}, p.batch * L * H * D};
}
#endif
