// The tensor-core kernel of DecodeAttentionQuantized ("mmat4", the CUDA default; "mmat" is the
// same kernel sized for 2 blocks per SM; docs/quantized-kv-cuda.md): one block of 4 warps per (key/value
// row, tile of 8 query vectors, context chunk); each warp walks sub-steps of 16 positions, which
// it copies itself from global into shared memory with cp.async, STAGES - 1 sub-steps ahead of the
// one it computes (decode_attention_quantized_stages.cuh), and combines them with an online
// softmax in float32; the warps, then the chunks of a split, are merged by finish().
//
// Codes become f16 mma operands with one instruction per register: prmt puts a byte beside a
// zero byte (or lop3 masks a nibble), and f16 bits below 0x400 are subnormals, c * 2^-24, exact
// and linear in the bits (the tensor cores take them as they are). An odd nibble masked in place
// is 16 c * 2^-24, so at 4 bits the queries' slots facing even nibbles carry a factor 16 and the
// output rows of odd nibbles come out 16 times larger; the powers of two leave the float32
// results through the score scale, the bias term and the final write. (Each code was 1024 + c
// minus 1024 before, one f16 instruction more per register: docs/quantized-kv-cuda.md, "Codes as f16
// subnormals".)
// Scales and biases apply per quantization group in float32:
//     scores:  q . (s * c + b) = s * (q . c) + b * sum(q)
// so each group's k-steps accumulate into their own mma tile before s and b apply; and
//     values:  sum_j w_j (s_j * c_j + b_j) = sum_j (w_j s_j) c_j + sum_j w_j b_j
// where P's operand carries w_j * s_j (rounded to f16) of the tile's group, and the second sum
// is a float32 running term per vector and group. f16 operands whatever the queries' dtype: bf16
// has no subnormal room for 8-bit codes (7 mantissa bits), and bf16 queries fit f16 (scaled down
// by a power of two first if any |q|, times 16 where it faces even nibbles, reaches 2^15).
//
// The scores are computed transposed, S^T = K Q^T: the codes of 16 positions are the A operand
// and the tile's 8 vectors the columns, so one mma per k-step covers a sub-step (8 score mmas at
// D = 128; untransposed, with the vectors as the 16 A rows, only 4 of them are real at GQA 4 and
// L = 1, and a sub-step takes 16). K is read in blocks of BK = min(GS, 64) dims, lane c holding
// BK / 4 contiguous dims of each block, so every mma tile lies in one quantization group; Q's B
// operand follows the same dims (k_dim). The scores land as (positions g, g + 8; vectors 2c,
// 2c + 1) per lane; the softmax runs in that layout (the max over positions is a reduction across
// the lanes that share c) and movmatrix.trans turns the f16 weights into P^T's B operand of
// O^T += V^T P^T. Other cuts:
//   - V^T's A operand comes from ldmatrix.trans over the stage's V rows (pairs of code bytes as
//     b16): one prmt or lop3 per register (and a shift per two registers for 4-bit codes in the
//     upper byte of each position's b16);
//   - exp2 with log2(e) folded into the score scale (ex2.approx, one instruction);
//   - the output, denominator and bias terms are rescaled only when some vector's max grew in
//     the sub-step (a warp vote; the factor is exactly 1 otherwise);
//   - a uniform test skips the per-position causal/mask checks for sub-steps wholly visible.
// BLOCKS is the launch bound's blocks per SM (registers <= 65536 / (128 * BLOCKS)); STAGES is
// chosen by the dispatcher so that BLOCKS blocks' stages fit the SM's shared memory.
// (Variants of this kernel and the earlier ones it replaced, with their timings on the H200:
// docs/quantized-kv-cuda.md.)
#pragma once

#include <cstring>
#include <type_traits>

#include "decode_attention_quantized_kernel.cuh"
#include "decode_attention_quantized_stages.cuh"
#include "mma_m16n8k16.cuh"

