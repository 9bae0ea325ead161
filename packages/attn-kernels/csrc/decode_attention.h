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

#include "decode_problem.h"

namespace attn_kernels {

namespace mx = mlx::core;

// Largest head dimension any backend accepts (the query slice lives in registers).
constexpr int kMaxHeadDim = 256;

// queries (rows, L, D) with rows = B * Hq; keys/values (kv_rows, S, D) with kv_rows = B * Hkv;
// query row r reads key/value row r / (rows / kv_rows). mask: additive float or boolean (true =
// keep) of shape (rows, L, S); causal: query i sees keys <= S - L + i. Returns (rows, L, D).
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
      "auto", "split-gqa", "chapter-8", "chapter-16", "chapter-32"};
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

// Reads the evaluated inputs and the allocated output into a DecodeProblem.
DecodeProblem make_problem(
    const std::vector<mx::array>& inputs, mx::array& out, float scale, bool causal);

void decode_attention_cpu(const DecodeProblem& problem);

// Best read rate (bytes/s) of the CPU kernel's thread pool streaming over `bytes` of memory.
double measure_read_bandwidth(size_t bytes, int repeats);

}  // namespace attn_kernels
