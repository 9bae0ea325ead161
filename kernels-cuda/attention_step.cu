// AttentionStep's kernels other than attention on NVIDIA GPUs: the preprocessing
// (attention_step_kernel.cuh) and the strided copy (strided_copy.cuh). The attention over the
// cache is DecodeAttention's kernel (decode_attention.cu). No MLX headers here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>

#include "attention_step_cuda.h"
#include "attention_step_kernel.cuh"
#include "strided_copy.cuh"

namespace attn_kernels::cuda {
namespace {

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

CopyLaunch plan_copy(const StridedCopy& copy, size_t itemsize) {
  static const CUfunction elements[2] = {
      resolve(reinterpret_cast<const void*>(&copy::copy_elements<uint16_t>)),
      resolve(reinterpret_cast<const void*>(&copy::copy_elements<uint32_t>))};
  static const CUfunction vectors[2] = {
      resolve(reinterpret_cast<const void*>(&copy::copy_vectors<uint16_t>)),
      resolve(reinterpret_cast<const void*>(&copy::copy_vectors<uint32_t>))};
  const int wide = itemsize == 4 ? 1 : 0;
  if (copy_by_vectors(copy, static_cast<int64_t>(itemsize))) {
    return {vectors[wide], copy_blocks(copy.size / (16 / static_cast<int64_t>(itemsize)))};
  }
  return {elements[wide], copy_blocks(copy.size)};
}

}  // namespace attn_kernels::cuda
