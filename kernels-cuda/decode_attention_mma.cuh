// DecodeAttention's tensor-core kernel (split-mma, attend_mma) and its AttentionStep variant
// (attend_mma_step: the step's q/k RMSNorm + RoPE and cache writes folded in). Included by
// decode_attention.cu for nvcc and by emulation/run_attention_step.cpp, which runs it on the CPU
// under emulation/cuda_emu.h (mma.sync emulated with shuffles there).
#pragma once

#include <cstring>
#include <type_traits>

#include "attention_step_kernel.cuh"
#include "decode_attention_common.cuh"
#include "mma_m16n8k16.cuh"

namespace attn_kernels::cuda {
namespace {

// ---- split-mma: the tensor-core schedule ----
// Per block: one key/value head, a tile of up to 8 of its query vectors, one context chunk;
// 4 warps, each taking 16 positions per step. Scores S = Q K^T and the update O^T += V^T P^T run
// as mma.sync m16n8k16 (bf16/f16 in, float32 accumulate), so a position costs about 14 warp
// instructions instead of ~80 on the SIMT path: the kernel is left waiting on memory only.
// Fragments are read straight from global memory with 16-byte loads: the dot product and the
// sum over positions do not care in which order they run, so each lane takes contiguous slices
// (D/4 values of a K row and of its query, D/8 values of four V rows) and the k and row indices
// of the mma are mapped onto them (see the comments at each use). A, B, C layouts: PTX ISA,
// "Matrix fragments for mma.m16n8k16".
constexpr int kMmaWarps = 4;
// Blocks an SM must hold at once (the register budget): past D = 128 two, so that a lane keeps
// its D/4 values of Q and two K rows and its O^T tiles in registers.
__host__ __device__ constexpr int mma_blocks_per_sm(int D) {
  return D > 128 ? 2 : ATTN_MMA_BLOCKS_PER_SM;
}
constexpr int kMmaStep = 16;  // positions per warp step: the K of the P V mma

using tensor_core::mma16816;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
#if defined(__CUDACC__)
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
#else
  T x, y;
  store(&x, lo);
  store(&y, hi);
  return uint32_t(std::bit_cast<uint16_t>(x)) | uint32_t(std::bit_cast<uint16_t>(y)) << 16;
#endif
}

// Loads N 32-bit words as N / 4 16-byte loads from a 16-byte-aligned address, PITCH 16-byte
// units apart.
template <int PITCH = 1, int N>
__device__ __forceinline__ void load_words(uint32_t (&dst)[N], const void* src) {
  const uint4* v = static_cast<const uint4*>(src);
#pragma unroll
  for (int x = 0; x < N / 4; ++x) {
    const uint4 u = v[x * PITCH];
    dst[4 * x] = u.x;
    dst[4 * x + 1] = u.y;
    dst[4 * x + 2] = u.z;
    dst[4 * x + 3] = u.w;
  }
}

// Loads N 32-bit words from consecutive addresses, BYTES at a time (the address BYTES-aligned).
template <int BYTES, int N>
__device__ __forceinline__ void load_run(uint32_t (&dst)[N], const void* src) {
  if constexpr (BYTES == 16) {
    load_words<1>(dst, src);
  } else if constexpr (BYTES == 8) {
    const uint2* v = static_cast<const uint2*>(src);
#pragma unroll
    for (int x = 0; x < N / 2; ++x) {
      const uint2 u = v[x];
      dst[2 * x] = u.x;
      dst[2 * x + 1] = u.y;
    }
  } else {
    const uint32_t* v = static_cast<const uint32_t*>(src);
#pragma unroll
    for (int x = 0; x < N; ++x) dst[x] = v[x];
  }
}

// Which dims of a row a lane holds. D a multiple of 64 ("wide"): lane c holds dims 32w + 8c ..
// 32w + 8c + 7 (w < D/32) of its query and K rows, and lane g dims 64w + 8g .. + 7 (w < D/64) of
// its V rows: one 16-byte load instruction then reads whole 32-byte sectors of a row (4 lanes x
// 16 B of Q/K, 8 lanes x 16 B of V) instead of half of each of twice as many (the mma only needs
// Q and K to share a mapping; V's sets O^T's rows): 0.1-0.35 µs less per call, 1.1-1.5 at L=4/8
// S=4096 (benchmark_results/raw/h200-bench_attend-coalesced.txt). Other multiples of 16 (80, 96,
// 112): lane c holds the quarter c D/4 .. of a Q/K row and lane g the eighth g D/8 .. of a V row,
// each read with the widest loads its alignment allows (D = 96: 16-byte Q/K, 8-byte V loads;
// D = 80: 8 and 4).
template <int D>
struct MmaSlices {
  static_assert(D % 16 == 0 && D <= 256, "the mma kernel takes head dims that are multiples of 16");
  static constexpr bool kWide = D % 64 == 0;
  static constexpr int kQK = D / 8;  // words in a lane's D/4 values of a query or K row
  static constexpr int kV = D / 16;  // words in a lane's D/8 values of a V row
  __host__ __device__ static constexpr int slice_load(int bytes) {
    return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : 4;
  }