namespace attn_kernels::cuda::quantized {

constexpr int kMmaStep = 16;  // positions per warp and sub-step: the K of the P V mma
static_assert(kStagePositions == kMmaStep, "a stage holds one sub-step");

__device__ __forceinline__ float round_half(float x) {
#if defined(__CUDACC__)
  return __half2float(__float2half_rn(x));
#else
  return float(static_cast<_Float16>(x));
#endif
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
#if defined(__CUDACC__)
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
#else
  return uint32_t(std::bit_cast<uint16_t>(static_cast<_Float16>(lo))) |
         uint32_t(std::bit_cast<uint16_t>(static_cast<_Float16>(hi))) << 16;
#endif
}

using tensor_core::mma16816;  // f16 operands here: the codes are exact in f16

__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t selector) {
  return __byte_perm(x, y, selector);
}

// Element e (< N) of N values of type T packed in words, as float.
template <typename T>
__device__ __forceinline__ float unpack(const uint32_t* w, int e) {
  const uint16_t bits = uint16_t(w[e / 2] >> (16 * (e % 2)));
#if defined(__CUDACC__)
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
#else
  return to_float(T{bits});
#endif
}

// The dim (within the lane's block piece) that k-step s's slot j (low and high half of the first
// register, then of the second) stands for: what Q's B operand must follow. 8-bit: a word of codes
// is one k-step; 4-bit: a word is two (nibbles 2h, 2h + 4 and 2h + 1, 2h + 5 for h = 0, 1).
template <int BITS>
__host__ __device__ constexpr int k_dim(int s, int j) {
  return BITS == 8 ? 4 * s + j : 8 * (s / 2) + 2 * (s % 2) + (j >> 1) + 4 * (j & 1);
}

// Four 8x8 b16 matrices from shared memory, transposed: lane (g, c) gets elements (2c, g) and
// (2c + 1, g) of matrix i in r[i]; lane 8i + k gives the address of row k of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const char* row) {
#if defined(__CUDACC__)
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at)
               : "memory");
#else
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const uint64_t mine = reinterpret_cast<uint64_t>(row);
  for (int i = 0; i < 4; ++i) {
    uint16_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int from = 8 * i + 2 * c + h;
      const uint64_t lo = __shfl_sync(0xffffffffu, uint32_t(mine), from);
      const uint64_t hi = __shfl_sync(0xffffffffu, uint32_t(mine >> 32), from);
      std::memcpy(&half[h], reinterpret_cast<const char*>(lo | hi << 32) + 2 * g, 2);
    }
    r[i] = half[0] | uint32_t(half[1]) << 16;
  }
#endif
}

// The transpose of an 8x8 b16 matrix held as an mma fragment (lane (g, c): row g, columns 2c,
// 2c + 1): lane (g, c) gets elements (2c, g) and (2c + 1, g).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
#if defined(__CUDACC__)
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
#else
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const uint32_t lo = __shfl_sync(0xffffffffu, x, 4 * (2 * c) + g / 2);
  const uint32_t hi = __shfl_sync(0xffffffffu, x, 4 * (2 * c + 1) + g / 2);
  return (lo >> (16 * (g % 2)) & 0xffffu) | (hi >> (16 * (g % 2)) & 0xffffu) << 16;
#endif
}

