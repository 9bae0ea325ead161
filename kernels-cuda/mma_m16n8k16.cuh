// d += A B on the tensor cores, mma.sync m16n8k16 with bf16 or f16 operands and float32
// accumulators (PTX ISA, "Matrix fragments for mma.m16n8k16"): the one instruction both
// tensor-core kernels use (decode_attention_mma.cuh, decode_attention_quantized_mmat.cuh). Under
// the CPU emulation (emulation/cuda_emu.h) each lane gathers its A rows and B columns with
// shuffles and sums in float.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <bit>
#include <cstdint>
#include <type_traits>

namespace attn_kernels::cuda::tensor_core {

#if !defined(__CUDACC__)
// An operand's 16 bits as float (the emulation's __half and __nv_bfloat16 hold raw bits).
template <typename T>
inline float operand_value(uint16_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return std::bit_cast<float>(uint32_t{bits} << 16);
  } else {
    return float(std::bit_cast<_Float16>(bits));
  }
}
#endif

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDACC__)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the plans pick the tensor-core kernels only on sm_80 and newer
#else
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
#else
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  auto at = [](uint32_t w, int i) { return operand_value<T>(uint16_t(w >> (16 * i))); };
  float row[2][16], col[2][16];  // A rows g, g + 8; B columns 2c, 2c + 1
  for (int t = 0; t < 4; ++t) {
    const uint32_t a0 = __shfl_sync(0xffffffffu, a[0], 4 * g + t);
    const uint32_t a1 = __shfl_sync(0xffffffffu, a[1], 4 * g + t);
    const uint32_t a2 = __shfl_sync(0xffffffffu, a[2], 4 * g + t);
    const uint32_t a3 = __shfl_sync(0xffffffffu, a[3], 4 * g + t);
    for (int i = 0; i < 2; ++i) {
      row[0][2 * t + i] = at(a0, i), row[0][2 * t + 8 + i] = at(a2, i);
      row[1][2 * t + i] = at(a1, i), row[1][2 * t + 8 + i] = at(a3, i);
    }
    for (int n = 0; n < 2; ++n) {
      const uint32_t x0 = __shfl_sync(0xffffffffu, b0, 4 * (2 * c + n) + t);
      const uint32_t x1 = __shfl_sync(0xffffffffu, b1, 4 * (2 * c + n) + t);
      for (int i = 0; i < 2; ++i) col[n][2 * t + i] = at(x0, i), col[n][2 * t + 8 + i] = at(x1, i);
    }
  }
  for (int r = 0; r < 2; ++r) {
    for (int n = 0; n < 2; ++n) {
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += row[r][k] * col[n][k];
      d[2 * r + n] += sum;
    }
  }
#endif
}

}  // namespace attn_kernels::cuda::tensor_core
