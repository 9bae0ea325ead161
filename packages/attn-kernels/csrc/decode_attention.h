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

// Reads the evaluated inputs into a DecodeProblem that writes to `out` (may be set later: the
// CUDA backend plans before it allocates the output).
DecodeProblem make_problem(
    const std::vector<mx::array>& inputs, void* out, float scale, bool causal);

}  // namespace attn_kernels