__device__ __forceinline__ float exp2_approx(float x) {
#if defined(__CUDACC__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

__device__ __forceinline__ bool warp_any(bool x) {
#if defined(__CUDACC__)
  return __any_sync(0xffffffffu, x);
#else
  float v = x ? 1.0f : 0.0f;
  for (int offset = 1; offset < 32; offset *= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v > 0.0f;
#endif
}

// Nibbles i and i + 4 (bits 4i..4i+3 and 16+4i..) of a word as an f16 pair of subnormals: c *
// 2^-24 for even i, 16 c * 2^-24 for odd i (one lop3, a shift for i >= 2).
__device__ __forceinline__ uint32_t nibble_pair(uint32_t x, int i) {
  const uint32_t y = i >= 2 ? x >> 8 : x;
  return y & (i % 2 == 0 ? 0x000f000fu : 0x00f000f0u);
}

// Bytes `selector` (prmt nibbles 0-3, in the low nibble of each half) of x as an f16 pair of
// subnormals c * 2^-24: a zero byte above each code.
__device__ __forceinline__ uint32_t byte_pair(uint32_t x, uint32_t selector) {
  return prmt(x, 0u, selector | 0x4040u);
}

// K codes of one k-step s of a lane's row piece w as the A operand's two registers of that row
// (slots 2c, 2c + 1 and 2c + 8, 2c + 9): the dims of k_dim<BITS>(s, 0..3). At 4 bits `lo` holds
// even nibbles (c * 2^-24), `hi` odd ones (16 c * 2^-24).
template <int BITS>
__device__ __forceinline__ void k_pair(const uint32_t* w, int s, uint32_t& lo, uint32_t& hi) {
  if constexpr (BITS == 8) {
    lo = byte_pair(w[s], 0x0100);  // codes 4s, 4s + 1
    hi = byte_pair(w[s], 0x0302);  // codes 4s + 2, 4s + 3
  } else {
    // nibbles 2h, 2h + 4 and 2h + 1, 2h + 5 of word s / 2, h = s % 2
    lo = nibble_pair(w[s / 2], 2 * (s % 2));
    hi = nibble_pair(w[s / 2], 2 * (s % 2) + 1);
  }
}

// Stages per warp of the mmat kernel sized for BLOCKS blocks per SM: StageLayout's at 2 (~20 KB
// per warp), else as many as BLOCKS blocks' shared memory allows on the H100/H200
// (228 KB per SM, 1 KB of it reserved per block), at least 2.
template <int BITS, int D, int GS, int BLOCKS>
__host__ __device__ constexpr int mmat_stages() {
  using S = StageLayout<BITS, D, GS>;
  if (BLOCKS == 2) return S::kStages;
  const int fit = (228 * 1024 / BLOCKS - 1024) / (kWarps * S::kBytes);
  return fit < 2 ? 2 : fit > 8 ? 8 : fit;
}

// stage_in()'s copies of a whole sub-step (16 positions before the chunk's end) from per-lane
// source pointers that advance by one warp step per sub-step, instead of addresses recomputed
// from the position each time (about 50 instructions of a sub-step's ~400 in stage_in).
// Where the scales take more than one 16-byte piece per lane (D = 256, group 32), stage_in().
template <int BITS, int D, int GS>
struct StageCopies {
  using S = StageLayout<BITS, D, GS>;
  static constexpr int kPieces = S::kRowBytes / 16;  // per row
  static constexpr int kRowsPerPass = 32 / kPieces, kPasses = kStagePositions / kRowsPerPass;
  static constexpr int kScalePieces = 4 * S::kScaleBytes / 16;  // of the four arrays
  static constexpr bool kApplies = kScalePieces <= 32;  // one scale piece per lane at most
  const char* k;      // this lane's first K piece of the sub-step at `at`
  const char* v;      // V likewise
  const char* scale;  // its piece of the scales and biases (lanes < kScalePieces)
  int to;             // its first piece's offset in a stage
  int scale_to;

  __device__ __forceinline__ StageCopies(const char* const (&codes)[2],
                                         const int64_t (&row_bytes)[2],
                                         const char* const (&scales)[4], int at, int lane) {
    const int first_row = lane / kPieces, piece = lane % kPieces;
    k = codes[0] + (at + first_row) * row_bytes[0] + piece * 16;
    v = codes[1] + (at + first_row) * row_bytes[1] + piece * 16;
    to = first_row * S::kPitch + piece * 16;
    const int a = lane / (kScalePieces / 4) % 4, scale_piece = lane % (kScalePieces / 4);
    const char* row = a == 0 ? scales[0] : a == 1 ? scales[1] : a == 2 ? scales[2] : scales[3];
    scale = row + int64_t{at} * S::kGroups * 2 + scale_piece * 16;
    scale_to = S::kScales + a * S::kScaleBytes + scale_piece * 16;
  }
  __device__ __forceinline__ void copy(char* stage, const int64_t (&row_bytes)[2],
                                       int lane) const {
#pragma unroll
    for (int x = 0; x < kPasses; ++x) {
      copy_async16(stage + to + x * kRowsPerPass * S::kPitch, k + x * kRowsPerPass * row_bytes[0],
                   16);
      copy_async16(stage + S::kV + to + x * kRowsPerPass * S::kPitch,
                   v + x * kRowsPerPass * row_bytes[1], 16);
    }
    if (lane < kScalePieces) copy_async16(stage + scale_to, scale, 16);
  }
  __device__ __forceinline__ void advance(const int64_t (&row_bytes)[2], int positions) {
    k += positions * row_bytes[0];
    v += positions * row_bytes[1];
    scale += positions * S::kGroups * 2;
  }
};

// The shared memory the mmat kernel takes with STAGES stages per warp.
template <int BITS, int D, int GS, int STAGES>
__host__ __device__ constexpr int mmat_smem_bytes() {
  using S = StageLayout<BITS, D, GS>;
  const int stages = kWarps * STAGES * S::kBytes;
  const int states = states_smem_bytes(kMmaVectors, D);
  return stages > states ? stages : states;
}

// V^T tile t's row h (0: the lane's row g, 1: row g + 8) as a dim: 8-bit tiles are the 16 dims
// of 16-byte piece t (rows g, g + 8: dims 2g, 2g + 1); 4-bit pieces hold 32 dims, two tiles
// (rows: dims 4g + 2 (t % 2) + h).
template <int BITS>
__device__ __forceinline__ int v_dim(int t, int g, int h) {
  return BITS == 8 ? 16 * t + 2 * g + h : 32 * (t / 2) + 4 * g + 2 * (t % 2) + h;
}

// grid (kv_rows * tiles of 8 vectors, splits), kThreads threads, mmat_smem_bytes() of shared
// memory.
template <typename T, int BITS, int D, int GS, int STAGES, int BLOCKS>
__global__ void __launch_bounds__(kThreads, BLOCKS)
    attend_quantized_mmat(QuantizedProblem p, float* partials, int chunk, unsigned slot) {
  static_assert(STAGES >= 2, "a pipeline of one stage copies nothing ahead");
  ATTN_SHARED_FLOATS(smem);
  // Subnormal codes: the score mmas and the output rows of odd code slots come out times
  // 2^-kCodeExp (4 bits: odd nibbles are 16 c * 2^-24, the queries facing even ones times 16),
  // the rows of even slots times 2^-24.
  constexpr int kCodeExp = BITS == 8 ? 24 : 20;
  constexpr float kEvenSlotMul = BITS == 8 ? 1.0f : 16.0f;
  constexpr int NG = D / GS;                // groups per row
  constexpr int BK = GS < 64 ? GS : 64;     // K block
  constexpr int KB = D / BK, KC = BK / 4;   // K blocks; a lane's dims of each
  constexpr int KSB = BK / 16;              // k-steps per block
  constexpr int KBYTES = KC * BITS / 8, KWORDS = KBYTES / 4;
  constexpr int kSteps = D / 16;            // k-steps of a score, V^T tiles of the output
  constexpr int VPIECES = D * BITS / 8 / 16;  // 16-byte pieces of a V row: ldmatrix columns
  constexpr int SBYTES = NG * 2;            // one position's scales (or biases)
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kThreads == 4 * 32 && kWarps == 4, "the schedule takes 4 warps");
  static_assert(VPIECES % 2 == 0, "ldmatrix.x4 takes two pieces of both position halves");
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) trace_stamp(kTraceEntry);
  const int L = p.query_len, S = p.context, vectors = p.group * L;
  const int tiles = (vectors + kMmaVectors - 1) / kMmaVectors;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  // The chunk's positions inside the batch row's range (every position without per-row ranges),
  // from a whole sub-step: the copies take 16 positions' scales in 16-byte pieces (aligned there,
  // mmat_applies), and the positions before the range's start score -inf.
  const CacheRange range = p.range(kv_row / p.kv_heads);
  const int begin = max(split * chunk, range.start / kMmaStep * kMmaStep);
  const int end = min(min(S, split * chunk + chunk), range.end);

  const char* k_codes =
      reinterpret_cast<const char*>(p.k_codes + p.kv_offset(p.k_strides[0], kv_row));
  const char* v_codes =
      reinterpret_cast<const char*>(p.v_codes + p.kv_offset(p.v_strides[0], kv_row));
  const T* k_scales = static_cast<const T*>(p.k_scales) + p.kv_offset(p.k_strides[1], kv_row);
  const T* k_biases = static_cast<const T*>(p.k_biases) + p.kv_offset(p.k_strides[2], kv_row);
  const T* v_scales = static_cast<const T*>(p.v_scales) + p.kv_offset(p.v_strides[1], kv_row);
  const T* v_biases = static_cast<const T*>(p.v_biases) + p.kv_offset(p.v_strides[2], kv_row);
  const int64_t k_row_bytes = p.k_strides[0][2] * 4, v_row_bytes = p.v_strides[0][2] * 4;

  constexpr int kWarpStep = kWarps * kMmaStep;
  using Stage = StageLayout<BITS, D, GS>;
  char* const stages = reinterpret_cast<char*>(smem) + warp * STAGES * Stage::kBytes;
  const char* const codes[2] = {k_codes, v_codes};
  const int64_t row_bytes[2] = {k_row_bytes, v_row_bytes};
  const char* const scale_rows[4] = {
      reinterpret_cast<const char*>(k_scales), reinterpret_cast<const char*>(k_biases),
      reinterpret_cast<const char*>(v_scales), reinterpret_cast<const char*>(v_biases)};

  // Lanes 4g..4g+3 load query vector g of the tile (the B operand's column g): the loads go out
  // first, then the copies of the first STAGES - 1 sub-steps, so that the queries' conversion
  // runs while both are in flight (the copies' wait is the longest of a call's start).
  // A lane's dims of block w are KC contiguous ones: 16-byte loads where the row allows them
  // (8x fewer requests than one per value: the whole grid reads the same few KB of queries at
  // once, and at 4 bits, S = 131072, the values' loads kept L2 busy for ~2 µs; H200).
  const int q_r = tile * kMmaVectors + g;
  const bool q_real = q_r < vectors;
  const int q_i = (q_real ? q_r : 0) % L;
  static_assert(KC % 8 == 0, "a lane's dims of a block are whole 16-byte pieces");
  uint32_t q_bits[KB][KC / 2];  // dims w * BK + c * KC + e, two per word as stored (f16/bf16)
  {
    const int row = kv_row * p.group + (q_real ? q_r : 0) / L;
    const T* q_row = static_cast<const T*>(p.queries) + p.q_offset(row, q_i);
    const bool pieces = p.q_strides[3] == 1 && reinterpret_cast<uintptr_t>(q_row) % 16 == 0;
#pragma unroll
    for (int w = 0; w < KB; ++w) {
      const T* at = q_row + w * BK + c * KC;
      if (q_real && pieces) {
#pragma unroll
        for (int x = 0; x < KC / 8; ++x) {
          const uint4 piece = *reinterpret_cast<const uint4*>(at + 8 * x);
          q_bits[w][4 * x] = piece.x, q_bits[w][4 * x + 1] = piece.y;
          q_bits[w][4 * x + 2] = piece.z, q_bits[w][4 * x + 3] = piece.w;
        }
      } else {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(at);
#pragma unroll
        for (int e = 0; e < KC; e += 2) {
          q_bits[w][e / 2] = q_real ? values[e * p.q_strides[3]] |
                                          uint32_t(values[(e + 1) * p.q_strides[3]]) << 16
                                    : 0u;
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int at = begin + warp * kMmaStep + s * kWarpStep;
    if (at < end) {
      stage_in<BITS, D, GS>(stages + s * Stage::kBytes, codes, row_bytes, scale_rows, at, begin,
                            end, lane);
    }
    copy_async_commit();  // one group per sub-step, empty or not: wait counts groups
  }
  if (threadIdx.x == 0) {
    trace_stamp(kTraceCopiesIssued);
    trace_stamp_after(kTraceQueriesLoaded, q_bits[0][0]);
  }

  int visible_end;  // positions before it are visible to every real vector of the tile
  float q_sum[NG] = {};
  uint32_t qb[kSteps][2];
  float score_mul;  // of vector g (its queries' power-of-two scale q_mul is its own)
  {
    float q_raw[KB][KC];
    float q_max = 0.0f;
#pragma unroll
    for (int w = 0; w < KB; ++w) {
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        q_raw[w][e] = unpack<T>(q_bits[w], e);
        q_max = fmaxf(q_max, fabsf(q_raw[w][e]));
      }
    }
    q_max = fmaxf(q_max, __shfl_xor_sync(0xffffffffu, q_max, 1));
    q_max = fmaxf(q_max, __shfl_xor_sync(0xffffffffu, q_max, 2));
    q_max *= kEvenSlotMul;
    const float q_mul = q_max < 32768.0f ? 1.0f : exp2f(-ceilf(log2f(q_max / 16384.0f)));
    score_mul = p.scale * kLog2e / q_mul * float(1 << kCodeExp);  // scores in log2 units
#pragma unroll
    for (int w = 0; w < KB; ++w) {
#pragma unroll
      for (int s = 0; s < KSB; ++s) {
        float x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          x[j] = round_half(q_raw[w][k_dim<BITS>(s, j)] * q_mul);
          q_sum[w * BK / GS] += x[j];
          if (j < 2) x[j] *= kEvenSlotMul;  // (exact) slots facing `lo` of k_pair
        }
        qb[w * KSB + s][0] = half2_bits(x[0], x[1]);
        qb[w * KSB + s][1] = half2_bits(x[2], x[3]);
      }
    }
    int visible = q_real ? visible_keys(range, L, q_i, p.causal).last + 1 : S;
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) {
      visible = min(visible, __shfl_sync(0xffffffffu, visible, lane ^ offset));
    }
    visible_end = min(end, visible);
  }
  if (threadIdx.x == 0) trace_stamp(kTraceQueries);
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    q_sum[G] += __shfl_xor_sync(0xffffffffu, q_sum[G], 1);
    q_sum[G] += __shfl_xor_sync(0xffffffffu, q_sum[G], 2);
  }
  // This lane's score columns: vectors 2c and 2c + 1 (their sums and score scales live on lanes
  // 8c, 8c + 4).
  float qs[2][NG], col_score_mul[2];
  int last[2];
  int64_t mask_base[2];
