// DecodeLinear's GPU kernel: out (M, N) = x (M, K) @ W^T (+ bias) for a decode step's few rows
// of x, W in mx.quantize's affine layout (4 or 8 bits), bf16 or f16. MLX's qmv re-reads the
// weights once per row of x and its qmm pads to 128-row tiles; under Nsight Compute a serving
// step of 2-32 rows spent 16 of its 20 ms of kernels there (docs/serving-cuda.md, "Kernel by
// kernel"). Here every weight is read once for all rows, on the tensor cores (mma.sync
// m16n8k16, A = weights, B = x):
//
// - A block covers 16 * MT outputs (W's rows); its warps split K, iterations of 128 inputs, and
//   add their sums through shared memory at the end. Lane (g, c) = (lane / 4, lane % 4) holds
//   32 consecutive codes (16 or 32 bytes) of rows g and g + 8 of each m16 tile, at k0 = 128 *
//   iteration + 32 c: the four lanes of a row read 64 (or 128) contiguous bytes.
// - The dot product's order over k is free, as long as A and B agree: lane c feeds its own codes
//   into its fragment slots 2c, 2c+1, 2c+8, 2c+9 in the order the dequantisation yields pairs
//   (4 bits: codes (0, 4), (1, 5), (2, 6), (3, 7) of a word; 8 bits: (0, 2), (1, 3) of a word),
//   and the matching x pairs come from one 16-byte load of the same 8 inputs (byte_perm).
// - Dequantisation to T pairs without conversions: a code OR'ed into the mantissa of a power of
//   two (128 in bf16, 1024 in f16) is that power plus the code; one subtraction leaves the code
//   exactly, one fma applies the group's scale and bias, rounded once. bf16 at 8 bits (codes to
//   255 do not fit 128's mantissa) goes through float: the code as 2^23 + code, an fma, a pack.
// - The next iteration's codes, scales and biases load while the current one multiplies.
//
// Included by linear_quantized.cu for nvcc and by emulation/run_linear_quantized.cpp under
// emulation/cuda_emu.h.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cstdint>
#include <type_traits>

#include "linear_problem.h"
#include "mma_m16n8k16.cuh"
#include "shared_memory.cuh"

namespace attn_kernels::cuda::linear {

constexpr int kLaneInputs = 32;                // codes of a row one lane holds per iteration
constexpr int kWarpInputs = 4 * kLaneInputs;   // inputs a warp covers per iteration
constexpr int kMaxWarps = 8;

// The 16 bits of a T (bf16 or f16) as float, and a float rounded to T's bits.
template <typename T>
__device__ __forceinline__ float to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(uint32_t{bits} << 16);
  } else {
#if defined(__CUDACC__)
    return __half2float(__ushort_as_half(bits));
#else
    return __half2float(__half{bits});
#endif
  }
}

template <typename T>
__device__ __forceinline__ uint16_t to_bits(float x) {
#if defined(__CUDACC__)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
#else
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x).bits;
  } else {
    return __float2half_rn(x).bits;
  }
#endif
}

// The power of two whose mantissa holds a code: 128 in bf16 (codes to 127), 1024 in f16.
template <typename T>
constexpr uint32_t kMagic = std::is_same_v<T, __nv_bfloat16> ? 0x4300u : 0x6400u;

// (magic_codes - magic) * scale + bias on both halves of T pairs, rounded once (fma).
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t magic_codes, uint32_t scale2,
                                               uint32_t bias2) {
  constexpr uint32_t magic2 = kMagic<T> * 0x10001u;
#if defined(__CUDACC__)
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  const uint32_t m = magic2;
  const T2 codes = __hsub2(*reinterpret_cast<const T2*>(&magic_codes),
                           *reinterpret_cast<const T2*>(&m));
  const T2 w = __hfma2(codes, *reinterpret_cast<const T2*>(&scale2),
                       *reinterpret_cast<const T2*>(&bias2));
  return *reinterpret_cast<const uint32_t*>(&w);
#else
  uint32_t out = 0;
  for (int h = 0; h < 2; ++h) {
    auto half = [h](uint32_t v) { return to_float<T>(uint16_t(v >> (16 * h))); };
    const float code = half(magic_codes) - half(magic2);
    out |= uint32_t{to_bits<T>(std::fma(code, half(scale2), half(bias2)))} << (16 * h);
  }
  return out;
#endif
}

// Two floats as a T pair (low half first).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return uint32_t{to_bits<T>(lo)} | uint32_t{to_bits<T>(hi)} << 16;
}

