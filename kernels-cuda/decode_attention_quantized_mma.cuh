// The tensor-core variant of DecodeAttentionQuantized ("mma"): the schedule of decode_attention.cu's
// split-mma (one block per key/value row, tile of 8 query vectors and context chunk; 4 warps of 16
// positions per step; S = Q K^T and O^T += V^T P^T as mma.sync m16n8k16 with float32
// accumulators), with codes as operands. A code c becomes the f16 c with two instructions:
// prmt puts a byte beside 0x64 (or lop3 masks a nibble into 0x6400), giving 1024 + c (0x6400 is
// 1024 and c < 1024 fills the mantissa), and sub.f16x2 takes the 1024 off exactly. Scales and
// biases apply per quantization group in float32:
//     scores:  q . (s * c + b) = s * (q . c) + b * sum(q)
// so each group's k-steps accumulate into their own mma tile before s and b apply; and
//     values:  sum_j w_j (s_j * c_j + b_j) = sum_j (w_j s_j) c_j + sum_j w_j b_j
// where P's operand carries w_j * s_j (rounded to f16) of the tile's group, and the second sum
// is a float32 running term per vector and group. f16 operands whatever the queries' dtype: codes
// are exact in f16 (8-bit codes are not exact as bf16 1024 + c), and bf16 queries fit f16 (scaled
// down by a power of two first if any |q| >= 2^15). Folding the 1024 into the group terms instead
// saves the subtraction but cancels 1024 * sum(...) against the signal inside the tensor cores'
// float32 accumulation (about 7 bits lost at 4 bits); the folded version, run once on the H200
// (f6e6a5d), failed test_no_worse_than_mlx_lm in all 12 of its 4-bit group-128 cases (cause not
// isolated; the cancellation is the suspect; docs/quantized-kv.md).
//
// Which dims a lane holds is free as long as Q and K agree (and V^T's rows land where the output
// wants them); it is chosen so that every mma tile lies in one quantization group and every load
// is one 2-16 byte piece of a row:
//   K: blocks of BK = min(GS, 64) dims; lane c holds BK / 4 contiguous dims of each block. A word
//      of 8-bit codes is one k-step (b0 = codes 0, 1; b1 = codes 2, 3); a word of 4-bit codes is
//      two (b0 = nibbles 2h, 2h + 4; b1 = 2h + 1, 2h + 5 for h = 0, 1); Q's A operand follows.
//   V: blocks of BV = min(GS, 128) dims; lane g holds BV / 8 contiguous dims of each block; V^T
//      tile u of a block takes the lane's dims 2u (row g) and 2u + 1 (row g + 8).
// Needs f16/bf16 queries, D of 64, 128 or 256, codes rows in aligned 16-byte pieces and scale rows
// contiguous; plan_quantized() runs the SIMT kernel otherwise.
#pragma once

#include <cstring>
#include <type_traits>

#include "decode_attention_quantized_kernel.cuh"
#include "decode_attention_quantized_stages.cuh"
#include "mma_m16n8k16.cuh"

namespace attn_kernels::cuda::quantized {

constexpr int kMmaStep = 16;    // positions per warp and sub-step: the K of the P V mma
constexpr uint32_t kHalf1024x2 = 0x64006400u;
static_assert(kStagePositions == kMmaStep, "a stage holds one sub-step");

// Shared memory of the pipelined kernel (STAGES > 0): the warps' stages, which finish()'s states
// reuse (written after a block barrier, when no stage is read any more).
template <int BITS, int D, int GS>
__host__ __device__ constexpr int pipelined_smem_bytes() {
  using S = StageLayout<BITS, D, GS>;
  const int stages = kWarps * S::kStages * S::kBytes;
  const int states = states_smem_bytes(kMmaVectors, D);
  return stages > states ? stages : states;
}

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

// (1024 + a, 1024 + b) - (1024, 1024) = (a, b), exactly (f16 subtraction of integers < 2048).
__device__ __forceinline__ uint32_t minus_1024(uint32_t pair) {
#if defined(__CUDACC__)
  uint32_t out;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(out) : "r"(pair), "r"(kHalf1024x2));
  return out;
#else
  const auto half = [](uint32_t w, int i) {
    return std::bit_cast<_Float16>(uint16_t(w >> (16 * i)));
  };
  const _Float16 k1024 = static_cast<_Float16>(1024.0f);
  return uint32_t(std::bit_cast<uint16_t>(static_cast<_Float16>(half(pair, 0) - k1024))) |
         uint32_t(std::bit_cast<uint16_t>(static_cast<_Float16>(half(pair, 1) - k1024))) << 16;
#endif
}

