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

namespace attn_kernels {

namespace mx = mlx::core;

// Largest head dimension any backend accepts (the query slice lives in registers).
constexpr int kMaxHeadDim = 256;

// queries (B, Hq, L, D); keys/values (B, Hkv, S, D), read through their strides (cache views
// are not copied); query head h reads key/value head h / (Hq / Hkv). mask: additive float or
// boolean (true = keep) of shape (B, Hq, L, S) (a broadcast view is fine); causal: query i sees
// keys <= S - L + i. Returns (B, Hq, L, D). The 4-D form needs no reshape ops around the call.
mx::array decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    const std::string& schedule = "auto",
    mx::StreamOrDevice s = {});

// GPU kernel schedules (see kernels-cuda/decode_attention.cu); the CPU kernel has one.
inline const std::vector<std::string>& schedules() {
  static const std::vector<std::string> names = {
      "auto", "split-mma", "split", "split-gqa", "chapter-8", "chapter-16", "chapter-32"};
  return names;
}

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream stream, float scale, bool causal, std::string schedule)
      : mx::Primitive(stream), scale_(scale), causal_(causal), schedule_(std::move(schedule)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "DecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  float scale() const { return scale_; }
  bool causal() const { return causal_; }

 private:
  float scale_;
  bool causal_;
  std::string schedule_;
};

// The shapes, strides and flags part of make_problem (no pointers).
DecodeProblem problem_shape(const std::vector<mx::array>& inputs, float scale, bool causal);

// Shapes, strides and flags of the evaluated inputs, and their pointers as `pointer(array)`
// returns them: a.data<void>() on the CPU, gpu_ptr on CUDA (there data() moves a device buffer
// into unified memory, a copy, the first time it is asked). The output pointer is set by the
// backend once it has allocated the output (the CUDA backend plans first).
template <typename Pointer>
DecodeProblem make_problem(
    const std::vector<mx::array>& inputs, float scale, bool causal, Pointer pointer) {
  DecodeProblem p = problem_shape(inputs, scale, causal);
  p.queries = pointer(inputs[0]);
  p.keys = pointer(inputs[1]);
  p.values = pointer(inputs[2]);
  p.mask = inputs.size() > 3 ? pointer(inputs[3]) : nullptr;
  return p;
}

}  // namespace attn_kernels
