// What the ops share before they build a primitive (decode_attention, decode_attention_quantized,
// attention_step, attention_step_quantized): their error messages, the dtype, mask and schedule
// checks, and the geometry of their arrays (attention_geometry.h's builder, fed from MLX shapes).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

#include "attention_geometry.h"
#include "decode_problem.h"

namespace attn_kernels {

namespace mx = mlx::core;

std::string shape_str(const mx::Shape& shape);
std::string shape_str(const mx::array& a);
std::string dtype_str(mx::Dtype t);

// std::invalid_argument (Python: ValueError) "[op] message".
[[noreturn]] void fail(const char* op, const std::string& message);

bool is_float(mx::Dtype t);
ElementType element_type(mx::Dtype t);  // float32, float16, bfloat16; anything else: boolean
MaskKind mask_kind(mx::Dtype t);

// A schedule name from schedules() (decode_attention.h), else fail naming the choices.
void check_schedule(const char* op, const std::string& schedule);

// An explicit mask of shape `expected` (B, Hq, L, S), additive float or boolean.
void check_mask(const char* op, const mx::array& mask, const mx::Shape& expected);

// Per-row cache bounds `name` (the ops' starts, ends, offsets): int32 of shape (batch,), values
// in [lo, hi] where they are known now (an evaluated array: one made from a list, or the result of
// an earlier evaluation; a lazy one is clamped by the kernels instead, attention_geometry.h).
// Returns it row-contiguous (the kernels index it by batch row).
mx::array checked_row_bounds(const char* op, const char* name, const mx::array& bounds, int batch,
                             int lo, int hi, mx::StreamOrDevice s);

// The per-row starts and ends of an attention call, checked ([0, S] each, starts <= ends where
// both are known) and appended to `inputs`; returns their RowRanges bits.
int add_row_ranges(const char* op, std::vector<mx::array>& inputs,
                   const std::optional<mx::array>& starts, const std::optional<mx::array>& ends,
                   int batch, int context, mx::StreamOrDevice s);

// Whether a's values can be read on the host now (checked_row_bounds' values).
bool host_readable(const mx::array& a);

// The geometry of an attention call on arrays: queries (B, Hq, L, D) read through their
// strides, kv_heads and context from the keys, an explicit mask (its kind and strides) or none.
AttentionGeometry geometry_of(const mx::array& queries, int kv_heads, int context, float scale,
                              bool causal, const std::optional<mx::array>& mask);

}  // namespace attn_kernels
