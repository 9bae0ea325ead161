// The attention step's CUDA kernels other than attention (which is DecodeAttention's plan()).
// Free of MLX headers (nvcc compiles the .cu that implements it).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "step_problem.h"

namespace attn_kernels::cuda {

// step_preprocess(StepProblem): q/k RMSNorm + RoPE, q to its scratch, k and v into the caches
// (quantized as MLX's CUDA mx.quantize where StepProblem::bits is set). One warp per (token,
// head) of the Hq + Hkv heads.
constexpr unsigned kStepWarps = 4;
CUfunction step_preprocess_kernel(ElementType dtype);

// copy_strided(StridedCopy): a 4-D array with any strides into a row-contiguous one (a cache
// that could not be donated; heads-first attention output into o_proj's token-first layout).
struct StridedCopy {
  const void* src;
  void* dst;
  int shape[4];
  int64_t strides[4];  // the source's, in elements
  int64_t size;
};
CUfunction copy_strided_kernel(size_t itemsize);  // 2 or 4 bytes: a copy moves bits
constexpr unsigned kCopyThreads = 256;
unsigned copy_blocks(int64_t size);

}  // namespace attn_kernels::cuda