// A row's 8 codes of one sub-chunk as four T pairs, in the order the fragments take them:
// pairs 0, 1 feed the first mma (slots 2c..2c+1, 2c+8..2c+9), pairs 2, 3 the second.
// 4 bits (one word, codes 0-7): (0, 4), (1, 5), (2, 6), (3, 7). 8 bits (two words): (0, 2),
// (1, 3), (4, 6), (5, 7).
template <typename T, int BITS>
__device__ __forceinline__ void dequantize(const uint32_t* words, uint16_t scale, uint16_t bias,
                                           uint32_t (&pairs)[4]) {
  const uint32_t scale2 = scale * 0x10001u, bias2 = bias * 0x10001u;
  if constexpr (BITS == 4) {
    const uint32_t magic2 = kMagic<T> * 0x10001u;
    for (int i = 0; i < 4; ++i) {
      pairs[i] = scale_pair<T>(((words[0] >> (4 * i)) & 0x000f000fu) | magic2, scale2, bias2);
    }
  } else if constexpr (std::is_same_v<T, __half>) {
    for (int w = 0; w < 2; ++w) {
      pairs[2 * w] = scale_pair<T>(__byte_perm(words[w], 0x64646464u, 0x4240), scale2, bias2);
      pairs[2 * w + 1] = scale_pair<T>(__byte_perm(words[w], 0x64646464u, 0x4341), scale2, bias2);
    }
  } else {
    const float s = to_float<T>(scale), b = to_float<T>(bias);
    for (int w = 0; w < 2; ++w) {
      float code[4];
      for (int i = 0; i < 4; ++i) {
        // 2^23 + code: byte i of the word in the low mantissa bits of 0x4b000000
        code[i] = __uint_as_float(__byte_perm(words[w], 0x4b000000u, 0x7540 | i)) - 8388608.0f;
      }
      pairs[2 * w] = pack_pair<T>(fmaf(code[0], s, b), fmaf(code[2], s, b));
      pairs[2 * w + 1] = pack_pair<T>(fmaf(code[1], s, b), fmaf(code[3], s, b));
    }
  }
}

// x's 8 inputs of a sub-chunk (four T pairs from one 16-byte load: inputs (0, 1), (2, 3), ...)
// reordered as dequantize() orders the codes: the B fragments b0, b1 of the two mma.
template <int BITS>
__device__ __forceinline__ void order_inputs(const uint32_t (&x)[4], uint32_t (&b)[4]) {
  // 4 bits: (0, 4) (1, 5) (2, 6) (3, 7); 8 bits: (0, 2) (1, 3) (4, 6) (5, 7)
  constexpr int other = BITS == 4 ? 2 : 1;
  for (int s = 0; s < 2; ++s) {
    const int lo = BITS == 4 ? s : 2 * s;
    b[2 * s] = __byte_perm(x[lo], x[lo + other], 0x5410);
    b[2 * s + 1] = __byte_perm(x[lo], x[lo + other], 0x7632);
  }
}

// What a lane loads per iteration: its 32 codes of rows g and g + 8 of each m16 tile, with their
// groups' scales and biases.
template <int BITS, int MT>
struct Codes {
  uint32_t words[MT][2][BITS];  // 32 codes: 4 words at 4 bits, 8 at 8
  uint16_t scale[MT][2], bias[MT][2];
};

// rows_of[mt][r]: the lane's W rows (clamped into [0, N): rows past N are computed, not stored).
template <typename T, int BITS, int MT>
__device__ __forceinline__ void load_codes(const LinearProblem& p, const int (&rows_of)[MT][2],
                                           int k0, Codes<BITS, MT>& codes) {
  if (k0 >= p.inputs) {  // past K (K is a multiple of 32, not of 128): zeros into the mma
    for (int mt = 0; mt < MT; ++mt) {
      for (int r = 0; r < 2; ++r) {
        for (int w = 0; w < BITS; ++w) codes.words[mt][r][w] = 0;
        codes.scale[mt][r] = codes.bias[mt][r] = 0;
      }
    }
    return;
  }
  const int64_t words_per_row = int64_t(p.inputs) * BITS / 32;
  const int64_t groups_per_row = p.inputs / p.group_size;
  const int64_t group = k0 / p.group_size;
  const auto* scales = static_cast<const uint16_t*>(p.scales);
  const auto* biases = static_cast<const uint16_t*>(p.biases);
  for (int mt = 0; mt < MT; ++mt) {
    for (int r = 0; r < 2; ++r) {
      const int64_t row = rows_of[mt][r];
      const auto* src = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p.weight) +
                                                       row * words_per_row + k0 * BITS / 32);
      for (int v = 0; v < BITS / 4; ++v) {
        const uint4 q = __ldg(src + v);
        codes.words[mt][r][4 * v] = q.x, codes.words[mt][r][4 * v + 1] = q.y;
        codes.words[mt][r][4 * v + 2] = q.z, codes.words[mt][r][4 * v + 3] = q.w;
      }
      codes.scale[mt][r] = __ldg(scales + row * groups_per_row + group);
      codes.bias[mt][r] = __ldg(biases + row * groups_per_row + group);
    }
  }
}