  template <typename T>
  __device__ static void load_qk(uint32_t (&dst)[kQK], const T* row, int c) {
    if constexpr (kWide) {
      load_words<4>(dst, row + c * 8);
    } else {
      load_run<slice_load(D / 2)>(dst, row + c * (D / 4));
    }
  }
  template <typename T>
  __device__ static void load_v(uint32_t (&dst)[kV], const T* row, int g) {
    if constexpr (kWide) {
      load_words<8>(dst, row + g * 8);
    } else {
      load_run<slice_load(D / 4)>(dst, row + g * (D / 8));
    }
  }
  // The dim of O^T's row g in tile t (word t of lane g's V slice); row g + 8 is the next dim.
  __device__ static int dim(int g, int t) {
    return kWide ? (t / 4) * 64 + g * 8 + 2 * (t % 4) : g * (D / 8) + 2 * t;
  }
};

// attend_mma's shared memory: finish()'s slots (attend_smem_bytes in decode_attention.cu), then,
// in attend_mma_step, the tile's query vectors as the step prepares them (kMmaVectors x D).
// attend_mma_step takes L <= kStepMaxLength: a block then has at most 16 rows to prepare, one
// round of its 8 half warps or two.
constexpr int kStepMaxLength = 8;
__host__ __device__ constexpr int mma_smem_floats(int D) {
  return kMmaWarps * kMmaVectors * partial_stride(D) + 2 * kMmaVectors;
}
template <typename T>
__host__ __device__ constexpr uint32_t mma_step_smem_bytes(int D) {
  return mma_smem_floats(D) * sizeof(float) + kMmaVectors * D * sizeof(T);
}

// AttentionStep folded into the attention (attend_mma_step): before its loop, a block prepares
// the step's rows it needs with the preprocessing's own row code (preprocess_row, so the roundings
// are step_preprocess's): its tile's query vectors into shared memory, and the new positions
// [offset, offset + L) that fall in its chunk [begin, end) into the caches, which its own loop
// then reads (after the barrier; the loads are plain ld.global, not the read-only path). No other
// block reads those positions: chunks are disjoint and every block of a (kv_row, split) reads only
// its own chunk. Blocks of other tiles with the same (kv_row, split) write the same rows: the same
// code on the same inputs, so identical bytes; whichever store lands last, every read (its own
// block's, after its barrier, or the next call's) sees those bytes. Having only tile 0 write
// would leave the other tiles nothing to read before tile 0 has run.
// This runs before the block's first K/V load, so it is kept short: a half warp per row (the 4 q
// vectors and 1 new k row of a Qwen3 decode step's last chunk in one round of the 8 half warps,
// not two rounds of 4 warps), each lane rotating its own pairs in float32 (no shared table, no
// barrier before the rows).
template <typename T, int D>
__device__ __forceinline__ void prepare_step_rows(const DecodeProblem& p, const StepProblem& s,
                                                  T* staged, int kv_row, int tile, int begin,
                                                  int end) {
  constexpr int kRowLanes = 16;
  const int lane = threadIdx.x % kRowLanes, team = threadIdx.x / kRowLanes;
  const int teams = blockDim.x / kRowLanes;
  const int L = p.query_len, first = tile * kMmaVectors;
  const int count = min(kMmaVectors, p.group * L - first);
  const int b = kv_row / p.kv_heads, h = kv_row % p.kv_heads;
  const int written = s.write_position(b);  // the row's new positions [written, written + L)
  const int from = max(begin, written), news = max(min(end, written + L) - from, 0);
  // Rounds over all teams alike, one call site: both halves of a warp join every round's
  // shuffles (the same shfl instructions).
  for (int at = 0; at < count + news; at += teams) {
    const int item = at + team;
    int i, head;
    T* q_dst = nullptr;
    if (item < count) {  // query vector first + item: row kv_row * group + r / L, token r % L
      const int r = first + item;
      i = r % L;
      head = (kv_row * p.group + r / L) % p.q_heads;
      q_dst = staged + item * D;
    } else {  // a new position of the chunk; past count + news, none (the row unused)
      i = min(from + (item - count) - written, L - 1);
      head = s.q_heads + h;
    }
    step::preprocess_row<T, kRowLanes, D>(s, b, i, head, lane, q_dst, item < count + news);
  }
  __syncthreads();
}

// The body of both kernels; kFold: attend_mma_step (`step` is its problem), else attend_mma.
// VPB: query vectors per block, 8 (the score mma's A rows 8..15 zero) or 16 (split-mma-16: rows
// 8..15 hold vectors 8..15 and O^T takes a second column tile), so that a KV head with more than
// 8 vectors (GQA 4 at L >= 3) reads each K/V position in half as many blocks, at the cost of more
// instructions per block and 2 blocks per SM (docs/cuda-kernel.md).
template <typename T, int D, int VPB, bool kFold>
__device__ __forceinline__ void attend_mma_body(const DecodeProblem& p, float* partials, int chunk,
                                                unsigned slot, const StepProblem* step) {
  static_assert(VPB == kMmaVectors || (VPB == 2 * kMmaVectors && !kFold));
  constexpr int kHalves = VPB / kMmaVectors;  // h: A rows g (h = 0) and g + 8 (h = 1)
  ATTN_SHARED_FLOATS(smem);
  using Slices = MmaSlices<D>;
  constexpr int kSteps = D / 16;  // k-steps of Q K^T; 16-dim tiles of V^T P^T
  constexpr int kQK = Slices::kQK, kV = Slices::kV;
  constexpr bool kLateV = D > 128;
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int L = p.query_len, S = p.context, vectors = p.group * L;
  const int tiles = (vectors + VPB - 1) / VPB;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  // The chunk's positions inside the batch row's range (every position without per-row ranges).
  const CacheRange range = p.range(kv_row / p.kv_heads);
  const int chunk_begin = split * chunk, chunk_end = min(S, chunk_begin + chunk);
  const int begin = max(chunk_begin, range.start), end = min(chunk_end, range.end);
  const T* K = static_cast<const T*>(p.keys) + p.kv_offset(p.k_strides, kv_row);
  const T* V = static_cast<const T*>(p.values) + p.kv_offset(p.v_strides, kv_row);

  // Lanes 4g..4g+3 own query vector g + 8h of the tile (the row of the score mma's A and C).
  bool real[kHalves];
  int last[kHalves];
  int64_t mask_base[kHalves];
  uint32_t q[kHalves][kQK] = {};  // the lane's slice of each of its queries (MmaSlices)
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const int r = tile * VPB + kMmaVectors * h + g;
    real[h] = r < vectors;
    const int row = kv_row * p.group + (real[h] ? r : 0) / L, i = (real[h] ? r : 0) % L;
    last[h] = real[h] ? visible_keys(range, L, i, p.causal).last : -1;
    mask_base[h] = p.mask_offset(row, i);
    if constexpr (!kFold) {
      if (real[h]) Slices::load_qk(q[h], static_cast<const T*>(p.queries) + p.q_offset(row, i), c);
    }
  }

#if ATTN_MMA_PREFETCH && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A warp issues a step's K/V loads only after the previous step's mmas, so every step after the
  // first waits on HBM again. In an unsplit call of 3-4 block steps (S = 129..256: 8-32 blocks,
  // HBM mostly idle) the copy engine pulls the rest of the chunk into L2 meanwhile: 0.2-0.65 µs
  // less kernel-only. Split calls fill the GPU, and there the same prefetch cost 1.5 µs at
  // S=4096 and 18% at 131072 (benchmark_results/raw/h200-bench_attend-prefetch.txt). Rows of one head are
  // contiguous in MLX's caches; other strides go without.
  const int ahead = begin + warps * kMmaStep;
  if (threadIdx.x == 0 && splits == 1 && ahead + warps * kMmaStep < end &&
      p.k_strides[2] == D && p.v_strides[2] == D) {
    const uint32_t bytes = uint32_t(end - ahead) * D * sizeof(T);
    const T* k_rows = K + int64_t{ahead} * D;
    const T* v_rows = V + int64_t{ahead} * D;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(k_rows), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(v_rows), "r"(bytes) : "memory");
  }