__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t selector) {
  return __byte_perm(x, y, selector);
}

// N bytes (2, 4, 8, 16 or 32) from an address aligned to min(N, 16), as words (a 2-byte piece
// in the low half of word 0).
template <int N>
__device__ __forceinline__ void load_piece(uint32_t* w, const void* src) {
  if constexpr (N >= 16) {
#pragma unroll
    for (int x = 0; x < N / 16; ++x) {
      const uint4 u = __ldg(static_cast<const uint4*>(src) + x);
      w[4 * x] = u.x, w[4 * x + 1] = u.y, w[4 * x + 2] = u.z, w[4 * x + 3] = u.w;
    }
  } else if constexpr (N == 8) {
    const uint2 u = __ldg(static_cast<const uint2*>(src));
    w[0] = u.x, w[1] = u.y;
  } else if constexpr (N == 4) {
    w[0] = __ldg(static_cast<const uint32_t*>(src));
  } else {
    w[0] = __ldg(static_cast<const uint16_t*>(src));
  }
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

// Element e of packed 16-bit values set to *src.
template <typename T, int N>
__device__ __forceinline__ void set_half(uint32_t (&w)[N], int e, const T* src) {
  uint16_t bits;
  memcpy(&bits, src, 2);
  w[e / 2] = e % 2 ? (w[e / 2] & 0x0000ffffu) | uint32_t(bits) << 16
                   : (w[e / 2] & 0xffff0000u) | bits;
}

// K codes of one k-step as the B operand (f16 c): step s of a lane's block words.
template <int BITS>
__device__ __forceinline__ void k_operand(const uint32_t* w, int s, uint32_t& b0, uint32_t& b1) {
  if constexpr (BITS == 8) {
    b0 = minus_1024(prmt(w[s], kHalf1024x2, 0x5150));  // codes 4s, 4s + 1
    b1 = minus_1024(prmt(w[s], kHalf1024x2, 0x5352));  // codes 4s + 2, 4s + 3
  } else {
    const uint32_t x = w[s / 2] >> (8 * (s % 2));
    b0 = minus_1024((x & 0x000f000fu) | kHalf1024x2);         // nibbles 2h, 2h + 4
    b1 = minus_1024(((x >> 4) & 0x000f000fu) | kHalf1024x2);  // nibbles 2h + 1, 2h + 5
  }
}

// The dim (within the lane's block piece) that k-step s's slot j (b0 low, b0 high, b1 low, b1
// high) stands for: what Q's A operand must follow.
template <int BITS>
__host__ __device__ constexpr int k_dim(int s, int j) {
  return BITS == 8 ? 4 * s + j : 8 * (s / 2) + 2 * (s % 2) + (j >> 1) + 4 * (j & 1);
}

// Code e of two V rows' pieces x and y as the f16 pair (x_e, y_e).
template <int BITS>
__device__ __forceinline__ uint32_t v_pair(const uint32_t* x, const uint32_t* y, int e) {
  if constexpr (BITS == 8) {
    const uint32_t b = e % 4;
    const uint32_t t = prmt(x[e / 4], y[e / 4], b | b << 4 | (4 + b) << 8 | (4 + b) << 12);
    return minus_1024((t & 0x00ff00ffu) | kHalf1024x2);
  } else {
    const int i = e % 8;
    const uint32_t t = prmt(x[e / 8], y[e / 8], i < 4 ? 0x5410 : 0x7632);
    return minus_1024(((t >> (4 * (i % 4))) & 0x000f000fu) | kHalf1024x2);
  }
}

// grid (kv_rows * tiles of 8 vectors, splits), kMmaWarps * 32 threads; shared memory:
// kWarps * kMmaVectors states. U: sub-steps of 16 positions a warp loads before it computes.
// STAGES > 0 ("mmacp", U = 1): the operands come from the warp's cp.async pipeline of that many
// stages (decode_attention_quantized_stages.cuh; shared memory: pipelined_smem_bytes()).
template <typename T, int BITS, int D, int GS, int U, int STAGES = 0>
__global__ void __launch_bounds__(kThreads, 2)
    attend_quantized_mma(QuantizedProblem p, float* partials, int chunk, unsigned slot) {
  static_assert(STAGES == 0 || (U == 1 && STAGES >= 2), "a pipeline takes one sub-step a step");
  ATTN_SHARED_FLOATS(smem);
  constexpr int NG = D / GS;                  // groups per row
  constexpr int BK = GS < 64 ? GS : 64;       // K block
  constexpr int KB = D / BK, KC = BK / 4;     // K blocks; a lane's dims of each
  constexpr int KSB = BK / 16;                // k-steps per block
  constexpr int KBYTES = KC * BITS / 8, KWORDS = KBYTES / 4;
  constexpr int BV = GS < 128 ? GS : 128;     // V block
  constexpr int VB = D / BV, VC = BV / 8;     // V blocks; a lane's dims of each
  constexpr int VTB = BV / 16;                // V^T tiles per block
  constexpr int VBYTES = VC * BITS / 8, VWORDS = (VBYTES + 3) / 4;
  constexpr int kSteps = D / 16;
  constexpr int SBYTES = 2 * NG * 2;          // scales (or biases) of two positions
  constexpr int SWORDS = NG;
  static_assert(kThreads == 4 * 32 && kWarps == 4, "the schedule takes 4 warps");
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
  const int L = p.query_len, S = p.context, vectors = p.group * L;
  const int tiles = (vectors + kMmaVectors - 1) / kMmaVectors;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  const int begin = split * chunk, end = min(S, begin + chunk);

  const char* k_codes = reinterpret_cast<const char*>(p.k_codes + p.kv_offset(p.k_strides[0], kv_row));
  const char* v_codes = reinterpret_cast<const char*>(p.v_codes + p.kv_offset(p.v_strides[0], kv_row));
  const T* k_scales = static_cast<const T*>(p.k_scales) + p.kv_offset(p.k_strides[1], kv_row);
  const T* k_biases = static_cast<const T*>(p.k_biases) + p.kv_offset(p.k_strides[2], kv_row);
  const T* v_scales = static_cast<const T*>(p.v_scales) + p.kv_offset(p.v_strides[1], kv_row);
  const T* v_biases = static_cast<const T*>(p.v_biases) + p.kv_offset(p.v_strides[2], kv_row);
  const int64_t k_row_bytes = p.k_strides[0][2] * 4, v_row_bytes = p.v_strides[0][2] * 4;

  // Lanes 4g..4g+3 own query vector g of the tile (the row of the score mma's A and C).
  const int r = tile * kMmaVectors + g;
  const bool real = r < vectors;
  const int row = kv_row * p.group + (real ? r : 0) / L, i = (real ? r : 0) % L;
  const int last = real ? (p.causal ? S - L + i : S - 1) : -1;
  const int64_t mask_base = p.mask_offset(row, i);
  const T* q_row = static_cast<const T*>(p.queries) + p.q_offset(row, i);
  auto q_at = [&](int d) { return real ? to_float(q_row[d * p.q_strides[3]]) : 0.0f; };
  // A power of two that keeps the vector inside f16's range (1 but for huge queries).
  float q_max = 0.0f;
#pragma unroll
  for (int w = 0; w < KB; ++w) {
#pragma unroll
    for (int e = 0; e < KC; ++e) q_max = fmaxf(q_max, fabsf(q_at(w * BK + c * KC + e)));
  }
  q_max = fmaxf(q_max, __shfl_xor_sync(0xffffffffu, q_max, 1));
  q_max = fmaxf(q_max, __shfl_xor_sync(0xffffffffu, q_max, 2));
  const float q_mul = q_max < 32768.0f ? 1.0f : exp2f(-ceilf(log2f(q_max / 16384.0f)));
  const float score_mul = p.scale / q_mul;
  uint32_t qa[kSteps][2];  // A's a0 and a2 of each k-step (a1, a3: rows 8..15, unused)
  float q_sum[NG] = {};    // of the f16 values the mma sees
#pragma unroll
  for (int w = 0; w < KB; ++w) {
#pragma unroll
    for (int s = 0; s < KSB; ++s) {
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[j] = round_half(q_at(w * BK + c * KC + k_dim<BITS>(s, j)) * q_mul);
        q_sum[w * BK / GS] += x[j];
      }
      qa[w * KSB + s][0] = half2_bits(x[0], x[1]);
      qa[w * KSB + s][1] = half2_bits(x[2], x[3]);
    }
  }
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    q_sum[G] += __shfl_xor_sync(0xffffffffu, q_sum[G], 1);
    q_sum[G] += __shfl_xor_sync(0xffffffffu, q_sum[G], 2);
  }

  // o[t]: O^T tile t (rows: the lane's V dims of the tile, columns: vectors 2c, 2c + 1).
  // m: vector g's running max; l, v_bias[G]: this lane's parts of its denominator and of
  // sum_j w_j b_j over group G.
  float o[kSteps][4] = {};
  float m = kNegInf, l = 0.0f;
  float v_bias[NG] = {};
  constexpr int kWarpStep = kWarps * U * kMmaStep;  // positions between a warp's steps
  // The pipeline (STAGES > 0): the warp's stage s of its sub-step i is i % STAGES.
  using Stage = StageLayout<BITS, D, GS>;
  char* const stages = reinterpret_cast<char*>(smem) + warp * STAGES * Stage::kBytes;
  const char* const codes[2] = {k_codes, v_codes};
  const int64_t row_bytes[2] = {k_row_bytes, v_row_bytes};
  const char* const scale_rows[4] = {
      reinterpret_cast<const char*>(k_scales), reinterpret_cast<const char*>(k_biases),
      reinterpret_cast<const char*>(v_scales), reinterpret_cast<const char*>(v_biases)};
  if constexpr (STAGES > 0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      const int at = begin + warp * kMmaStep + s * kWarpStep;
      if (at < end) {
        stage_in<BITS, D, GS>(stages + s * Stage::kBytes, codes, row_bytes, scale_rows, at, begin,
                              end, lane);
      }
      copy_async_commit();  // one group per sub-step, empty or not: wait counts groups
    }
  }
  int step = 0;  // the warp's sub-step (STAGES > 0)
  for (int base = begin + warp * U * kMmaStep; base < end; base += kWarpStep, ++step) {
    // All loads of the U sub-steps first: K rows base + 8n + g, V rows base + 2c + (x & 1) +
    // 8 (x >> 1), the scales and biases of positions base + 8n + 2c, + 1 (the lane's scores).
    uint32_t kw[U][2][KB][KWORDS], vw[U][4][VB][VWORDS];
    uint32_t ks[U][2][SWORDS], kb[U][2][SWORDS], vs[U][2][SWORDS], vb[U][2][SWORDS];
    if constexpr (STAGES > 0) {
      // Sub-step step + STAGES - 1 into the stage that step - 1 used (read by every lane before
      // the __syncwarp that ended it), then wait for this sub-step's group.
      const int ahead = base + (STAGES - 1) * kWarpStep;
      if (ahead < end) {
        stage_in<BITS, D, GS>(stages + (step + STAGES - 1) % STAGES * Stage::kBytes, codes,
                              row_bytes, scale_rows, ahead, begin, end, lane);
      }
      copy_async_commit();
      copy_async_wait<STAGES - 1>();
      __syncwarp();  // every lane's copies of this stage are visible to the warp
      const char* stage = stages + step % STAGES * Stage::kBytes;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const char* k_row = stage + (8 * n + g) * Stage::kPitch;
#pragma unroll
        for (int w = 0; w < KB; ++w) {
          shared_piece<KBYTES>(kw[0][n][w], k_row + (w * BK + c * KC) * BITS / 8);
        }
        const int pair = (8 * n + 2 * c) * NG * 2;  // bytes into each scale array
        shared_piece<SBYTES>(ks[0][n], stage + Stage::kScales + pair);
        shared_piece<SBYTES>(kb[0][n], stage + Stage::kScales + Stage::kScaleBytes + pair);
        shared_piece<SBYTES>(vs[0][n], stage + Stage::kScales + 2 * Stage::kScaleBytes + pair);
        shared_piece<SBYTES>(vb[0][n], stage + Stage::kScales + 3 * Stage::kScaleBytes + pair);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const char* v_row = stage + Stage::kV + (2 * c + (x & 1) + 8 * (x >> 1)) * Stage::kPitch;
#pragma unroll
        for (int b = 0; b < VB; ++b) {
          shared_piece<VBYTES>(vw[0][x][b], v_row + (b * BV + g * VC) * BITS / 8);
        }
      }
      __syncwarp();  // the stage is free for the copies of sub-step step + STAGES
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int at = base + u * kMmaStep;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const char* k_row = k_codes + min(at + 8 * n + g, end - 1) * k_row_bytes;
#pragma unroll
          for (int w = 0; w < KB; ++w) {
            load_piece<KBYTES>(kw[u][n][w], k_row + (w * BK + c * KC) * BITS / 8);
          }
          const int pair = at + 8 * n + 2 * c;
          if (pair + 1 < end) {
            load_piece<SBYTES>(ks[u][n], k_scales + int64_t{pair} * NG);
            load_piece<SBYTES>(kb[u][n], k_biases + int64_t{pair} * NG);
            load_piece<SBYTES>(vs[u][n], v_scales + int64_t{pair} * NG);
            load_piece<SBYTES>(vb[u][n], v_biases + int64_t{pair} * NG);
          } else {  // the chunk's last position (its pair's other half is masked out)
#pragma unroll
            for (int e = 0; e < 2 * NG; ++e) {
              const int64_t at_e = int64_t{min(pair + e / NG, end - 1)} * NG + e % NG;
              set_half(ks[u][n], e, k_scales + at_e);
              set_half(kb[u][n], e, k_biases + at_e);
              set_half(vs[u][n], e, v_scales + at_e);
              set_half(vb[u][n], e, v_biases + at_e);
            }
          }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const char* v_row =
              v_codes + min(at + 2 * c + (x & 1) + 8 * (x >> 1), end - 1) * v_row_bytes;
#pragma unroll
          for (int b = 0; b < VB; ++b) {
            load_piece<VBYTES>(vw[u][x][b], v_row + (b * BV + g * VC) * BITS / 8);
          }
        }
      }
    }

