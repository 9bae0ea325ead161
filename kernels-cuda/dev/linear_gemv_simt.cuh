// A one-row GPU kernel for DecodeLinear in float32 SIMT, the other candidate beside
// linear_gemv.cuh (tensor cores): out (1, N) = x (1, K) @ W^T (+ bias), W in mx.quantize's
// affine layout (4 or 8 bits, groups a multiple of 32), x, scales and biases bf16 or f16.
//
// - A block covers R rows of W. Thread t reads a piece of 32 codes (16 bytes at 4 bits, 32 at 8)
//   of each of the R rows at input 32 t (then 32 (t + threads), ...): R loads in flight before
//   any math, and x's 32 inputs prepared once for the R rows.
// - A code is read in place as a float. A word's bits below 2^24 are, as a float, the integer
//   times 2^-149 exactly (the subnormals and the first binade), so (word & mask) for the code at
//   bit p is code * 2^(p - 149), and one fma with x * 2^(kScaleExp - p) adds
//   code * x * 2^(kScaleExp - 149): one AND and one fma a code (the word's top byte shifts down
//   first). The fma keeps subnormals (inline PTX without .ftz: the files build with
//   --use_fast_math, which flushes them).
// - The group's affine map once a piece: sum (s c + b) x = s sum c x + b sum x, in float32.
// - A thread's R sums reduce across the warp in steps that halve the rows a lane holds (9
//   shuffles for 8 rows, not 40), then across warps through shared memory.
//
// On an H100 at one row, 1.0-1.9x the many-row kernel's speed (R 2-8, bf16, 4 bits), ~41
// instructions a 4-bit word where the code math is 17 (docs/serving-cuda.md, "One row").
// Included by dev/bench_linear.cu and emulation/run_linear_gemv.cpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "../linear_quantized.cuh"

namespace attn_kernels::cuda::linear {

constexpr int kPieceInputs = 32;  // inputs of a row a thread reads per step
constexpr int kSimtMaxThreads = 256;
constexpr int kScaleExp = 64;  // x held as x * 2^(64 - p): no overflow below |x| = 2^64

// a * b + c keeping subnormal operands (the codes read as floats are subnormal).
__device__ __forceinline__ float fma_subnormal(float a, float b, float c) {
#if defined(__CUDACC__)
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
#else
  return std::fma(a, b, c);
#endif
}

// 2^e as a float (e in the normal range, -126 to 127).
__device__ __forceinline__ float exp2_float(int e) {
  return __uint_as_float(uint32_t(127 + e) << 23);
}

// The bit position code j of a word is read at: in place below bit 24, else after >> 24.
template <int BITS>
__device__ __forceinline__ constexpr int code_position(int j) {
  constexpr int in_place = 24 / BITS;
  return BITS * (j < in_place ? j : j - in_place);
}

// Sums v[0..R) of every lane of a warp: returns the sum of the row `row` the lane ends with.
// Each step hands half the rows a lane holds to its partner and keeps the other half.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&v)[R], int lane, int& row) {
  static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R: a power of two up to 32");
  row = 0;
  int offset = 16;
#pragma unroll
  for (int n = R; n > 1; n /= 2, offset /= 2) {
    const bool upper = lane & offset;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = upper ? v[i] : v[i + n / 2];
      const float keep = upper ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
    if (upper) row += n / 2;
  }
  for (; offset >= 1; offset /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
  return v[0];
}

// Grid ceil(N / R) blocks of `threads` (a multiple of 32, up to kSimtMaxThreads), dynamic shared
// memory threads / 32 * R floats. K and group_size multiples of 32.
template <typename T, int BITS, int R>
__global__ void __launch_bounds__(kSimtMaxThreads) linear_gemv_simt(LinearProblem p) {
  ATTN_SHARED_FLOATS(partial);
  constexpr int kCodes = 32 / BITS;  // codes of a word
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int first_row = blockIdx.x * R;
  const int64_t words_per_row = int64_t(p.inputs) * BITS / 32;
  const int64_t groups_per_row = p.inputs / p.group_size;
  const auto* weight = static_cast<const uint32_t*>(p.weight);
  const auto* scales = static_cast<const uint16_t*>(p.scales);
  const auto* biases = static_cast<const uint16_t*>(p.biases);
  const auto* x = static_cast<const uint16_t*>(p.x);
  const bool vector = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  int64_t rows[R];  // rows past N are read (clamped) and not stored
  for (int r = 0; r < R; ++r) rows[r] = min(first_row + r, p.outputs - 1);

  float acc[R] = {};
  const int pieces = p.inputs / kPieceInputs;
  for (int piece = threadIdx.x; piece < pieces; piece += blockDim.x) {
    const int k0 = piece * kPieceInputs;
    uint32_t words[R][BITS];  // 32 codes a row
    uint16_t scale[R], bias[R];
    for (int r = 0; r < R; ++r) {
      const auto* src = reinterpret_cast<const uint4*>(weight + rows[r] * words_per_row) +
                        piece * BITS / 4;
      for (int v = 0; v < BITS / 4; ++v) {
        const uint4 q = __ldg(src + v);
        words[r][4 * v] = q.x, words[r][4 * v + 1] = q.y;
        words[r][4 * v + 2] = q.z, words[r][4 * v + 3] = q.w;
      }
      const int64_t group = rows[r] * groups_per_row + k0 / p.group_size;
      scale[r] = __ldg(scales + group);
      bias[r] = __ldg(biases + group);
    }
    // x's 32 inputs, each scaled for the position its code is read at, and their sum.
    float xs[kPieceInputs], x_sum = 0.0f;
    for (int i = 0; i < kPieceInputs / 8; ++i) {
      uint32_t pairs[4];
      load_inputs(x + k0 + 8 * i, true, vector, pairs);
      for (int e = 0; e < 8; ++e) {
        const float value = to_float<T>(uint16_t(pairs[e / 2] >> (16 * (e % 2))));
        const int k = 8 * i + e;
        x_sum += value;
        xs[k] = value * exp2_float(kScaleExp - code_position<BITS>(k % kCodes));
      }
    }
    for (int r = 0; r < R; ++r) {
      float dot = 0.0f;
      for (int w = 0; w < BITS; ++w) {
        const uint32_t low = words[r][w], high = words[r][w] >> 24;
        for (int j = 0; j < kCodes; ++j) {
          constexpr uint32_t mask = (1u << BITS) - 1;
          const uint32_t bits = (j < 24 / BITS ? low : high) & (mask << code_position<BITS>(j));
          dot = fma_subnormal(__uint_as_float(bits), xs[w * kCodes + j], dot);
        }
      }
      const float s = to_float<T>(scale[r]) * exp2_float(149 - kScaleExp);
      acc[r] = fma_subnormal(s, dot, fmaf(to_float<T>(bias[r]), x_sum, acc[r]));
    }
  }

  int row;
  const float sum = warp_sum_rows<R>(acc, lane, row);
  if (lane % (32 / R) == 0) partial[warp * R + row] = sum;
  __syncthreads();
  const int out_row = first_row + threadIdx.x;
  if (threadIdx.x < R && out_row < p.outputs) {
    float total = p.bias ? to_float<T>(static_cast<const uint16_t*>(p.bias)[out_row]) : 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) total += partial[w * R + threadIdx.x];
    static_cast<uint16_t*>(p.out)[out_row] = to_bits<T>(total);
  }
}

}  // namespace attn_kernels::cuda::linear
