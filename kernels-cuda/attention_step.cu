// AttentionStep's kernels other than attention on NVIDIA GPUs: the preprocessing
// (attention_step_kernel.cuh) and the strided copy. The attention over the cache is
// DecodeAttention's kernel (decode_attention.cu). No MLX headers here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include "attention_step_cuda.h"
#include "attention_step_kernel.cuh"

namespace attn_kernels::cuda {
namespace {

template <typename T>
__global__ void copy_strided(StridedCopy c) {
  const T* src = static_cast<const T*>(c.src);
  T* dst = static_cast<T*>(c.dst);
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < c.size;
       n += int64_t{gridDim.x} * blockDim.x) {
    int64_t rest = n, at = 0;
    for (int a = 3; a >= 0; --a) {
      at += (rest % c.shape[a]) * c.strides[a];
      rest /= c.shape[a];
    }
    dst[n] = src[at];
  }
}

CUfunction resolve(const void* kernel) {
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, kernel) != cudaSuccess) {
    throw std::runtime_error("[attention_step] cudaGetFuncBySymbol failed");
  }
  return reinterpret_cast<CUfunction>(f);
}

int dtype_index(ElementType dtype) {
  return dtype == ElementType::float32 ? 0 : dtype == ElementType::float16 ? 1 : 2;
}

}  // namespace

// Resolved once (function-local statics: these run on every call).
CUfunction step_preprocess_kernel(ElementType dtype) {
  static const CUfunction kernels[3] = {
      resolve(reinterpret_cast<const void*>(&step::step_preprocess<float>)),
      resolve(reinterpret_cast<const void*>(&step::step_preprocess<__half>)),
      resolve(reinterpret_cast<const void*>(&step::step_preprocess<__nv_bfloat16>))};
  return kernels[dtype_index(dtype)];
}

CUfunction copy_strided_kernel(size_t itemsize) {
  static const CUfunction kernels[2] = {
      resolve(reinterpret_cast<const void*>(&copy_strided<uint16_t>)),
      resolve(reinterpret_cast<const void*>(&copy_strided<uint32_t>))};
  return kernels[itemsize == 4 ? 1 : 0];
}

unsigned copy_blocks(int64_t size) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((size + kCopyThreads - 1) / kCopyThreads, 1, 132 * 16));
}

}  // namespace attn_kernels::cuda