#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int at = base + u * kMmaStep;
      // Scores: per group, its k-steps into one tile, then scale and bias in float32.
      float score[2][2] = {};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int G = 0; G < NG; ++G) {
          float acc[4] = {};
#pragma unroll
          for (int st = G * GS / 16; st < (G + 1) * GS / 16; ++st) {
            uint32_t b0, b1;
            k_operand<BITS>(kw[u][n][st / KSB], st % KSB, b0, b1);
            const uint32_t a[4] = {qa[st][0], 0u, qa[st][1], 0u};
            mma16816<__half>(acc, a, b0, b1);
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // position at + 8n + 2c + e: element e * NG + G
            const float s = unpack<T>(ks[u][n], e * NG + G);
            const float b = unpack<T>(kb[u][n], e * NG + G);
            score[n][e] = fmaf(s, acc[e], fmaf(b, q_sum[G], score[n][e]));
          }
        }
      }
      float tile_max = kNegInf;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = at + 8 * n + 2 * c + e;
          float sc = score[n][e] * score_mul;
          if (j >= end || j > last) {
            sc = kNegInf;
          } else if (p.mask) {
            sc += mask_value(p, mask_base + int64_t{j} * p.m_strides[3]);
          }
          score[n][e] = sc;
          tile_max = fmaxf(tile_max, sc);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // One rescale factor per vector and sub-step; an all-masked prefix keeps m = -inf.
      const float new_max = fmaxf(m, tile_max);
      const float shift = new_max == kNegInf ? 0.0f : new_max;
      const float old_factor = __expf(m - shift);
      m = new_max;
      l *= old_factor;
      float w[2][2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          w[n][e] = __expf(score[n][e] - shift);
          l += w[n][e];
        }
      }
      // P^T's B operand per group: positions 2c, 2c + 1 (b0) and 8 + 2c, 9 + 2c (b1) of vector
      // g, weighted by the positions' value scales of the group.
      uint32_t pb[NG][2];
