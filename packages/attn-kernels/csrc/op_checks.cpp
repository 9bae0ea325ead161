#include "op_checks.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

#include "decode_attention.h"

namespace attn_kernels {

// Messages are built without iostreams. In the CUDA build on the H100 machine, an error whose
// message went through std::ostringstream (a mask of the wrong shape) crashed the process, one
// made of strings alone (an unknown schedule) raised. With every message made of strings the
// GPU tests have passed since (a99724f, 581a8d0 on an H100; docs/serving-cuda.md).
std::string shape_str(const mx::Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string shape_str(const mx::array& a) {
  return shape_str(a.shape());
}

std::string dtype_str(mx::Dtype t) {
  // In the order of mx::Dtype::Val, named as MLX prints them.
  static constexpr const char* kNames[] = {"bool",    "uint8",   "uint16",  "uint32", "uint64",
                                           "int8",    "int16",   "int32",   "int64",  "float16",
                                           "float32", "float64", "bfloat16", "complex64"};
  const auto i = static_cast<size_t>(t.val());
  return i < std::size(kNames) ? kNames[i] : "dtype " + std::to_string(i);
}

void fail(const char* op, const std::string& message) {
  throw std::invalid_argument("[" + std::string(op) + "] " + message);
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

ElementType element_type(mx::Dtype t) {
  if (t == mx::float32) return ElementType::float32;
  if (t == mx::float16) return ElementType::float16;
  if (t == mx::bfloat16) return ElementType::bfloat16;
  return ElementType::boolean;
}

MaskKind mask_kind(mx::Dtype t) {
  if (t == mx::float32) return kMaskFloat32;
  if (t == mx::float16) return kMaskFloat16;
  if (t == mx::bfloat16) return kMaskBFloat16;
  return kMaskBool;
}

void check_schedule(const char* op, const std::string& schedule) {
  if (std::find(schedules().begin(), schedules().end(), schedule) == schedules().end()) {
    std::string names;
    for (const auto& n : schedules()) names += (names.empty() ? "" : ", ") + n;
    fail(op, "unknown schedule '" + schedule + "': use one of " + names);
  }
}

void check_mask(const char* op, const mx::array& mask, const mx::Shape& expected) {
  if (mask.shape() != expected) {
    fail(op, "mask must have shape (B, Hq, L, S) = " + shape_str(expected) + ", got " +
                 shape_str(mask));
  }
  if (!is_float(mask.dtype()) && mask.dtype() != mx::bool_) {
    fail(op, "mask must be additive (float32/float16/bfloat16) or boolean, got " +
                 dtype_str(mask.dtype()));
  }
}

bool host_readable(const mx::array& a) {
  return a.status() != mx::array::Status::unscheduled && a.is_available();
}

mx::array checked_row_bounds(const char* op, const char* name, const mx::array& bounds, int batch,
                             int lo, int hi, mx::StreamOrDevice s) {
  if (bounds.dtype() != mx::int32) {
    fail(op, std::string(name) + " must be int32, got " + dtype_str(bounds.dtype()));
  }
  if (bounds.ndim() != 1 || bounds.shape(0) != batch) {
    fail(op, std::string(name) + " must have shape (batch,) = (" + std::to_string(batch) +
                 ",), got " + shape_str(bounds));
  }
  if (host_readable(bounds)) {
    for (int b = 0; b < batch; ++b) {
      const int32_t v = bounds.data<int32_t>()[b * bounds.strides()[0]];
      if (v < lo || v > hi) {
        fail(op, std::string(name) + "[" + std::to_string(b) + "] = " + std::to_string(v) +
                     " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      }
    }
  }
  return bounds.flags().row_contiguous ? bounds : mx::contiguous(bounds, false, s);
}

int add_row_ranges(const char* op, std::vector<mx::array>& inputs,
                   const std::optional<mx::array>& starts, const std::optional<mx::array>& ends,
                   int batch, int context, mx::StreamOrDevice s) {
  int flags = 0;
  if (starts) {
    inputs.push_back(checked_row_bounds(op, "starts", *starts, batch, 0, context, s));
    flags |= kRowStarts;
  }
  if (ends) {
    inputs.push_back(checked_row_bounds(op, "ends", *ends, batch, 0, context, s));
    flags |= kRowEnds;
  }
  if (starts && ends && host_readable(*starts) && host_readable(*ends)) {
    for (int b = 0; b < batch; ++b) {
      const int32_t first = starts->data<int32_t>()[b * starts->strides()[0]];
      const int32_t end = ends->data<int32_t>()[b * ends->strides()[0]];
      if (first > end) {
        fail(op, "starts[" + std::to_string(b) + "] = " + std::to_string(first) +
                     " is past ends[" + std::to_string(b) + "] = " + std::to_string(end));
      }
    }
  }
  return flags;
}

AttentionGeometry geometry_of(const mx::array& queries, int kv_heads, int context, float scale,
                              bool causal, const std::optional<mx::array>& mask) {
  attn_i64 q_strides[4];
  for (int a = 0; a < 4; ++a) q_strides[a] = queries.strides()[a];
  AttentionGeometry g =
      make_geometry(queries.shape(0), queries.shape(1), kv_heads, queries.shape(2), context,
                    queries.shape(3), scale, causal, q_strides);
  if (mask) {
    g.mask_kind = mask_kind(mask->dtype());
    for (int a = 0; a < 4; ++a) g.m_strides[a] = mask->strides()[a];
  }
  return g;
}

}  // namespace attn_kernels
