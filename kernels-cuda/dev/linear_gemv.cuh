// A one-row GPU kernel for DecodeLinear, the candidate to replace the many-row kernel
// (linear_quantized.cuh) at one row: out (1, N) = x (1, K) @ W^T (+ bias), W in mx.quantize's
// affine layout (4 or 8 bits, groups of 64 or 128), x, scales and biases bf16 or f16. A single
// request's decode step reads every weight for one multiply-add, so the read rate is all that
// counts, and at ~13 bytes a clock an SM the instructions spent per weight decide it: the
// many-row kernel (scale and bias applied to every weight, one row padded to eight) runs one row
// at 22-53% of the copy rate on an H100 at 4 bits, float32 SIMT kernels (an AND and an fma a
// code) at 19-74% (docs/serving-cuda.md, "One row"). Here a code costs under one instruction:
//
// - The tensor cores multiply raw codes: a code OR'ed into the mantissa of a power of two M (128
//   in bf16, 1024 in f16) is M + code exactly, a T pair from one AND (and a shift) for two codes.
//   mma.sync m16n8k16 sums (M + code) x over a chunk of 64 inputs in float32, and the chunk's
//   group map is applied after: sum (s c + b) x = s sum (M + c) x + (b - M s) sum x. bf16 at 8
//   bits (codes to 255 do not fit 128's mantissa) converts codes through float, exactly; M is 0.
// - Only column 0 of the 16 x 8 output matters; x is every column of B (the same registers).
// - A warp covers W's rows g and g + 8 (g = lane / 4) of a 16-row tile; lane column c = lane % 4
//   reads the 16 codes at 16 c of each 64-input chunk (8 or 16 contiguous bytes), which stay in
//   one group. The block's warps split the chunks; each keeps kStages - 1 chunks loading while
//   one multiplies, and the warps' sums meet in shared memory at the end.
// - Once a block, in shared memory: x as the B fragments (per chunk and lane column the 8 T
//   pairs in the order the code pairs come out: two 16-byte loads a chunk), and per row and chunk
//   (scale, (bias - M scale) sum x) from coalesced loads. Loaded per chunk by every lane, the
//   2-byte scales and biases were half the sectors the kernel moved and, with their address
//   arithmetic, most of its ~140 instructions a warp a chunk (Nsight Compute).
//
// Measured in an earlier form (scales and biases loaded per chunk) at 1.14-1.35x the many-row
// kernel's speed at 4 bits (8 warps, 4 stages); this form is checked under the CUDA emulation
// and awaits its device run (bench_linear.cu, the GPU tests, mlx-lm-decode against mlx-lm)
// before plan_linear_quantized() and the guard take it.
// Included by dev/bench_linear.cu and emulation/run_linear_gemv.cpp.
#pragma once

#include <cstdint>

#include "../linear_quantized.cuh"

namespace attn_kernels::cuda::linear {

constexpr int kChunkInputs = 64;  // inputs of a row per mma step (4 mma of k 16)
constexpr int kGemvMaxWarps = 16;
constexpr int kGemvStages = 4;

// M of the codes as the tensor cores see them (M + code), as a float.
template <typename T, int BITS>
__device__ __forceinline__ constexpr float code_offset() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return BITS == 4 ? 128.0f : 0.0f;
  return 1024.0f;
}

// Pair P (0-7) of a lane column's 16 codes (one chunk): its two inputs, counted from the
// column's first. 4 bits: word P / 4, codes (P % 4, P % 4 + 4); 8 bits: word P / 2, codes
// (P % 2, P % 2 + 2).
template <int BITS>
__device__ __forceinline__ constexpr int pair_input(int pair, int half) {
  if constexpr (BITS == 4) return 8 * (pair / 4) + pair % 4 + 4 * half;
  return 4 * (pair / 2) + pair % 2 + 2 * half;
}