#endif
  if constexpr (kFold) {  // after the prefetch, which then overlaps the step's rows
    T* staged = reinterpret_cast<T*>(smem + mma_smem_floats(D));
    prepare_step_rows<T, D>(p, *step, staged, kv_row, tile, chunk_begin, chunk_end);
    if (real[0]) Slices::load_qk(q[0], staged + g * D, c);
  }
  // o[h][t]: O^T tile t, rows = dims dim(t) (c0, c1) and + 1 (c2, c3), columns = vectors
  // 8h + 2c, 8h + 2c + 1. m[h]: vector 8h + g's running max; l[h]: this lane's part of its
  // denominator.
  float o[kHalves][kSteps][4] = {};
  float m[kHalves], l[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) m[h] = kNegInf, l[h] = 0.0f;
  for (int base = begin + warp * kMmaStep; base < end; base += warps * kMmaStep) {
    // K rows base + g and base + 8 + g (the score mma's N = positions): lane c's D/4 dims.
    uint32_t k[2][kQK];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int j = min(base + 8 * n + g, end - 1);
      Slices::load_qk(k[n], K + j * p.k_strides[2], c);
    }
    // V rows base + 2c, + 1, + 8, + 9 (the P V mma's K = positions): lane g's D/8 dims. Issued
    // with K's loads, so both are in flight together; past D = 128 the registers do not hold Q,
    // K, V and O^T at once, so V waits for the scores (kLateV).
    uint32_t v[4][kV];
    auto load_v = [&] {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int at = base + 2 * c + (x & 1) + 8 * (x >> 1), j = min(at, end - 1);
        Slices::load_v(v[x], V + j * p.v_strides[2], g);
        if (at >= end) {  // weight 0: zero values, not 0 * a repeated inf (see the SIMT kernel)
#pragma unroll
          for (int w = 0; w < kV; ++w) v[x][w] = 0u;
        }
      }
    };
    if constexpr (!kLateV) load_v();
    // S = Q K^T over two tiles of 8 positions. k-step s maps mma k = 2c, 2c+1 to word 2s and
    // k = 2c + 8, 2c + 9 to word 2s + 1 of the lane's Q and K slices (the same dims in both).
    // A rows 8..15 (a1, a3) hold vector g + 8 in 16-vector blocks, else zero.
    float score[2][4] = {};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        const uint32_t a[4] = {q[0][2 * st], kHalves > 1 ? q[kHalves - 1][2 * st] : 0u,
                               q[0][2 * st + 1], kHalves > 1 ? q[kHalves - 1][2 * st + 1] : 0u};
        mma16816<T>(score[n], a, k[n][2 * st], k[n][2 * st + 1]);
      }
    }
    // score[n][2h + e]: vector 8h + g, position base + 8n + 2c + e.
    float old_factor[kHalves], w[kHalves][2][2];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      float tile_max = kNegInf;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = base + 8 * n + 2 * c + e;
          float sc = score[n][2 * h + e] * p.scale;
          if (j >= end || j > last[h]) {
            sc = kNegInf;
          } else if (p.mask) {
            sc = apply_mask(p, mask_base[h] + int64_t{j} * p.m_strides[3], sc);
          }
          score[n][2 * h + e] = sc;
          tile_max = max_nan(tile_max, sc);
        }
      }
      tile_max = max_nan(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = max_nan(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // One rescale factor per vector and step; an all-masked prefix keeps m = -inf (weights 0).
      const float new_max = max_nan(m[h], tile_max);
      const float shift = new_max == kNegInf ? 0.0f : new_max;
      old_factor[h] = __expf(m[h] - shift);
      m[h] = new_max;
      l[h] *= old_factor[h];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          w[h][n][e] = __expf(score[n][2 * h + e] - shift);
          l[h] += w[h][n][e];
        }
      }
    }
    if constexpr (kLateV) load_v();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      // O^T's columns are vectors 8h + 2c and + 1, whose factors live on lanes 8c and 8c + 4.
      const float f0 = __shfl_sync(0xffffffffu, old_factor[h], 8 * c);
      const float f1 = __shfl_sync(0xffffffffu, old_factor[h], 8 * c + 4);
      // P^T as the B operand: b0, b1 = positions 2c, 2c + 1 and b2, b3 = 8 + 2c, 9 + 2c of
      // vector 8h + g: exactly this lane's weights.
      const uint32_t b0 = pack2<T>(w[h][0][0], w[h][0][1]), b1 = pack2<T>(w[h][1][0], w[h][1][1]);
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        o[h][t][0] *= f0;
        o[h][t][1] *= f1;
        o[h][t][2] *= f0;
        o[h][t][3] *= f1;
        // A = V^T: row g = Slices::dim(g, t) (low halves of word t), row g + 8 = the next dim
        // (high halves); k = 2c, 2c + 1 from V rows x = 0, 1 and k = 2c + 8, + 9 from x = 2, 3.
        const uint32_t a[4] = {
            __byte_perm(v[0][t], v[1][t], 0x5410), __byte_perm(v[0][t], v[1][t], 0x7632),
            __byte_perm(v[2][t], v[3][t], 0x5410), __byte_perm(v[2][t], v[3][t], 0x7632)};
        mma16816<T>(o[h][t], a, b0, b1);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }

  // finish()'s slots: [warp][vector][max, denominator, 2 unused, D accumulators].
  const int stride = partial_stride(D);
  float* slots = smem + warp * VPB * stride;
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    if (c == 0) {
      slots[(8 * h + g) * stride] = m[h];
      slots[(8 * h + g) * stride + 1] = l[h];
    }
  }
  // The lane holds dims Slices::dim(g, t) and + 1 of vectors 8h + 2c (o[h][t][0] and [2]) and
  // + 1 ([1], [3]). Wide: dims 64w + 8g .. + 7, two 16-byte stores per vector and w. Odd c stores
  // the upper half first, so that the 8 lanes of each quarter warp write 8 distinct bank quads
  // (stride = 4 mod 32): no bank conflicts, where the 4-byte stores of stride D + 2 were 3.7-way
  // (ncu). Other D: one 8-byte store per vector and tile.
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    if constexpr (Slices::kWide) {
#pragma unroll
      for (int w = 0; w < D / 64; ++w) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float(&t0)[4] = o[h][4 * w], (&t1)[4] = o[h][4 * w + 1];
          const float(&t2)[4] = o[h][4 * w + 2], (&t3)[4] = o[h][4 * w + 3];
          const float4 low = make_float4(t0[e], t0[e + 2], t1[e], t1[e + 2]);
          const float4 high = make_float4(t2[e], t2[e + 2], t3[e], t3[e + 2]);
          float* row = slots + (8 * h + 2 * c + e) * stride + 4;
          float4* at = reinterpret_cast<float4*>(row + Slices::dim(g, 4 * w));
          const bool odd = c & 1;
          at[odd] = odd ? high : low;
          at[!odd] = odd ? low : high;
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float* row = slots + (8 * h + 2 * c + e) * stride + 4;
          *reinterpret_cast<float2*>(row + Slices::dim(g, t)) =
              float2{o[h][t][e], o[h][t][e + 2]};
        }
      }
    }
  }
  __syncthreads();
  finish<T, VPB>(p, smem, partials, kv_row, tile, split, splits, slot);
}

// VPB 16 holds twice the query slices and accumulators: 2 blocks per SM.
template <typename T, int D, int VPB = kMmaVectors>
__global__ void __launch_bounds__(kMmaWarps * 32, VPB > kMmaVectors ? 2 : mma_blocks_per_sm(D))
    attend_mma(DecodeProblem p, float* partials, int chunk, unsigned slot) {
  attend_mma_body<T, D, VPB, false>(p, partials, chunk, slot, nullptr);
}

// AttentionStep as one kernel: attend_mma over the caches `step` updates, on its raw q/k/v
// (prepare_step_rows). `p` is the step's attention (make_step_attention: queries unused).
template <typename T, int D>
__global__ void __launch_bounds__(kMmaWarps * 32, mma_blocks_per_sm(D))
    attend_mma_step(DecodeProblem p, float* partials, int chunk, unsigned slot, StepProblem step) {
  attend_mma_body<T, D, kMmaVectors, true>(p, partials, chunk, slot, &step);
}

}  // namespace
}  // namespace attn_kernels::cuda
