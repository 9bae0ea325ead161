// What every backend's DecodeAttention kernel reads: the call's geometry (attention_geometry.h)
// and its pointers. Free of MLX headers so that .cu files can include it.
#pragma once

#include <cstdint>

#include "attention_geometry.h"

namespace attn_kernels {

enum class ElementType : uint8_t { float32, float16, bfloat16, boolean };

// Keys and values (B, Hkv, S, D) with element strides k_strides / v_strides; kernels walk rows
// as AttentionGeometry says (query row r reads key/value row r / group).
struct DecodeProblem : AttentionGeometry {
  const void* queries;
  const void* keys;
  const void* values;
  const void* mask;  // nullptr when there is no explicit mask (mask_kind says its type)
  const int32_t* row_starts;  // (B,) where row_ranges has kRowStarts, else nullptr
  const int32_t* row_ends;    // (B,) where row_ranges has kRowEnds, else nullptr
  void* out;                  // contiguous (B, Hq, L, D)
  ElementType dtype;
  int64_t k_strides[4], v_strides[4];

  // Batch row b's cache range (attention_geometry.h's row_range).
  ATTN_INLINE CacheRange range(int b) const {
    return row_range(row_starts, row_ends, row_ranges, ends_add, b, context);
  }
};

}  // namespace attn_kernels