// A lane column's 16 codes of one row (BITS / 2 words) as 8 T pairs (M + code each).
template <typename T, int BITS>
__device__ __forceinline__ void code_pairs(const uint32_t* words, uint32_t (&pairs)[8]) {
  if constexpr (BITS == 4) {
    constexpr uint32_t magic2 = kMagic<T> * 0x10001u;
    for (int w = 0; w < 2; ++w) {
      for (int i = 0; i < 4; ++i) pairs[4 * w + i] = ((words[w] >> (4 * i)) & 0x000f000fu) | magic2;
    }
  } else if constexpr (std::is_same_v<T, __half>) {
    for (int w = 0; w < 4; ++w) {
      pairs[2 * w] = __byte_perm(words[w], 0x64646464u, 0x4240);
      pairs[2 * w + 1] = __byte_perm(words[w], 0x64646464u, 0x4341);
    }
  } else {
    for (int w = 0; w < 4; ++w) {
      for (int i = 0; i < 2; ++i) {
        // 2^23 + code: byte i (and i + 2) in the low mantissa bits of 0x4b000000
        const float lo = __uint_as_float(__byte_perm(words[w], 0x4b000000u, 0x7540 | i));
        const float hi = __uint_as_float(__byte_perm(words[w], 0x4b000000u, 0x7542 | i));
        pairs[2 * w + i] = pack_pair<T>(lo - 8388608.0f, hi - 8388608.0f);
      }
    }
  }
}

// What a lane reads of a chunk from W: its codes of rows g and g + 8.
template <int BITS>
struct ChunkCodes {
  uint32_t words[2][BITS / 2];
};

// Shared floats a block needs for K inputs (chunks = K / 64) and `warps` warps: x's B fragments
// (32 words a chunk), x's partial sums (4 a chunk), per row and chunk the group scale and the
// bias term (2), the warps' sums (16 each).
__host__ __device__ constexpr int gemv_shared_floats(int chunks, int warps) {
  return 36 * chunks + 2 * 16 * chunks + 16 * warps;
}

