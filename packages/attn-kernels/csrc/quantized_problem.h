// What every backend's quantized-KV kernel reads: the call's geometry (attention_geometry.h) and
// its pointers. Free of MLX headers so that .cu files can include it. Keys and values are
// mx.quantize triples on the last axis (mlx-lm's QuantizedKVCache layout): packed uint32 codes,
// then one scale and one bias per group of `group_size` values, so that value = scale * code +
// bias.
#pragma once

#include <cstdint>

#include "decode_problem.h"

namespace attn_kernels {

struct QuantizedProblem : AttentionGeometry {
  const void* queries;
  const uint32_t* k_codes;  // (B, Hkv, S, D * bits / 32)
  const void* k_scales;     // (B, Hkv, S, D / group_size), the queries' dtype
  const void* k_biases;
  const uint32_t* v_codes;
  const void* v_scales;
  const void* v_biases;
  const void* mask;  // nullptr when there is no explicit mask (mask_kind says its type)
  const int32_t* row_starts;  // as in DecodeProblem
  const int32_t* row_ends;
  void* out;          // contiguous (B, Hq, L, D)
  ElementType dtype;  // queries, scales, biases and the output
  int bits, group_size;
  // codes, scales, biases of the keys, then of the values
  int64_t k_strides[3][4], v_strides[3][4];

  ATTN_INLINE CacheRange range(int b) const {
    return row_range(row_starts, row_ends, row_ranges, ends_add, b, context);
  }
};

}  // namespace attn_kernels
