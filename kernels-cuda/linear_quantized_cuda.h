// The CUDA launch plan of DecodeLinear's quantized kernel (linear_quantized.cuh). Free of MLX
// headers (nvcc compiles the .cu that implements it).
#pragma once

#include <cuda.h>

#include "linear_problem.h"

namespace attn_kernels::cuda {

// One launch: kernel(problem) on grid[0] x grid[1] blocks of `threads`, `smem` bytes of dynamic
// shared memory.
struct LinearPlan {
  CUfunction kernel;
  unsigned grid[2];
  unsigned threads;
  unsigned smem;
};

// Throws std::invalid_argument for what the kernel does not take (named in the message): dense
// or float32 weights, bits other than 4 and 8, K not a multiple of 32, misaligned codes.
LinearPlan plan_linear_quantized(const LinearProblem& problem);

}  // namespace attn_kernels::cuda