// Eight inputs of x (T pairs) at `at`; zeros past K.
__device__ __forceinline__ void load_inputs(const uint16_t* at, bool inside, bool vector,
                                            uint32_t (&x)[4]) {
  if (!inside) {
    x[0] = x[1] = x[2] = x[3] = 0;
  } else if (vector) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {  // x's rows not 16-byte aligned (a view): element by element
    for (int i = 0; i < 4; ++i) {
      x[i] = uint32_t{__ldg(at + 2 * i)} | uint32_t{__ldg(at + 2 * i + 1)} << 16;
    }
  }
}

// Grid (ceil(N / (16 MT)), ceil(M / (8 NT))), blockDim.x = 32 * warps (1 to kMaxWarps), dynamic
// shared memory warps * 16 MT * 8 NT floats. NT: x's rows per pass in tiles of 8 (1, 2 or 4);
// MT: W's rows per warp in tiles of 16 (each x fragment loaded serves MT of them).
template <typename T, int BITS, int NT, int MT>
__global__ void __launch_bounds__(kMaxWarps * 32) linear_quantized(LinearProblem p) {
  ATTN_SHARED_FLOATS(partial);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int g = lane / 4, c = lane % 4;
  const int first_row = blockIdx.x * 16 * MT, first_token = blockIdx.y * 8 * NT;
  int rows_of[MT][2];
  for (int mt = 0; mt < MT; ++mt) {
    for (int r = 0; r < 2; ++r) {
      rows_of[mt][r] = min(first_row + 16 * mt + 8 * r + g, p.outputs - 1);
    }
  }
  const auto* x = static_cast<const uint16_t*>(p.x);
  const uint16_t* x_rows[NT];  // lane's column of each n8 tile: token 8 nt + g (clamped)
  for (int nt = 0; nt < NT; ++nt) {
    x_rows[nt] = x + int64_t(min(first_token + 8 * nt + g, p.rows - 1)) * p.x_row_stride;
  }
  const bool vector = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.x_row_stride % 8 == 0;

  float acc[MT][NT][4] = {};
  const int iterations = (p.inputs + kWarpInputs - 1) / kWarpInputs;
  Codes<BITS, MT> now{}, next{};
  if (warp < iterations) {
    load_codes<T, BITS, MT>(p, rows_of, warp * kWarpInputs + kLaneInputs * c, now);
  }
  for (int it = warp; it < iterations; it += warps) {
    const int k0 = it * kWarpInputs + kLaneInputs * c;
    if (it + warps < iterations) {
      load_codes<T, BITS, MT>(p, rows_of, k0 + warps * kWarpInputs, next);
    }
    for (int sub = 0; sub < kLaneInputs / 8; ++sub) {
      uint32_t b[NT][4];
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t in[4];
        load_inputs(x_rows[nt] + k0 + 8 * sub, k0 < p.inputs, vector, in);
        order_inputs<BITS>(in, b[nt]);
      }
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t w[2][4];  // rows g, g + 8
        for (int r = 0; r < 2; ++r) {
          dequantize<T, BITS>(now.words[mt][r] + sub * BITS / 4, now.scale[mt][r],
                              now.bias[mt][r], w[r]);
        }
        for (int s = 0; s < 2; ++s) {
          const uint32_t a[4] = {w[0][2 * s], w[1][2 * s], w[0][2 * s + 1], w[1][2 * s + 1]};
          for (int nt = 0; nt < NT; ++nt) {
            tensor_core::mma16816<T>(acc[mt][nt], a, b[nt][2 * s], b[nt][2 * s + 1]);
          }
        }
      }
    }
    now = next;
  }

  // The warps' sums through shared memory: partial[warp][token][row] (d: rows g, g + 8 and
  // tokens 2c, 2c + 1 of each tile).
  constexpr int tile_rows = 16 * MT, tile_tokens = 8 * NT;
  for (int mt = 0; mt < MT; ++mt) {
    for (int nt = 0; nt < NT; ++nt) {
      for (int j = 0; j < 4; ++j) {
        const int row = 16 * mt + g + 8 * (j / 2), token = 8 * nt + 2 * c + j % 2;
        partial[(warp * tile_tokens + token) * tile_rows + row] = acc[mt][nt][j];
      }
    }
  }
  __syncthreads();
  const auto* bias = static_cast<const uint16_t*>(p.bias);
  auto* out = static_cast<uint16_t*>(p.out);
  for (int i = threadIdx.x; i < tile_rows * tile_tokens; i += blockDim.x) {
    const int token = i / tile_rows, row = i % tile_rows;
    const int out_row = first_row + row, out_token = first_token + token;
    if (out_row >= p.outputs || out_token >= p.rows) continue;
    float sum = bias ? to_float<T>(bias[out_row]) : 0.0f;
    for (int w = 0; w < warps; ++w) sum += partial[(w * tile_tokens + token) * tile_rows + row];
    out[int64_t(out_token) * p.outputs + out_row] = to_bits<T>(sum);
  }
}

}  // namespace attn_kernels::cuda::linear
