// Parameters of the Metal quantized-KV kernel, shared by the Metal source and the host
// (eval_gpu_metal_quantized.cpp, the CPU emulation): one layout on both sides.
#pragma once

#include "decode_attention_params.h"  // attn_i64

// mask_kind as in DecodeAttentionParams. Keys and values are mx.quantize triples: codes (uint32),
// scales and biases (the queries' type); strides per array, in elements.
struct QuantizedAttentionParams {
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
  int group_size;
  int bits;
  attn_i64 q_strides[4];
  attn_i64 m_strides[4];
  // codes, scales, biases: [array * 4 + axis]
  attn_i64 k_strides[12];
  attn_i64 v_strides[12];
};