// Grid ceil(N / 16) blocks of 32 * warps threads (warps up to kGemvMaxWarps), dynamic shared
// memory gemv_shared_floats(K / 64, warps) floats. K a multiple of 64, group_size 64 or 128.
template <typename T, int BITS, int kStages = kGemvStages>
__global__ void __launch_bounds__(kGemvMaxWarps * 32) linear_gemv(LinearProblem p) {
  ATTN_SHARED_FLOATS(shared);
  const int chunks = p.inputs / kChunkInputs;
  auto* x_pairs = reinterpret_cast<uint4*>(shared);                   // [chunk][column][2]
  float* x_sums = shared + 32 * chunks;                               // [chunk][column]
  auto* row_terms = reinterpret_cast<float2*>(shared + 36 * chunks);  // [row][chunk]
  float* partial = shared + 68 * chunks;                              // [warp][row]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int g = lane / 4, column = lane % 4;
  const int first_row = blockIdx.x * 16;

  // The codes of the first chunks go out first: they do not wait for shared memory.
  const int64_t words_per_row = int64_t(p.inputs) * BITS / 32;
  const uint32_t* codes[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t row = min(first_row + g + 8 * r, p.outputs - 1);  // past N: read, not stored
    codes[r] = static_cast<const uint32_t*>(p.weight) + row * words_per_row + column * BITS / 2;
  }
  auto load = [&](int chunk, ChunkCodes<BITS>& to) {
    if (chunk >= chunks) return;
    for (int r = 0; r < 2; ++r) {
      const uint32_t* at = codes[r] + chunk * (kChunkInputs * BITS / 32);
      if constexpr (BITS == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(at));
        to.words[r][0] = v.x, to.words[r][1] = v.y;
      } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
        to.words[r][0] = v.x, to.words[r][1] = v.y, to.words[r][2] = v.z, to.words[r][3] = v.w;
      }
    }
  };
  ChunkCodes<BITS> buffers[kStages];
  int loading = warp;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s, loading += warps) load(loading, buffers[s]);

  // x as the B fragments and its partial sums; then per row and chunk (scale, (bias - M scale)
  // * sum x): the chunk's sum is (M + codes) . x * scale + that term.
  const auto* x = static_cast<const uint16_t*>(p.x);
  const bool vector = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = threadIdx.x; i < 4 * chunks; i += blockDim.x) {
    const int chunk = i / 4, col = i % 4;
    uint32_t in[8];  // the column's 16 inputs as pairs (0, 1), (2, 3), ...
    for (int h = 0; h < 2; ++h) {
      uint32_t four[4];
      load_inputs(x + chunk * kChunkInputs + 16 * col + 8 * h, true, vector, four);
      for (int j = 0; j < 4; ++j) in[4 * h + j] = four[j];
    }
    auto input = [&](int k) { return uint16_t(in[k / 2] >> (16 * (k % 2))); };
    uint32_t pairs[8];
    for (int pair = 0; pair < 8; ++pair) {
      pairs[pair] = uint32_t{input(pair_input<BITS>(pair, 0))} |
                    uint32_t{input(pair_input<BITS>(pair, 1))} << 16;
    }
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += to_float<T>(input(k));
    x_pairs[2 * i] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    x_pairs[2 * i + 1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
    x_sums[i] = sum;
  }
  __syncthreads();
  const int groups_per_row = p.inputs / p.group_size;
  const int group_shift = p.group_size == 128 ? 1 : 0;  // chunks to groups
  for (int i = threadIdx.x; i < 16 * chunks; i += blockDim.x) {
    const int r = i / chunks, chunk = i % chunks;
    const int64_t group =
        int64_t(min(first_row + r, p.outputs - 1)) * groups_per_row + (chunk >> group_shift);
    const float scale = to_float<T>(__ldg(static_cast<const uint16_t*>(p.scales) + group));
    const float bias = to_float<T>(__ldg(static_cast<const uint16_t*>(p.biases) + group));
    const float x_sum = (x_sums[4 * chunk] + x_sums[4 * chunk + 1]) +
                        (x_sums[4 * chunk + 2] + x_sums[4 * chunk + 3]);
    row_terms[i] = make_float2(scale, fmaf(-code_offset<T, BITS>(), scale, bias) * x_sum);
  }
  __syncthreads();

  float acc[2] = {};
  const float2* terms[2] = {row_terms + g * chunks, row_terms + (g + 8) * chunks};
  auto multiply = [&](int chunk, const ChunkCodes<BITS>& in) {
    const uint4 b_lo = x_pairs[2 * (4 * chunk + column)];
    const uint4 b_hi = x_pairs[2 * (4 * chunk + column) + 1];
    const uint32_t b[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
    uint32_t a[2][8];
    for (int r = 0; r < 2; ++r) code_pairs<T, BITS>(in.words[r], a[r]);
    float d[4] = {};
    for (int t = 0; t < 4; ++t) {
      const uint32_t frag[4] = {a[0][2 * t], a[1][2 * t], a[0][2 * t + 1], a[1][2 * t + 1]};
      tensor_core::mma16816<T>(d, frag, b[2 * t], b[2 * t + 1]);
    }
    for (int r = 0; r < 2; ++r) {  // d[0]: row g (every column alike), d[2]: row g + 8
      const float2 term = terms[r][chunk];
      acc[r] = fmaf(term.x, d[2 * r], acc[r] + term.y);
    }
  };

  // The warp's chunks warp, warp + warps, ...: kStages - 1 loading while one multiplies, in
  // buffers that take turns (indexed by unrolled constants: registers, not local memory).
  for (int chunk = warp; chunk < chunks;) {
#pragma unroll
    for (int s = 0; s < kStages && chunk < chunks; ++s, chunk += warps, loading += warps) {
      load(loading, buffers[(s + kStages - 1) % kStages]);
      multiply(chunk, buffers[s]);
    }
  }

  if (column == 0) {
    partial[16 * warp + g] = acc[0];
    partial[16 * warp + g + 8] = acc[1];
  }
  __syncthreads();
  const int out_row = first_row + threadIdx.x;
  if (threadIdx.x < 16 && out_row < p.outputs) {
    float total = p.bias ? to_float<T>(static_cast<const uint16_t*>(p.bias)[out_row]) : 0.0f;
    for (int w = 0; w < warps; ++w) total += partial[16 * w + threadIdx.x];
    static_cast<uint16_t*>(p.out)[out_row] = to_bits<T>(total);
  }
}

}  // namespace attn_kernels::cuda::linear
