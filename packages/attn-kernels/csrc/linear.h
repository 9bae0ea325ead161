// DecodeLinear: out = x @ W^T (+ bias) for a decode step's few rows of x, W dense or in
// mx.quantize's affine layout, read once: by the CPU linear kernel (cpu_linear_body.h), and on
// NVIDIA GPUs, for 4- and 8-bit codes with bf16/f16 x, by kernels-cuda/linear_quantized.cuh
// (dense weights, float32 and a gate keep MLX's own ops there: attn_kernels.linear).
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "linear_problem.h"

namespace attn_kernels {

namespace mx = mlx::core;

// x (..., K) float32/float16/bfloat16. Dense (bits 0): weight (N, K) in x's dtype. Quantized
// (bits 4 or 8): weight uint32 codes (N, K * bits / 32), scales and biases (N, K / group_size)
// in x's dtype, group_size 32, 64 or 128. bias (N,) in x's dtype or none. Returns (..., N) in x's
// dtype, accumulated in float32. Made for a few rows (up to 8 per pass over W); more rows are
// served in passes of 8. With a gate (x's shape and dtype) the layer's input is silu(gate) * x,
// mlx-lm's swiglu(gate, x), computed while x is prepared: in float32, rounded once to x's dtype.
mx::array decode_linear(
    const mx::array& x,
    const mx::array& weight,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    const std::optional<mx::array>& bias,
    int group_size,
    int bits,
    const std::optional<mx::array>& gate = std::nullopt,
    mx::StreamOrDevice s = {});

// The stride between rows of x (..., K) when its columns are contiguous and its leading
// dimensions collapse into one of rows; 0 when they do not (then x is copied).
int64_t collapsed_row_stride(const mx::array& x);

class DecodeLinear : public mx::Primitive {
 public:
  // Inputs: x, weight, then scales and biases where bits > 0, the bias where has_bias, the gate
  // where has_gate.
  DecodeLinear(mx::Stream stream, int bits, int group_size, bool has_bias, bool has_gate)
      : mx::Primitive(stream),
        bits_(bits),
        group_size_(group_size),
        has_bias_(has_bias),
        has_gate_(has_gate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "DecodeLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int bits_;
  int group_size_;
  bool has_bias_;
  bool has_gate_;
};

}  // namespace attn_kernels
