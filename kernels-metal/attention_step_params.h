// Parameters of the Metal attention-step kernels, shared by the Metal source and the host
// (eval_gpu_attention_step_metal.cpp, the CPU emulation): one layout on both sides.
#pragma once

#include "decode_attention_params.h"  // attn_i64

// The new tokens: q (B, L, Hq·D), k, v (B, L, Hkv·D) with element strides of (batch, position,
// feature); the caches (B, Hkv, capacity, D) with element strides; q_out (B, Hq, L, D)
// contiguous. See packages/attn-kernels/csrc/step_problem.h (the CPU/CUDA twin).
struct AttentionStepParams {
  int batch, length, q_heads, kv_heads, head_dim, offset;
  int qk_norm;  // 1: RMS-normalise q and k (weights at buffers 3, 4); 0: rotate them as given
  float eps;
  float log2_base;
  int padding;  // the strides start 8-byte aligned, explicitly on both sides
  attn_i64 q_strides[3];
  attn_i64 k_strides[3];
  attn_i64 v_strides[3];
  attn_i64 kc_strides[4];
  attn_i64 vc_strides[4];
};

// A 4-D strided array into a row-contiguous one (an undonated cache; the L > 1 reorder).
struct StridedCopyParams {
  int shape[4];
  attn_i64 strides[4];
  attn_i64 size;
};

#if !defined(__METAL_VERSION__)
// The attention over the updated caches (host side: the Metal launcher and the emulation):
// queries are q_out, keys/values the caches' first offset + L positions, causal.
inline DecodeAttentionParams step_attention_params(const AttentionStepParams& p, float scale) {
  DecodeAttentionParams a{};
  a.rows = p.batch * p.q_heads;
  a.group = p.q_heads / p.kv_heads;
  a.query_len = p.length;
  a.context = p.offset + p.length;
  a.head_dim = p.head_dim;
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.mask_kind = 0;
  a.scale = scale;
  a.causal = 1;
  const attn_i64 L = p.length, D = p.head_dim;
  const attn_i64 q_strides[4] = {p.q_heads * L * D, L * D, D, 1};
  for (int i = 0; i < 4; ++i) {
    a.q_strides[i] = q_strides[i];
    a.k_strides[i] = p.kc_strides[i];
    a.v_strides[i] = p.vc_strides[i];
    a.m_strides[i] = 0;
  }
  return a;
}

// (B, Hq, L, D) attention output read as (B, L, Hq, D): the reorder into o_proj's layout.
inline StridedCopyParams step_reorder_params(const AttentionStepParams& p) {
  const attn_i64 H = p.q_heads, L = p.length, D = p.head_dim;
  return {{p.batch, p.length, p.q_heads, p.head_dim}, {H * L * D, D, L * D, 1}, p.batch * L * H * D};
}
#endif