#pragma unroll
  for (int v = 0; v < 2; ++v) {
#pragma unroll
    for (int G = 0; G < NG; ++G) {  // in the score mmas' scale
      qs[v][G] = __shfl_sync(0xffffffffu, q_sum[G], 8 * c + 4 * v) / float(1 << kCodeExp);
    }
    col_score_mul[v] = __shfl_sync(0xffffffffu, score_mul, 8 * c + 4 * v);
    const int r = tile * kMmaVectors + 2 * c + v;
    const bool real = r < vectors;
    const int row = kv_row * p.group + (real ? r : 0) / L, i = (real ? r : 0) % L;
    last[v] = real ? visible_keys(range, L, i, p.causal).last : -1;
    mask_base[v] = p.mask_offset(row, i);
  }

  // o[t]: O^T tile t (rows: dims v_dim(t, g, 0 / 1), columns: vectors 2c, 2c + 1); m, l,
  // v_bias: per vector 2c + v (l and v_bias this lane's positions' part).
  float o[kSteps][4] = {};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  float v_bias[NG][2] = {};
  // Sources of the next copy: the sub-step STAGES - 1 ahead of the warp's first.
  StageCopies<BITS, D, GS> copies(codes, row_bytes, scale_rows,
                                  begin + warp * kMmaStep + (STAGES - 1) * kWarpStep, lane);
  // ldmatrix: lane 8i + k gives row k of matrix i = piece 2x + i / 2 of V row 8 (i % 2) + k.
  const int v_lane_offset =
      Stage::kV + (8 * (lane / 8 % 2) + lane % 8) * Stage::kPitch + 16 * (lane / 16);
  if (threadIdx.x == 0) trace_stamp(kTraceWalk);
  int step = 0;
  for (int at = begin + warp * kMmaStep; at < end; at += kWarpStep, ++step) {
    const int ahead = at + (STAGES - 1) * kWarpStep;
    char* const next = stages + (step + STAGES - 1) % STAGES * Stage::kBytes;
    if (StageCopies<BITS, D, GS>::kApplies && ahead + kStagePositions <= end) {
      copies.copy(next, row_bytes, lane);
    } else if (ahead < end) {  // the chunk's last sub-step: rows clamped, scales zero-filled
      stage_in<BITS, D, GS>(next, codes, row_bytes, scale_rows, ahead, begin, end, lane);
    }
    copies.advance(row_bytes, kWarpStep);
    copy_async_commit();
    copy_async_wait<STAGES - 1>();
    __syncwarp();  // every lane's copies of this stage are visible to the warp
    const char* stage = stages + step % STAGES * Stage::kBytes;
    // K rows g and g + 8 (the A operand's rows), the scales and biases of those positions.
    uint32_t kw[2][KB][KWORDS], ks[2][1 + (SBYTES - 1) / 4], kb[2][1 + (SBYTES - 1) / 4];
    uint32_t vs[2][1 + (SBYTES - 1) / 4], vb[2][1 + (SBYTES - 1) / 4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const char* k_row = stage + (8 * n + g) * Stage::kPitch;
#pragma unroll
      for (int w = 0; w < KB; ++w) {
        shared_piece<KBYTES>(kw[n][w], k_row + (w * BK + c * KC) * BITS / 8);
      }
      const int pos = (8 * n + g) * SBYTES;
      shared_piece<SBYTES>(ks[n], stage + Stage::kScales + pos);
      shared_piece<SBYTES>(kb[n], stage + Stage::kScales + Stage::kScaleBytes + pos);
      shared_piece<SBYTES>(vs[n], stage + Stage::kScales + 2 * Stage::kScaleBytes + pos);
      shared_piece<SBYTES>(vb[n], stage + Stage::kScales + 3 * Stage::kScaleBytes + pos);
    }
    // V: vr[x][h] = piece x of positions 8h + 2c, 8h + 2c + 1 (dims as ldmatrix.trans gives).
    uint32_t vr[VPIECES][2];
#pragma unroll
    for (int x = 0; x < VPIECES / 2; ++x) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, stage + v_lane_offset + 32 * x);
      vr[2 * x][0] = r[0], vr[2 * x][1] = r[1], vr[2 * x + 1][0] = r[2], vr[2 * x + 1][1] = r[3];
    }
    __syncwarp();  // the stage is free for the copies of sub-step step + STAGES

    // Scores S^T: per group, its k-steps into one tile (rows: positions g, g + 8; columns:
    // vectors 2c, 2c + 1), then scale and bias in float32.
    float sc[2][2] = {};  // [position half][vector]
