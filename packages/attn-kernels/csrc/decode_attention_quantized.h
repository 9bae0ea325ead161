// DecodeAttentionQuantized: DecodeAttention over a quantized key/value cache (mx.quantize triples,
// mlx-lm's QuantizedKVCache layout), dequantising as it reads, in one pass of online softmax.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "op_checks.h"
#include "quantized_problem.h"

namespace attn_kernels {

namespace mx = mlx::core;

// queries (B, Hq, L, D) float32/float16/bfloat16. keys/values: (codes, scales, biases) with codes
// uint32 (B, Hkv, S, D * bits / 32) and scales, biases (B, Hkv, S, D / group_size) in the
// queries' dtype, read through their strides. bits 4 or 8, group_size 32, 64 or 128 dividing D.
// mask, causal, starts and ends as in decode_attention. Returns (B, Hq, L, D).
mx::array decode_attention_quantized(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    int group_size,
    int bits,
    const std::optional<mx::array>& starts = std::nullopt,
    const std::optional<mx::array>& ends = std::nullopt,
    mx::StreamOrDevice s = {});

class DecodeAttentionQuantized : public mx::Primitive {
 public:
  // Inputs: queries, key codes, scales, biases, value codes, scales, biases, then the mask where
  // has_mask, then the per-row starts and ends that row_ranges (RowRanges bits) names.
  DecodeAttentionQuantized(mx::Stream stream, float scale, bool causal, int group_size, int bits,
                           bool has_mask, int row_ranges)
      : mx::Primitive(stream),
        scale_(scale),
        causal_(causal),
        group_size_(group_size),
        bits_(bits),
        has_mask_(has_mask),
        row_ranges_(row_ranges) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "DecodeAttentionQuantized"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  // The problem of evaluated inputs, pointers as `pointer(array)` gives them (as
  // DecodeAttention::problem); `out` is the backend's to set.
  template <typename Pointer>
  QuantizedProblem problem(const std::vector<mx::array>& inputs, Pointer pointer) const;

 private:
  float scale_;
  bool causal_;
  int group_size_;
  int bits_;
  bool has_mask_;
  int row_ranges_;
};

template <typename Pointer>
QuantizedProblem DecodeAttentionQuantized::problem(const std::vector<mx::array>& inputs,
                                                   Pointer pointer) const {
  const auto& codes = inputs[1];
  const std::optional<mx::array> mask =
      has_mask_ ? std::optional<mx::array>(inputs[7]) : std::nullopt;
  QuantizedProblem p{};
  static_cast<AttentionGeometry&>(p) =
      geometry_of(inputs[0], codes.shape(1), codes.shape(2), scale_, causal_, mask);
  p.row_ranges = row_ranges_;
  p.queries = pointer(inputs[0]);
  p.k_codes = static_cast<const uint32_t*>(pointer(inputs[1]));
  p.k_scales = pointer(inputs[2]);
  p.k_biases = pointer(inputs[3]);
  p.v_codes = static_cast<const uint32_t*>(pointer(inputs[4]));
  p.v_scales = pointer(inputs[5]);
  p.v_biases = pointer(inputs[6]);
  p.mask = has_mask_ ? pointer(inputs[7]) : nullptr;
  int next = has_mask_ ? 8 : 7;
  p.row_starts = nullptr;
  p.row_ends = nullptr;
  if (row_ranges_ & kRowStarts) p.row_starts = static_cast<const int32_t*>(pointer(inputs[next++]));
  if (row_ranges_ & kRowEnds) p.row_ends = static_cast<const int32_t*>(pointer(inputs[next++]));
  p.dtype = element_type(inputs[0].dtype());
  p.bits = bits_;
  p.group_size = group_size_;
  for (int a = 0; a < 4; ++a) {
    for (int t = 0; t < 3; ++t) {
      p.k_strides[t][a] = inputs[1 + t].strides()[a];
      p.v_strides[t][a] = inputs[4 + t].strides()[a];
    }
  }
  return p;
}

}  // namespace attn_kernels
