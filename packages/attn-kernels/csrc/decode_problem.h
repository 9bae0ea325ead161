// What every backend's kernel needs, free of MLX headers so that .cu files can include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__
#else
#define ATTN_HOST_DEVICE
#endif

namespace attn_kernels {

enum class ElementType : uint8_t { float32, float16, bfloat16, boolean };

// Pointers and element strides of (batch, head, position, dim) of the 4-D inputs. Kernels walk
// "rows" (batch * heads): query row r = b * Hq + h reads key/value row r / group.
struct DecodeProblem {
  const void* queries;
  const void* keys;
  const void* values;
  const void* mask;  // nullptr when there is no explicit mask
  void* out;         // contiguous (B, Hq, L, D)
  ElementType dtype;
  ElementType mask_dtype;
  int rows, kv_rows, group, query_len, context, head_dim;
  int q_heads, kv_heads;
  float scale;
  bool causal;
  int64_t q_strides[4], k_strides[4], v_strides[4], m_strides[4];

  // Offset of query row `row`, position i (dimension 0).
  ATTN_HOST_DEVICE int64_t q_offset(int row, int i) const {
    return (row / q_heads) * q_strides[0] + (row % q_heads) * q_strides[1] + i * q_strides[2];
  }
  // Offset of key/value row `kv_row` (position 0, dimension 0) for strides k_strides/v_strides.
  ATTN_HOST_DEVICE int64_t kv_offset(const int64_t* strides, int kv_row) const {
    return (kv_row / kv_heads) * strides[0] + (kv_row % kv_heads) * strides[1];
  }
  // Offset of the mask for query row `row`, query position i (key position 0).
  ATTN_HOST_DEVICE int64_t mask_offset(int row, int i) const {
    return (row / q_heads) * m_strides[0] + (row % q_heads) * m_strides[1] + i * m_strides[2];
  }
};

}  // namespace attn_kernels
