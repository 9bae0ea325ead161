// DecodeAttentionQuantized: DecodeAttention over a quantized key/value cache (mx.quantize triples,
// mlx-lm's QuantizedKVCache layout), dequantising as it reads, in one pass of online softmax.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "quantized_problem.h"

namespace attn_kernels {

namespace mx = mlx::core;

// queries (B, Hq, L, D) float32/float16/bfloat16. keys/values: (codes, scales, biases) with codes
// uint32 (B, Hkv, S, D * bits / 32) and scales, biases (B, Hkv, S, D / group_size) in the
// queries' dtype, read through their strides. bits 4 or 8, group_size 32, 64 or 128 dividing D.
// mask and causal as in decode_attention. Returns (B, Hq, L, D).
mx::array decode_attention_quantized(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

class DecodeAttentionQuantized : public mx::Primitive {
 public:
  DecodeAttentionQuantized(mx::Stream stream, float scale, bool causal, int group_size, int bits)
      : mx::Primitive(stream), scale_(scale), causal_(causal), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "DecodeAttentionQuantized"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
  int group_size_;
  int bits_;
};

// Inputs: queries, key codes, scales, biases, value codes, scales, biases[, mask]. `out` may be
// set later (the CUDA backend plans before it allocates the output). `pointer` turns an input
// into its data pointer (data() on the CPU, gpu_ptr() on CUDA).
template <typename Pointer>
QuantizedProblem make_quantized_problem(
    const std::vector<mx::array>& inputs, float scale, bool causal, int group_size, int bits,
    Pointer pointer) {
  const auto& q = inputs[0];
  QuantizedProblem p{};
  p.queries = pointer(q);
  p.k_codes = static_cast<const uint32_t*>(pointer(inputs[1]));
  p.k_scales = pointer(inputs[2]);
  p.k_biases = pointer(inputs[3]);
  p.v_codes = static_cast<const uint32_t*>(pointer(inputs[4]));
  p.v_scales = pointer(inputs[5]);
  p.v_biases = pointer(inputs[6]);
  const bool has_mask = inputs.size() > 7;
  p.mask = has_mask ? pointer(inputs[7]) : nullptr;
  auto element = [](mx::Dtype t) {
    return t == mx::float32   ? ElementType::float32
           : t == mx::float16 ? ElementType::float16
           : t == mx::bfloat16 ? ElementType::bfloat16
                               : ElementType::boolean;
  };
  p.dtype = element(q.dtype());
  p.mask_dtype = has_mask ? element(inputs[7].dtype()) : ElementType::float32;
  p.q_heads = q.shape(1);
  p.kv_heads = inputs[1].shape(1);
  p.rows = q.shape(0) * p.q_heads;
  p.kv_rows = q.shape(0) * p.kv_heads;
  p.query_len = q.shape(2);
  p.head_dim = q.shape(3);
  p.context = inputs[1].shape(2);
  p.group = p.q_heads / p.kv_heads;
  p.bits = bits;
  p.group_size = group_size;
  p.scale = scale;
  p.causal = causal;
  for (int a = 0; a < 4; ++a) {
    p.q_strides[a] = q.strides()[a];
    p.m_strides[a] = has_mask ? inputs[7].strides()[a] : 0;
    for (int t = 0; t < 3; ++t) {
      p.k_strides[t][a] = inputs[1 + t].strides()[a];
      p.v_strides[t][a] = inputs[4 + t].strides()[a];
    }
  }
  return p;
}

void decode_attention_quantized_cpu(const QuantizedProblem& problem);

}  // namespace attn_kernels
