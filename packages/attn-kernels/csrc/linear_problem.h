// A decode step's linear layer, out = x @ W^T (+ bias), for the CPU kernel: a few rows of
// activations against a weight matrix read once, dense or in mx.quantize's affine layout. Free of
// MLX headers (the arm64 check builds it with a cross compiler alone).
#pragma once

#include <cstdint>

#include "decode_problem.h"

namespace attn_kernels {

struct LinearProblem {
  int rows;     // M: rows of x and out (a decode step's tokens)
  int outputs;  // N: rows of W, columns of out
  int inputs;   // K: columns of x and W (unpacked)
  // x, out, bias, a dense W and a quantized W's scales and biases: one float dtype.
  ElementType dtype;
  // 0: W dense (N, K). 4 or 8: W is uint32 codes (N, K * bits / 32), code i of a row in bits
  // [bits * (i % (32 / bits)), ...) of word i / (32 / bits), with scales and biases (N, K /
  // group_size): w = scale * code + bias (mx.quantize's affine mode).
  int bits;
  int group_size;
  const void* x;           // (M, K), rows x_row_stride elements apart, columns contiguous
  int64_t x_row_stride;
  // SwiGLU's gate, laid out as x, or nullptr. With it the layer's input is silu(gate) * x (mlx-lm's
  // swiglu(gate, x)), computed in float32 as x is prepared: a decode step's MLP applies its
  // activation without an op (and a pass over the hidden row) of its own.
  const void* gate;
  int64_t gate_row_stride;
  const void* weight;      // dense (N, K) or codes, rows contiguous
  const void* scales;      // quantized only
  const void* biases;      // quantized only
  const void* bias;        // (N,) or nullptr
  void* out;               // (M, N) contiguous
};

}  // namespace attn_kernels