#pragma unroll
      for (int G = 0; G < NG; ++G) {
        v_bias[G] *= old_factor;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          float ws[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            ws[e] = round_half(w[n][e] * unpack<T>(vs[u][n], e * NG + G));
            v_bias[G] = fmaf(w[n][e], unpack<T>(vb[u][n], e * NG + G), v_bias[G]);
          }
          pb[G][n] = half2_bits(ws[0], ws[1]);
        }
      }
      // O^T's columns are vectors 2c and 2c + 1, whose factors live on lanes 8c and 8c + 4.
      const float f0 = __shfl_sync(0xffffffffu, old_factor, 8 * c);
      const float f1 = __shfl_sync(0xffffffffu, old_factor, 8 * c + 4);
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int b = t / VTB, e = 2 * (t % VTB), G = b * BV / GS;
        o[t][0] *= f0;
        o[t][1] *= f1;
        o[t][2] *= f0;
        o[t][3] *= f1;
        // A = V^T: row g = the lane's dim e of block b, row g + 8 = dim e + 1; k = 2c, 2c + 1
        // from V rows x = 0, 1 and k = 2c + 8, 2c + 9 from x = 2, 3.
        const uint32_t a[4] = {v_pair<BITS>(vw[u][0][b], vw[u][1][b], e),
                               v_pair<BITS>(vw[u][0][b], vw[u][1][b], e + 1),
                               v_pair<BITS>(vw[u][2][b], vw[u][3][b], e),
                               v_pair<BITS>(vw[u][2][b], vw[u][3][b], e + 1)};
        mma16816<__half>(o[t], a, pb[G][0], pb[G][1]);
      }
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    v_bias[G] += __shfl_xor_sync(0xffffffffu, v_bias[G], 1);
    v_bias[G] += __shfl_xor_sync(0xffffffffu, v_bias[G], 2);
  }

  // finish()'s states: [warp][vector][max, denominator, 2 unused, D accumulators].
  if constexpr (STAGES > 0) {
    copy_async_wait<0>();  // (every group left is empty: nothing is copied past the chunk)
    __syncthreads();       // the states reuse other warps' stages
  }
  const int stride = partial_stride(D);
  float* states = smem + warp * kMmaVectors * stride;
  if (c == 0) {
    states[g * stride] = m;
    states[g * stride + 1] = l;
  }
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    const float bias0 = __shfl_sync(0xffffffffu, v_bias[G], 8 * c);
    const float bias1 = __shfl_sync(0xffffffffu, v_bias[G], 8 * c + 4);
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int b = t / VTB, d = b * BV + g * VC + 2 * (t % VTB);
      if (b * BV / GS != G) continue;
      float* v0 = states + 2 * c * stride + 4 + d;
      float* v1 = states + (2 * c + 1) * stride + 4 + d;
      v0[0] = o[t][0] + bias0;
      v1[0] = o[t][1] + bias1;
      v0[1] = o[t][2] + bias0;
      v1[1] = o[t][3] + bias1;
    }
  }
  __syncthreads();
  finish<T, kMmaVectors, false>(p, smem, partials, kv_row, tile, split, splits, slot);
}

}  // namespace attn_kernels::cuda::quantized
