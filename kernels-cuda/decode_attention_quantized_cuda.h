// The CUDA launch plan of the quantized-KV kernel. Free of MLX headers (nvcc compiles the .cu
// that implements it).
#pragma once

#include <cuda.h>

#include <cstddef>

#include "quantized_problem.h"

namespace attn_kernels::cuda {

// One launch: attend(problem, partials, chunk, arrival_slot) on grid (kv_rows * tiles, splits).
struct QuantizedPlan {
  CUfunction attend;
  unsigned grid[2];
  unsigned threads;
  unsigned smem;
  int chunk;
  int splits;
  size_t partial_floats;  // workspace for the chunks' partial states, 0 when splits == 1
  unsigned arrival_slot;
};

// Throws std::invalid_argument for what the kernel does not take (named in the message).
QuantizedPlan plan_quantized(const QuantizedProblem& problem);

}  // namespace attn_kernels::cuda
