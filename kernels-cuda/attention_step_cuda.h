// The attention step's CUDA kernels other than attention (which is DecodeAttention's plan()).
// Free of MLX headers (nvcc compiles the .cu that implements it).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "step_problem.h"
#include "strided_copy.h"

namespace attn_kernels::cuda {

// step_preprocess(StepProblem): q/k RMSNorm + RoPE, q to its scratch, k and v into the caches
// (quantized as MLX's CUDA mx.quantize where StepProblem::bits is set). One warp per (token,
// head) of the Hq + Hkv heads.
constexpr unsigned kStepWarps = 4;
CUfunction step_preprocess_kernel(ElementType dtype);

// A StridedCopy's kernel (strided_copy.cuh) and blocks of kCopyThreads; itemsize 2 or 4 bytes
// (a copy moves bits).
struct CopyLaunch {
  CUfunction kernel;
  unsigned blocks;
};
CopyLaunch plan_copy(const StridedCopy& copy, size_t itemsize);

}  // namespace attn_kernels::cuda
