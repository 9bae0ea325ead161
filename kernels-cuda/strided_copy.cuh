// The strided copy's kernels (strided_copy.h): 16 bytes a thread where the rows allow it
// (copy_by_vectors), else an element a thread. The element kernel pays four 64-bit divisions
// and remainders an element; the vector kernel three 32-bit divisions per 16 bytes.
#pragma once

#include <cstdint>

#include "strided_copy.h"

namespace attn_kernels::cuda::copy {

template <typename T>
__global__ void copy_elements(StridedCopy c) {
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

// One 16-byte vector a thread: the destination's vector n is vector n % row_vectors of source
// row n / row_vectors, that row's index split over the first three axes.
template <typename T>
__global__ void copy_vectors(StridedCopy c) {
  constexpr uint32_t kPerVector = 16 / sizeof(T);
  const uint32_t row_vectors = static_cast<uint32_t>(c.shape[3]) / kPerVector;
  const uint32_t vectors = static_cast<uint32_t>(c.size / kPerVector);
  const uint32_t n1 = c.shape[1], n2 = c.shape[2];
  const T* src = static_cast<const T*>(c.src);
  uint4* dst = static_cast<uint4*>(c.dst);
  for (uint32_t n = blockIdx.x * blockDim.x + threadIdx.x; n < vectors;
       n += gridDim.x * blockDim.x) {
    const uint32_t row = n / row_vectors, v = n - row * row_vectors;
    const uint32_t i2 = row % n2, i01 = row / n2;
    const uint32_t i1 = i01 % n1, i0 = i01 / n1;
    const T* from = src + i0 * c.strides[0] + i1 * c.strides[1] + i2 * c.strides[2] +
                    v * kPerVector;
    dst[n] = *reinterpret_cast<const uint4*>(from);
  }
}

}  // namespace attn_kernels::cuda::copy