#pragma unroll
    for (int G = 0; G < NG; ++G) {
      float acc[4] = {};
#pragma unroll
      for (int st = G * GS / 16; st < (G + 1) * GS / 16; ++st) {
        uint32_t a[4];
        k_pair<BITS>(kw[0][st / KSB], st % KSB, a[0], a[2]);
        k_pair<BITS>(kw[1][st / KSB], st % KSB, a[1], a[3]);
        mma16816<__half>(acc, a, qb[st][0], qb[st][1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float s = unpack<T>(ks[h], G), b = unpack<T>(kb[h], G);
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          sc[h][v] = fmaf(s, acc[2 * h + v], fmaf(b, qs[v][G], sc[h][v]));
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < 2; ++v) sc[h][v] *= col_score_mul[v];
    }
    // (uniform) positions before the range's start or past the end, or masked
    if (p.mask || at < range.start || at + kMmaStep > visible_end) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = at + 8 * h + g;
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          if (j < range.start || j >= end || j > last[v]) {
            sc[h][v] = kNegInf;
          } else if (p.mask) {
            sc[h][v] = apply_mask(p, mask_base[v] + int64_t{j} * p.m_strides[3], sc[h][v], kLog2e);
          }
        }
      }
    }
    // The max of each vector over the 16 positions: lanes with the same c.
    float factor[2], shift[2];
    bool grew = false;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float tile_max = fmaxf(sc[0][v], sc[1][v]);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float new_max = fmaxf(m[v], tile_max);
      shift[v] = new_max == kNegInf ? 0.0f : new_max;  // an all-masked prefix keeps m = -inf
      factor[v] = exp2_approx(m[v] - shift[v]);
      grew = grew || new_max > m[v];  // (else the factor is 1, or the state still all zeros)
      m[v] = new_max;
    }
    if (warp_any(grew)) {  // some vector's max grew
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        l[v] *= factor[v];
#pragma unroll
        for (int G = 0; G < NG; ++G) v_bias[G][v] *= factor[v];
      }
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        o[t][0] *= factor[0];
        o[t][1] *= factor[1];
        o[t][2] *= factor[0];
        o[t][3] *= factor[1];
      }
    }
    float w[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        w[h][v] = exp2_approx(sc[h][v] - shift[v]);
        l[v] += w[h][v];
      }
    }
    // P^T's B operand per group: the weights times the positions' value scales, as f16 pairs
    // (vectors 2c, 2c + 1 of position g + 8h), transposed to (positions 2c, 2c + 1 (+ 8h) of
    // vector g).
    uint32_t pb[NG][2];
