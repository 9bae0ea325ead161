// What every backend's quantized-KV kernel needs, free of MLX headers so that .cu files can
// include it. Keys and values are mx.quantize triples on the last axis (mlx-lm's
// QuantizedKVCache layout): packed uint32 codes, then one scale and one bias per group of
// `group_size` values, so that value = scale * code + bias.
#pragma once

#include <cstdint>

#include "decode_problem.h"

namespace attn_kernels {

// Pointers and element strides of (batch, head, position, last axis) of the 4-D inputs. Rows are
// walked as in DecodeProblem: query row r = b * Hq + h reads key/value row r / group.
struct QuantizedProblem {
  const void* queries;
  const uint32_t* k_codes;  // (B, Hkv, S, D * bits / 32)
  const void* k_scales;     // (B, Hkv, S, D / group_size), the queries' dtype
  const void* k_biases;
  const uint32_t* v_codes;
  const void* v_scales;
  const void* v_biases;
  const void* mask;  // nullptr when there is no explicit mask
  void* out;         // contiguous (B, Hq, L, D)
  ElementType dtype;  // queries, scales, biases and the output
  ElementType mask_dtype;
  int rows, kv_rows, group, query_len, context, head_dim;
  int q_heads, kv_heads;
  int bits, group_size;
  float scale;
  bool causal;
  int64_t q_strides[4], m_strides[4];
  // codes, scales, biases of the keys, then of the values
  int64_t k_strides[3][4], v_strides[3][4];

  ATTN_HOST_DEVICE int64_t q_offset(int row, int i) const {
    return (row / q_heads) * q_strides[0] + (row % q_heads) * q_strides[1] + i * q_strides[2];
  }
  // Offset of key/value row `kv_row` (position 0, element 0) for one array's strides.
  ATTN_HOST_DEVICE int64_t kv_offset(const int64_t* strides, int kv_row) const {
    return (kv_row / kv_heads) * strides[0] + (kv_row % kv_heads) * strides[1];
  }
  ATTN_HOST_DEVICE int64_t mask_offset(int row, int i) const {
    return (row / q_heads) * m_strides[0] + (row % q_heads) * m_strides[1] + i * m_strides[2];
  }
};

}  // namespace attn_kernels
