// What every backend's kernel needs, free of MLX headers so that .cu files can include it.
#pragma once

#include <cstdint>

namespace attn_kernels {

enum class ElementType : uint8_t { float32, float16, bfloat16, boolean };

// What every backend's kernel needs: pointers and element strides of (row, position, dim).
struct DecodeProblem {
  const void* queries;
  const void* keys;
  const void* values;
  const void* mask;  // nullptr when there is no explicit mask
  void* out;         // contiguous (rows, L, D)
  ElementType dtype;
  ElementType mask_dtype;
  int rows, kv_rows, group, query_len, context, head_dim;
  float scale;
  bool causal;
  int64_t q_strides[3], k_strides[3], v_strides[3], m_strides[3];
};

}  // namespace attn_kernels