#pragma unroll
    for (int G = 0; G < NG; ++G) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float s = unpack<T>(vs[h], G), b = unpack<T>(vb[h], G);
        pb[G][h] = transpose8x8(half2_bits(w[h][0] * s, w[h][1] * s));
#pragma unroll
        for (int v = 0; v < 2; ++v) v_bias[G][v] = fmaf(w[h][v], b, v_bias[G][v]);
      }
    }
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int G = v_dim<BITS>(t, 0, 0) / GS;
      uint32_t a[4];
      if constexpr (BITS == 8) {
        // bytes 0, 2 (dim 2g) and 1, 3 (dim 2g + 1) of positions 2c, 2c + 1 (+ 8)
        a[0] = byte_pair(vr[t][0], 0x0200);
        a[1] = byte_pair(vr[t][0], 0x0301);
        a[2] = byte_pair(vr[t][1], 0x0200);
        a[3] = byte_pair(vr[t][1], 0x0301);
      } else {
        // nibbles 2 (t % 2) and 2 (t % 2) + 1 of each position's half: dims 4g + 2 (t % 2), + 1
        // (rows g + 8 of the tile: odd nibbles)
        a[0] = nibble_pair(vr[t / 2][0], 2 * (t % 2));
        a[1] = nibble_pair(vr[t / 2][0], 2 * (t % 2) + 1);
        a[2] = nibble_pair(vr[t / 2][1], 2 * (t % 2));
        a[3] = nibble_pair(vr[t / 2][1], 2 * (t % 2) + 1);
      }
      mma16816<__half>(o[t], a, pb[G][0], pb[G][1]);
    }
  }
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      l[v] += __shfl_xor_sync(0xffffffffu, l[v], offset);
#pragma unroll
      for (int G = 0; G < NG; ++G) {
        v_bias[G][v] += __shfl_xor_sync(0xffffffffu, v_bias[G][v], offset);
      }
    }
  }

  if (lane == 0) trace_stamp(kTraceWalkEnd + warp);
  // finish()'s states: [warp][vector][max, denominator, 2 unused, D accumulators].
  copy_async_wait<0>();  // (every group left is empty: nothing is copied past the chunk)
  __syncthreads();       // the states reuse other warps' stages
  const int stride = partial_stride(D);
  float* states = smem + warp * kMmaVectors * stride;
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    float* state = states + (2 * c + v) * stride;
    if (g == 0) {
      state[0] = m[v] * (1.0f / kLog2e);  // finish() merges in natural-log units
      state[1] = l[v];
    }
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int G = v_dim<BITS>(t, 0, 0) / GS;
      state[4 + v_dim<BITS>(t, g, 0)] = fmaf(o[t][v], float(1 << 24), v_bias[G][v]);
      state[4 + v_dim<BITS>(t, g, 1)] = fmaf(o[t][2 + v], float(1 << kCodeExp), v_bias[G][v]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) trace_stamp(kTraceFinish);
  finish<T, kMmaVectors, false, mmat_smem_bytes<BITS, D, GS, STAGES>() / 4>(
      p, smem, partials, kv_row, tile, split, splits, slot);
  if (threadIdx.x == 0) trace_stamp(kTraceExit);
}

}  // namespace attn_kernels::cuda::quantized
