// DecodeAttention: grouped-query attention for short queries over a long key/value cache, in one
// pass of online softmax, without materialising the L x S scores.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "cpu_kernel.h"
#include "decode_problem.h"
#include "op_checks.h"

namespace attn_kernels {

namespace mx = mlx::core;

// queries (B, Hq, L, D); keys/values (B, Hkv, S, D), read through their strides (cache views
// are not copied); query head h reads key/value head h / (Hq / Hkv). mask: additive float or
// boolean (true = keep) of shape (B, Hq, L, S) (a broadcast view is fine); causal: query i sees
// keys <= end - L + i. starts, ends: int32 (B,), batch row b's valid cache positions
// [starts[b], ends[b]) (defaults 0 and S; mlx-lm's left padding is a start per row), instead of
// a mask. Returns (B, Hq, L, D); a row that sees no key is zeros. The 4-D form needs no reshape
// ops around the call.
mx::array decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    const std::string& schedule = "auto",
    const std::optional<mx::array>& starts = std::nullopt,
    const std::optional<mx::array>& ends = std::nullopt,
    mx::StreamOrDevice s = {});

// GPU kernel schedules (see kernels-cuda/decode_attention.cu); the CPU kernel has one.
inline const std::vector<std::string>& schedules() {
  static const std::vector<std::string> names = {
      "auto",      "split-mma",  "split-mma-16", "split", "split-gqa",
      "chapter-8", "chapter-16", "chapter-32"};
  return names;
}

class DecodeAttention : public mx::Primitive {
 public:
  // Inputs: queries, keys, values, then the mask where has_mask, then the per-row starts and
  // ends that row_ranges (RowRanges bits) names.
  DecodeAttention(mx::Stream stream, float scale, bool causal, std::string schedule,
                  bool has_mask, int row_ranges)
      : mx::Primitive(stream),
        scale_(scale),
        causal_(causal),
        schedule_(std::move(schedule)),
        has_mask_(has_mask),
        row_ranges_(row_ranges) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "DecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  // The problem of evaluated inputs: geometry, strides and dtype, and the pointers as
  // `pointer(array)` gives them (a.data<void>() on the CPU, gpu_ptr on CUDA: there data() moves
  // a device buffer into unified memory, a copy, the first time it is asked; Metal binds buffers
  // and passes a pointer function that returns nullptr). `out` is the backend's to set.
  template <typename Pointer>
  DecodeProblem problem(const std::vector<mx::array>& inputs, Pointer pointer) const;

 private:
  float scale_;
  bool causal_;
  std::string schedule_;
  bool has_mask_;
  int row_ranges_;
};

template <typename Pointer>
DecodeProblem DecodeAttention::problem(const std::vector<mx::array>& inputs,
                                       Pointer pointer) const {
  const auto& k = inputs[1];
  const std::optional<mx::array> mask =
      has_mask_ ? std::optional<mx::array>(inputs[3]) : std::nullopt;
  DecodeProblem p{};
  static_cast<AttentionGeometry&>(p) =
      geometry_of(inputs[0], k.shape(1), k.shape(2), scale_, causal_, mask);
  p.row_ranges = row_ranges_;
  p.queries = pointer(inputs[0]);
  p.keys = pointer(k);
  p.values = pointer(inputs[2]);
  p.mask = has_mask_ ? pointer(inputs[3]) : nullptr;
  int next = has_mask_ ? 4 : 3;
  p.row_starts = nullptr;
  p.row_ends = nullptr;
  if (row_ranges_ & kRowStarts) p.row_starts = static_cast<const int32_t*>(pointer(inputs[next++]));
  if (row_ranges_ & kRowEnds) p.row_ends = static_cast<const int32_t*>(pointer(inputs[next++]));
  p.dtype = element_type(inputs[0].dtype());
  for (int a = 0; a < 4; ++a) {
    p.k_strides[a] = k.strides()[a];
    p.v_strides[a] = inputs[2].strides()[a];
  }
  return p;
}

}  // namespace attn_kernels
