// Parameters of the Metal DecodeAttention kernel, shared by the Metal source and the host
// (eval_gpu_metal.cpp, the CPU emulation): one layout on both sides.
#pragma once

#if defined(__METAL_VERSION__)
typedef long attn_i64;
#else
#include <cstdint>
typedef int64_t attn_i64;
#endif

// mask_kind: 0 none, 1 float32, 2 float16, 3 bfloat16, 4 boolean (true keeps a key).
struct DecodeAttentionParams {
  int rows;       // B * Hq
  int group;      // Hq / Hkv
  int query_len;  // L
  int context;    // S
  int head_dim;   // D
  int q_heads;
  int kv_heads;
  int mask_kind;
  float scale;
  int causal;
  // Element strides of (batch, head, position, dim) for queries, keys, values and the mask.
  attn_i64 q_strides[4];
  attn_i64 k_strides[4];
  attn_i64 v_strides[4];
  attn_i64 m_strides[4];
};
