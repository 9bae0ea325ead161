// DecodeAttention on NVIDIA GPUs. Schedules (chosen in plan(); `auto` picks per shape):
//
//   chapter-G  one block per query vector, G warps; warp w visits positions w, w+G, ...
//              (the chapter's design: no GQA sharing, no context split)
//   split      one block per (query vector, context chunk), 8 warps: flash-decoding's split
//              of the context without GQA sharing (K/V rows are re-read per query head, mostly
//              from L2)
//   split-gqa  one block per (key/value head, tile of up to 4 query vectors of that head,
//              context chunk): each K/V row leaves HBM once per step for all query heads that
//              share it, and the context is split (flash-decoding) so every SM has warps; the
//              last block of each head to finish merges the chunks (one launch per call).
//   split-mma  split-gqa's work split on tensor cores (attend_mma below): the SIMT kernels
//              spend ~80 warp instructions per position and stop at ~37% of HBM bandwidth;
//              this one spends ~14 and reads at 91-97% (docs/cuda-kernel.md).
//
// In the SIMT kernels each row of D values is spread over a group of lanes that keeps its slice
// of the scaled queries in registers; groups ("walkers") run the online-softmax recurrence over
// tiles of positions, then every kernel combines its warps through shared memory (finish()):
// one thread per query vector computes the common max, the rescale factors and the
// denominator, and the threads each combine output dimensions. bf16/f16 are loaded and stored
// directly; arithmetic is float32. No MLX headers here (nvcc cannot compile them); see
// eval_gpu_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "decode_attention_cuda.h"

namespace attn_kernels::cuda {
namespace {

constexpr float kNegInf = -INFINITY;

// Positions a walker takes per step ("tile"): all their K and V loads are in flight before the
// first score, and the running max and the accumulators are rescaled once per tile instead of
// once per position. Blocks of up to 1024 threads have at most 64 registers a thread: half.
// ATTN_TILE, ATTN_BLOCKS_PER_SM, ATTN_MMA_PREFETCH and ATTN_MMA_BLOCKS_PER_SM are knobs for
// kernels-cuda/dev/bench_attend.cu; ATTN_MMA_MAX_SPLITS caps split-mma's split count for builds
// timed through MLX (kernels-cuda/dev/h200-mlx-split-cap.txt).
#ifndef ATTN_TILE
#define ATTN_TILE 2
#endif
#ifndef ATTN_BLOCKS_PER_SM
#define ATTN_BLOCKS_PER_SM 2
#endif
#ifndef ATTN_MMA_PREFETCH
#define ATTN_MMA_PREFETCH 1
#endif
#ifndef ATTN_MMA_MAX_SPLITS
#define ATTN_MMA_MAX_SPLITS (1 << 30)
#endif
#ifndef ATTN_MMA_BLOCKS_PER_SM
#define ATTN_MMA_BLOCKS_PER_SM 3
#endif

template <int kMaxThreads>
constexpr int kTileFor = kMaxThreads > 256 ? 2 : ATTN_TILE;

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ void store(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store(__half* p, float x) {
  *p = __float2half_rn(x);
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// A row of D values is spread over LPR lanes ("lanes per row"), kDPL = 8 consecutive values
// each: one 16-byte load per lane for bf16/f16, so a warp reads 32 / LPR rows at once and a dot
// product needs log2(LPR) shuffles instead of five.
constexpr int kDPL = 8;

// A lane's kDPL values of a row as stored (16 bytes for bf16/f16): K and V stay packed in
// registers until used, which halves the registers a tile of loads in flight takes.
template <typename T>
struct alignas(kDPL * sizeof(T)) Fragment {
  T v[kDPL];
};

template <typename T>
__device__ __forceinline__ void load_packed(
    Fragment<T>& dst, const T* row, int sublane, int D, int64_t stride) {
  const int d0 = sublane * kDPL;
  if (stride == 1 && d0 + kDPL <= D &&
      (reinterpret_cast<uintptr_t>(row + d0) % sizeof(Fragment<T>)) == 0) {
    dst = *reinterpret_cast<const Fragment<T>*>(row + d0);
  } else {
#pragma unroll
    for (int e = 0; e < kDPL; ++e) dst.v[e] = d0 + e < D ? row[(d0 + e) * stride] : T(0.0f);
  }
}

template <typename T>
__device__ __forceinline__ void load_fragment(
    float (&dst)[kDPL], const T* row, int sublane, int D, int64_t stride) {
  Fragment<T> packed;
  load_packed(packed, row, sublane, D, stride);
#pragma unroll
  for (int e = 0; e < kDPL; ++e) dst[e] = to_float(packed.v[e]);
}

template <int LPR>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int offset = LPR / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The score after the mask: an additive mask adds, a boolean one removes the key whatever its
// score (NaN included), as the readable path's mx.where does.
__device__ __forceinline__ float apply_mask(const DecodeProblem& p, int64_t at, float score) {
  switch (p.mask_dtype) {
    case ElementType::float32: return score + static_cast<const float*>(p.mask)[at];
    case ElementType::float16: return score + __half2float(static_cast<const __half*>(p.mask)[at]);
    case ElementType::bfloat16:
      return score + __bfloat162float(static_cast<const __nv_bfloat16*>(p.mask)[at]);
    case ElementType::boolean: return static_cast<const bool*>(p.mask)[at] ? score : kNegInf;
  }
  return score;
}

// fmaxf drops a NaN argument; softmax must not: a NaN score makes its row NaN, as in the readable
// path.
__device__ __forceinline__ float max_nan(float a, float b) {
  return a > b || isnan(a) ? a : b;
}

// ---- Split contexts: flash-decoding's merge inside the attend kernel ----
// Each block of a split writes its chunk's (max, denominator, unnormalised accumulator) per
// vector; the block of a (kv_row, tile) that finishes last merges every chunk and writes the
// output, so a split call is one launch (through MLX a second launch costs more host time than a
// short context takes to read). Blocks count arrivals in `arrivals`: each call takes fresh
// slots (plan()) and the last block resets its slot to zero for the slot's next user. A slot is
// reused after kArrivalSlots / (slots per call) calls. A call splits only when its groups fill at
// most half the resident blocks (split_count), at most 528 groups on an H200 (8 blocks of 256
// threads per SM x 132), so reuse is at least 124 calls apart; calls overlap only inside one CUDA
// graph, which MLX commits every 100 nodes on sm_90 by default (MLX_MAX_OPS_PER_BUFFER).
constexpr unsigned kArrivalSlots = 1u << 16;
__device__ unsigned arrivals[kArrivalSlots];

// Partial state of one vector and chunk: max, denominator, two unused floats, D accumulators
// (16-byte aligned for the merge's vector loads), padded to a multiple of four floats.
__host__ __device__ constexpr int partial_stride(int D) {
  return 4 + (D + 3) / 4 * 4;
}

// Called by every thread after its partial stores; true in the last block of the group to
// arrive, which then sees every block's partials. The barrier orders the block's stores before
// thread 0's arrival; the arrival is a release (publishes them) and an acquire (the last block
// then sees every other block's), so no thread needs a fence of its own.
__device__ bool last_to_arrive(unsigned slot, int splits) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* counter = &arrivals[(slot + blockIdx.x) % kArrivalSlots];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
    __threadfence();  // no acq_rel atomics before sm_70
    last = atomicAdd(counter, 1u) == unsigned(splits - 1);
    __threadfence();
#else
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(counter)
                 : "memory");
    last = before == unsigned(splits - 1);
#endif
    if (last) *counter = 0u;  // every block of this call has arrived
  }
  __syncthreads();
  return last;
}

constexpr int kMmaVectors = 8;  // split-mma's query vectors per block: the N of both mmas
constexpr int kMergeItems = 2;   // (vector, four dimensions) items per thread in the merge
constexpr int kMergeUnroll = 8;  // chunks' accumulator loads in flight per item

// The last block's merge of its VPB vectors. Each thread takes four output dimensions of up to
// ITEMS vectors (plan() checks that kMergeItems cover the tile) and issues the 16-byte
// accumulator loads of its first UNROLL chunks before anything else, so that they travel
// together with the chunks' (max, denominator) pairs, which the threads load next (__ldcg: other
// SMs wrote them, this SM's L1 may hold nothing valid) into shared memory; one warp per vector
// turns them into the common max, rescale factors and denominator; then the threads sum their
// accumulators over the chunks. A merge of up to UNROLL chunks costs one round trip to L2.
// (Folding each chunk in online instead, with no shared phase, was 1.2 µs slower at 32 chunks;
// docs/cuda-kernel.md.)
template <typename T, int VPB, int ITEMS, int UNROLL>
__device__ void merge_chunks_with(const DecodeProblem& p, float* smem, const float* partials,
                                  int kv_row, int tile, int splits) {
  const int D = p.head_dim, L = p.query_len, vectors = p.group * L, stride = partial_stride(D);
  const int first = tile * VPB, count = min(VPB, vectors - first);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float* base = partials + (int64_t{kv_row} * vectors + first) * splits * stride;
  const int quads = (D + 3) / 4, items = count * quads;

  const float4* column[ITEMS];
  int item[ITEMS], vector[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    item[k] = threadIdx.x + k * int(blockDim.x);
    const int at = min(item[k], items - 1);  // repeats the last: harmless
    vector[k] = at / quads;
    column[k] = reinterpret_cast<const float4*>(base + int64_t{vector[k]} * splits * stride + 4 +
                                                at % quads * 4);
  }
  float4 x[ITEMS][UNROLL];
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        x[k][u] = __ldcg(column[k] + int64_t{min(s0 + u, splits - 1)} * (stride / 4));
      }
    }
  };
  load_batch(0);

  float* factors = smem;                    // [VPB][splits]: the chunks' maxima, then factors
  float* sums = smem + VPB * splits;        // [VPB][splits]: the chunks' denominators
  float* totals = smem + 2 * VPB * splits;  // [VPB]
  // No barrier first: last_to_arrive()'s ends every thread's reads of finish()'s shared state.
  for (int at = threadIdx.x; at < count * splits; at += blockDim.x) {
    const float2 state = __ldcg(reinterpret_cast<const float2*>(base + int64_t{at} * stride));
    factors[at] = state.x;
    sums[at] = state.y;
  }
  __syncthreads();
  for (int v = warp; v < count; v += warps) {
    float common = kNegInf;
    for (int s = lane; s < splits; s += 32) common = max_nan(common, factors[v * splits + s]);
    for (int offset = 16; offset > 0; offset /= 2)
      common = max_nan(common, __shfl_xor_sync(0xffffffffu, common, offset));
    float total = 0.0f;
    for (int s = lane; s < splits; s += 32) {
      const float m = factors[v * splits + s];
      const float f = m == kNegInf ? 0.0f : __expf(m - common);
      factors[v * splits + s] = f;
      total += sums[v * splits + s] * f;
    }
    for (int offset = 16; offset > 0; offset /= 2)
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (lane == 0) totals[v] = total;
  }
  __syncthreads();

  float sum[ITEMS][4] = {};
  for (int s0 = 0;;) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const float* f = factors + vector[k] * splits;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (s0 + u >= splits) break;  // the loads repeat the last chunk: 0 * inf would be NaN
        const float w = f[s0 + u];
        sum[k][0] += x[k][u].x * w;
        sum[k][1] += x[k][u].y * w;
        sum[k][2] += x[k][u].z * w;
        sum[k][3] += x[k][u].w * w;
      }
    }
    s0 += UNROLL;
    if (s0 >= splits) break;
    load_batch(s0);
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (item[k] >= items) break;
    const int v = vector[k], d = item[k] % quads * 4;
    const int r = first + v, row = kv_row * p.group + r / L, i = r % L;
    T* out = static_cast<T*>(p.out) + (int64_t{row} * L + i) * D;
    const float total = totals[v];
    for (int e = 0; e < 4 && d + e < D; ++e) {
      store(out + d + e, total == 0.0f ? 0.0f : sum[k][e] / total);  // NaN stays NaN
    }
  }
}

// A tile of at most one item per thread (L = 1 with 4 query heads per KV head: 128 items) puts
// the registers of the second item to work as 8 more chunks in flight: half the L2 round trips at
// 16-32 chunks (L=1 S=1024/2048/4096: 8.91/11.37/13.23 -> 8.33/10.50/12.36 µs kernel-only). The
// tensor-core kernel (8 vectors, 168 registers) has room for 32 in flight, which pays past 16
// chunks only: below, the loads past the last chunk repeat it (S=512/1024 +0.2 µs, S=2048/4096
// -0.36; dev/h200-bench_attend-merge32.txt). The SIMT kernels' 128-register cap would spill.
template <typename T, int VPB>
__device__ void merge_chunks(const DecodeProblem& p, float* smem, const float* partials,
                             int kv_row, int tile, int splits) {
  const int count = min(VPB, p.group * p.query_len - tile * VPB);
  if (count * ((p.head_dim + 3) / 4) <= int(blockDim.x)) {
    constexpr int kWide = kMergeItems * kMergeUnroll;
    if (VPB == kMmaVectors && splits > kWide) {
      merge_chunks_with<T, VPB, 1, 2 * kWide>(p, smem, partials, kv_row, tile, splits);
    } else {
      merge_chunks_with<T, VPB, 1, kWide>(p, smem, partials, kv_row, tile, splits);
    }
  } else {
    merge_chunks_with<T, VPB, kMergeItems, kMergeUnroll>(p, smem, partials, kv_row, tile, splits);
  }
}

// The end of every attend kernel: shared memory holds one online-softmax state per warp and
// vector, [warp][vector][max, denominator, 2 unused, D accumulators] (the partials' layout,
// partial_stride(D) floats: 16-byte aligned accumulators). One thread per vector computes the
// common max, each warp's rescale factor (stored over its max) and the denominator; then the
// threads combine output dimensions across warps and write the output (one chunk) or the
// block's partial state, which the group's last block merges.
template <typename T, int VPB>
__device__ void finish(const DecodeProblem& p, float* smem, float* partials, int kv_row, int tile,
                       int split, int splits, unsigned slot) {
  const int D = p.head_dim, L = p.query_len, vectors = p.group * L;
  const int stride = partial_stride(D), warps = blockDim.x / 32;
  float* denominators = smem + warps * VPB * stride;
  if (threadIdx.x < VPB) {
    const int v = threadIdx.x;
    float common = kNegInf;
    for (int w = 0; w < warps; ++w) common = max_nan(common, smem[(w * VPB + v) * stride]);
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) {
      float* slot = smem + (w * VPB + v) * stride;
      const float factor = slot[0] == kNegInf ? 0.0f : __expf(slot[0] - common);
      total += slot[1] * factor;
      slot[0] = factor;
    }
    denominators[2 * v] = common;
    denominators[2 * v + 1] = total;
  }
  __syncthreads();
  // Four dimensions per thread and pass (16-byte shared loads: the slots are padded like the
  // partials), the warps' loads of a pass in flight together: the combine is on every block's
  // critical path.
  const int quads = (D + 3) / 4;
  for (int idx = threadIdx.x; idx < VPB * quads; idx += blockDim.x) {
    const int v = idx / quads, d = idx % quads * 4;
    const int r = tile * VPB + v;
    if (r >= vectors) continue;
    float sum[4] = {};
#pragma unroll 4
    for (int w = 0; w < warps; ++w) {
      const float* state = smem + (w * VPB + v) * stride;
      const float factor = state[0];
      const float4 acc = *reinterpret_cast<const float4*>(state + 4 + d);
      sum[0] += acc.x * factor;
      sum[1] += acc.y * factor;
      sum[2] += acc.z * factor;
      sum[3] += acc.w * factor;
    }
    const float common = denominators[2 * v], total = denominators[2 * v + 1];
    if (splits == 1) {
      const int row = kv_row * p.group + r / L, i = r % L;
      T* out = static_cast<T*>(p.out) + (int64_t{row} * L + i) * D + d;
      const float scale = total == 0.0f ? 0.0f : 1.0f / total;  // NaN stays NaN
      for (int e = 0; e < 4 && d + e < D; ++e) store(out + e, sum[e] * scale);
    } else {
      float* part = partials + ((int64_t{kv_row} * vectors + r) * splits + split) * stride;
      if (d == 0) {
        part[0] = common;
        part[1] = total;
      }
      *reinterpret_cast<float4*>(part + 4 + d) = make_float4(sum[0], sum[1], sum[2], sum[3]);
    }
  }
  if (splits > 1 && last_to_arrive(slot, splits)) {
    merge_chunks<T, VPB>(p, smem, partials, kv_row, tile, splits);
  }
}

// grid: (kv_rows * tiles, splits); block: up to kMaxThreads threads = G warps = G * 32 / LPR
// row walkers; a walker takes positions w, w + walkers, ... of the block's chunk, a tile of them
// per step. Shared memory: G * VPB * partial_stride(D) + 2 * VPB floats. With splits == 1 the
// block writes the output; otherwise (max, denominator, unnormalised accumulator) per vector to
// `partials`, merged by the group's last block (merge_chunks). Two blocks of 256 threads fit an
// SM's registers, so their loads overlap.
template <typename T, int VPB, int LPR, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, kMaxThreads > 256 ? 1 : ATTN_BLOCKS_PER_SM)
    attend(DecodeProblem p, float* partials, int chunk, unsigned slot) {
  extern __shared__ __align__(16) float smem[];
  constexpr int kRowsPerWarp = 32 / LPR;
  constexpr int kTile = kTileFor<kMaxThreads>;
  const int lane = threadIdx.x % 32, sublane = lane % LPR;
  const int walker = threadIdx.x / LPR, walkers = blockDim.x / LPR;
  const int D = p.head_dim, L = p.query_len, S = p.context;
  const int vectors = p.group * L;
  const int tiles = (vectors + VPB - 1) / VPB;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  const int begin = split * chunk, end = min(S, begin + chunk);

  const T* Q = static_cast<const T*>(p.queries);
  const T* K = static_cast<const T*>(p.keys) + p.kv_offset(p.k_strides, kv_row);
  const T* V = static_cast<const T*>(p.values) + p.kv_offset(p.v_strides, kv_row);

  float q[VPB][kDPL], acc[VPB][kDPL], m[VPB], l[VPB];
  int last[VPB];  // last visible position (causal), -1 for an unused slot
  int64_t mask_base[VPB];
#pragma unroll
  for (int v = 0; v < VPB; ++v) {
    const int r = tile * VPB + v;
    const int row = kv_row * p.group + r / L, i = r % L;
    last[v] = r < vectors ? (p.causal ? S - L + i : S - 1) : -1;
    mask_base[v] = p.mask_offset(row, i);
    if (r < vectors) {
      load_fragment<T>(q[v], Q + p.q_offset(row, i), sublane, D, p.q_strides[3]);
    } else {
#pragma unroll
      for (int e = 0; e < kDPL; ++e) q[v][e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kDPL; ++e) {
      q[v][e] *= p.scale;
      acc[v][e] = 0.0f;
    }
    m[v] = kNegInf;
    l[v] = 0.0f;
  }

  // The walkers of a warp step together (their shuffles need the whole warp): the loop runs
  // while the warp's first walker has work; positions past the end score -inf.
  const int warp_offset = walker % kRowsPerWarp;
  for (int j0 = begin + walker; j0 - warp_offset < end; j0 += walkers * kTile) {
    Fragment<T> k[kTile], val[kTile];
#pragma unroll
    for (int u = 0; u < kTile; ++u) {
      const int j = min(j0 + u * walkers, end - 1);
      load_packed(k[u], K + j * p.k_strides[2], sublane, D, p.k_strides[3]);
      load_packed(val[u], V + j * p.v_strides[2], sublane, D, p.v_strides[3]);
      // A position past the end repeats the last one with weight 0: zero its values, or an inf
      // there would add 0 * inf = NaN (the contract in attention.py).
      if (j0 + u * walkers >= end) {
#pragma unroll
        for (int e = 0; e < kDPL; ++e) val[u].v[e] = T(0.0f);
      }
    }
    // All scores of the tile first: their shuffle chains are independent and overlap.
    float score[kTile][VPB];
#pragma unroll
    for (int u = 0; u < kTile; ++u) {
#pragma unroll
      for (int v = 0; v < VPB; ++v) {
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < kDPL; ++e) partial += q[v][e] * to_float(k[u].v[e]);
        score[u][v] = row_sum<LPR>(partial);
      }
    }
#pragma unroll
    for (int v = 0; v < VPB; ++v) {
      float tile_max = kNegInf;
#pragma unroll
      for (int u = 0; u < kTile; ++u) {
        const int j = j0 + u * walkers;
        float s = score[u][v];
        if (j >= end || j > last[v]) {
          s = kNegInf;
        } else if (p.mask) {
          s = apply_mask(p, mask_base[v] + int64_t{j} * p.m_strides[3], s);
        }
        score[u][v] = s;
        tile_max = max_nan(tile_max, s);
      }
      // new_max = max(m, tile max); one rescale factor for l and every dimension per tile. An
      // all-masked prefix keeps m = -inf; exponentiate against 0 then so every weight is 0.
      const float new_max = max_nan(m[v], tile_max);
      const float base = new_max == kNegInf ? 0.0f : new_max;
      const float old_factor = __expf(m[v] - base);
      l[v] *= old_factor;
#pragma unroll
      for (int e = 0; e < kDPL; ++e) acc[v][e] *= old_factor;
#pragma unroll
      for (int u = 0; u < kTile; ++u) {
        const float weight = __expf(score[u][v] - base);
        l[v] += weight;
#pragma unroll
        for (int e = 0; e < kDPL; ++e) acc[v][e] += weight * to_float(val[u].v[e]);
      }
      m[v] = new_max;
    }
  }

  // The walkers of a warp merge their states with shuffles (partners hold the same dims), so
  // one state per warp goes to shared memory: [warp][vector][max, denominator, D accumulators].
#pragma unroll
  for (int offset = LPR; offset < 32; offset *= 2) {
#pragma unroll
    for (int v = 0; v < VPB; ++v) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[v], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[v], offset);
      const float common = max_nan(m[v], m_other);
      const float f = m[v] == kNegInf ? 0.0f : __expf(m[v] - common);
      const float f_other = m_other == kNegInf ? 0.0f : __expf(m_other - common);
      l[v] = l[v] * f + l_other * f_other;
      m[v] = common;
#pragma unroll
      for (int e = 0; e < kDPL; ++e) {
        acc[v][e] = acc[v][e] * f + __shfl_xor_sync(0xffffffffu, acc[v][e], offset) * f_other;
      }
    }
  }
  const int stride = partial_stride(D), warp = threadIdx.x / 32;
  if (lane < LPR) {
#pragma unroll
    for (int v = 0; v < VPB; ++v) {
      float* slot = smem + (warp * VPB + v) * stride;
      if (sublane == 0) {
        slot[0] = m[v];
        slot[1] = l[v];
      }
#pragma unroll
      for (int e = 0; e < kDPL; ++e) {
        const int d = sublane * kDPL + e;
        if (d < D) slot[4 + d] = acc[v][e];
      }
    }
  }
  __syncthreads();
  finish<T, VPB>(p, smem, partials, kv_row, tile, split, splits, slot);
}

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
constexpr int kMmaStep = 16;  // positions per warp step: the K of the P V mma

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // plan() picks this kernel only on sm_80 and newer
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
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
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

template <typename T, int D>
__global__ void __launch_bounds__(kMmaWarps * 32, ATTN_MMA_BLOCKS_PER_SM)
    attend_mma(DecodeProblem p, float* partials, int chunk, unsigned slot) {
  extern __shared__ __align__(16) float smem[];
  constexpr int kSteps = D / 16;  // k-steps of Q K^T; 16-dim tiles of V^T P^T
  constexpr int kQK = D / 8;      // words in a lane's D/4 values of a query or K row
  constexpr int kV = D / 16;      // words in a lane's D/8 values of a V row
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int L = p.query_len, S = p.context, vectors = p.group * L;
  const int tiles = (vectors + kMmaVectors - 1) / kMmaVectors;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  const int begin = split * chunk, end = min(S, begin + chunk);
  const T* K = static_cast<const T*>(p.keys) + p.kv_offset(p.k_strides, kv_row);
  const T* V = static_cast<const T*>(p.values) + p.kv_offset(p.v_strides, kv_row);

  // Lanes 4g..4g+3 own query vector g of the tile (the row of the score mma's A and C).
  const int r = tile * kMmaVectors + g;
  const bool real = r < vectors;
  const int row = kv_row * p.group + (real ? r : 0) / L, i = (real ? r : 0) % L;
  const int last = real ? (p.causal ? S - L + i : S - 1) : -1;
  const int64_t mask_base = p.mask_offset(row, i);
  uint32_t q[kQK] = {};
  // Lane c holds dims 32w + 8c .. 32w + 8c + 7 (w < D/32) of its query and K rows, and lane g dims
  // 64w + 8g .. 64w + 8g + 7 (w < D/64) of its V rows: one 16-byte load instruction then reads
  // whole 32-byte sectors of a row (4 lanes x 16 B of Q/K, 8 lanes x 16 B of V) instead of half of
  // each of twice as many (the mma only needs Q and K to share a mapping; V's sets O^T's rows):
  // 0.1-0.35 µs less per call, 1.1-1.5 at L=4/8 S=4096 (dev/h200-bench_attend-coalesced.txt).
  if (real) load_words<4>(q, static_cast<const T*>(p.queries) + p.q_offset(row, i) + c * 8);
  // The dim of O^T's row g in tile t (word t of a lane's V slice; row g + 8 is the next dim).
  auto dim = [g](int t) { return (t / 4) * 64 + g * 8 + 2 * (t % 4); };

#if ATTN_MMA_PREFETCH && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A warp issues a step's K/V loads only after the previous step's mmas, so every step after the
  // first waits on HBM again. In an unsplit call of 3-4 block steps (S = 129..256: 8-32 blocks,
  // HBM mostly idle) the copy engine pulls the rest of the chunk into L2 meanwhile: 0.2-0.65 µs
  // less kernel-only. Split calls fill the GPU, and there the same prefetch cost 1.5 µs at
  // S=4096 and 18% at 131072 (dev/h200-bench_attend-prefetch.txt). Rows of one head are
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
  // o[t]: O^T tile t, rows = dims dim(t) (c0, c1) and + 1 (c2, c3), columns = vectors
  // 2c, 2c + 1. m: vector g's running max; l: this lane's part of its denominator.
  float o[kSteps][4] = {};
  float m = kNegInf, l = 0.0f;
  for (int base = begin + warp * kMmaStep; base < end; base += warps * kMmaStep) {
    // K rows base + g and base + 8 + g (the score mma's N = positions): lane c's D/4 dims.
    uint32_t k[2][kQK];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int j = min(base + 8 * n + g, end - 1);
      load_words<4>(k[n], K + j * p.k_strides[2] + c * 8);
    }
    // V rows base + 2c, + 1, + 8, + 9 (the P V mma's K = positions): lane g's D/8 dims.
    uint32_t v[4][kV];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int at = base + 2 * c + (x & 1) + 8 * (x >> 1), j = min(at, end - 1);
      load_words<8>(v[x], V + j * p.v_strides[2] + g * 8);
      if (at >= end) {  // weight 0: zero values, not 0 * a repeated inf (see the SIMT kernel)
#pragma unroll
        for (int w = 0; w < kV; ++w) v[x][w] = 0u;
      }
    }
    // S = Q K^T over two tiles of 8 positions. k-step s maps mma k = 2c, 2c+1 to word 2s and
    // k = 2c + 8, 2c + 9 to word 2s + 1 of the lane's Q and K slices (the same dims in both).
    // A rows 8..15 (a1, a3) are unused: zero.
    float score[2][4] = {};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        const uint32_t a[4] = {q[2 * st], 0u, q[2 * st + 1], 0u};
        mma16816<T>(score[n], a, k[n][2 * st], k[n][2 * st + 1]);
      }
    }
    // score[n][e], e < 2: vector g, position base + 8n + 2c + e.
    float tile_max = kNegInf;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = base + 8 * n + 2 * c + e;
        float sc = score[n][e] * p.scale;
        if (j >= end || j > last) {
          sc = kNegInf;
        } else if (p.mask) {
          sc = apply_mask(p, mask_base + int64_t{j} * p.m_strides[3], sc);
        }
        score[n][e] = sc;
        tile_max = max_nan(tile_max, sc);
      }
    }
    tile_max = max_nan(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = max_nan(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // One rescale factor per vector and step; an all-masked prefix keeps m = -inf (weights 0).
    const float new_max = max_nan(m, tile_max);
    const float shift = new_max == kNegInf ? 0.0f : new_max;
    const float old_factor = __expf(m - shift);
    m = new_max;
    float w[2][2];
    l *= old_factor;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        w[n][e] = __expf(score[n][e] - shift);
        l += w[n][e];
      }
    }
    // O^T's columns are vectors 2c and 2c + 1, whose factors live on lanes 8c and 8c + 4.
    const float f0 = __shfl_sync(0xffffffffu, old_factor, 8 * c);
    const float f1 = __shfl_sync(0xffffffffu, old_factor, 8 * c + 4);
    // P^T as the B operand: b0, b1 = positions 2c, 2c + 1 and b2, b3 = 8 + 2c, 9 + 2c of vector
    // g: exactly this lane's weights.
    const uint32_t b0 = pack2<T>(w[0][0], w[0][1]), b1 = pack2<T>(w[1][0], w[1][1]);
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      o[t][0] *= f0;
      o[t][1] *= f1;
      o[t][2] *= f0;
      o[t][3] *= f1;
      // A = V^T: row g = dim(t) (low halves of word t), row g + 8 = the next dim
      // (high halves); k = 2c, 2c + 1 from V rows x = 0, 1 and k = 2c + 8, + 9 from x = 2, 3.
      const uint32_t a[4] = {__byte_perm(v[0][t], v[1][t], 0x5410), __byte_perm(v[0][t], v[1][t], 0x7632),
                             __byte_perm(v[2][t], v[3][t], 0x5410), __byte_perm(v[2][t], v[3][t], 0x7632)};
      mma16816<T>(o[t], a, b0, b1);
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // finish()'s slots: [warp][vector][max, denominator, 2 unused, D accumulators].
  const int stride = partial_stride(D);
  float* slots = smem + warp * kMmaVectors * stride;
  if (c == 0) {
    slots[g * stride] = m;
    slots[g * stride + 1] = l;
  }
  // The lane holds dims 64w + 8g .. + 7 of vectors 2c (o[..][0] and [2]) and 2c + 1 ([1], [3]):
  // two 16-byte stores per vector and w. Odd c stores the upper half first, so that the 8 lanes
  // of each quarter warp write 8 distinct bank quads (stride = 4 mod 32): no bank conflicts, where
  // the 4-byte stores of stride D + 2 were 3.7-way (ncu).
#pragma unroll
  for (int w = 0; w < D / 64; ++w) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float(&t0)[4] = o[4 * w], (&t1)[4] = o[4 * w + 1];
      const float(&t2)[4] = o[4 * w + 2], (&t3)[4] = o[4 * w + 3];
      const float4 low = make_float4(t0[e], t0[e + 2], t1[e], t1[e + 2]);
      const float4 high = make_float4(t2[e], t2[e + 2], t3[e], t3[e + 2]);
      float4* at = reinterpret_cast<float4*>(slots + (2 * c + e) * stride + 4 + dim(4 * w));
      const bool odd = c & 1;
      at[odd] = odd ? high : low;
      at[!odd] = odd ? low : high;
    }
  }
  __syncthreads();
  finish<T, kMmaVectors>(p, smem, partials, kv_row, tile, split, splits, slot);
}

// finish()'s shared memory: one (max, denominator, 2 unused, D accumulators) per warp and vector,
// then a (common max, denominator) per vector; the merge reuses it.
uint32_t attend_smem_bytes(int warps, int vpb, int head_dim) {
  return static_cast<uint32_t>((warps * vpb * partial_stride(head_dim) + 2 * vpb) * sizeof(float));
}

// A kernel as plan() needs it. MLX's libmlx carries its own CUDA runtime: hand it driver handles,
// not runtime pointers. `resident`: blocks of `threads` threads one SM holds at once.
struct Kernel {
  CUfunction function;
  int resident;
};

Kernel resolve(const void* kernel, int threads, size_t smem) {
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, kernel) != cudaSuccess) {
    throw std::runtime_error("[decode_attention] cudaGetFuncBySymbol failed");
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != cudaSuccess) {
    blocks = 1;
  }
  return {reinterpret_cast<CUfunction>(f), std::max(blocks, 1)};
}

// Resolved once per instantiation (a function-local static: plan() runs on every call, and the
// lookups are not free). Residency is taken with a full block and the largest D of its lanes.
template <typename T, int VPB, int LPR, int kMaxThreads>
const Kernel& simt_kernel() {
  static const Kernel kernel =
      resolve(reinterpret_cast<const void*>(&attend<T, VPB, LPR, kMaxThreads>), kMaxThreads,
              attend_smem_bytes(kMaxThreads / 32, VPB, LPR * kDPL));
  return kernel;
}

template <typename T, int D>
const Kernel& mma_kernel() {
  static const Kernel kernel =
      resolve(reinterpret_cast<const void*>(&attend_mma<T, D>), kMmaWarps * 32,
              attend_smem_bytes(kMmaWarps, kMmaVectors, D));
  return kernel;
}

template <typename T, int VPB, int kMaxThreads>
const Kernel& simt_kernel(int lpr) {
  switch (lpr) {
    case 1: return simt_kernel<T, VPB, 1, kMaxThreads>();
    case 2: return simt_kernel<T, VPB, 2, kMaxThreads>();
    case 4: return simt_kernel<T, VPB, 4, kMaxThreads>();
    case 8: return simt_kernel<T, VPB, 8, kMaxThreads>();
    case 16: return simt_kernel<T, VPB, 16, kMaxThreads>();
    default: return simt_kernel<T, VPB, 32, kMaxThreads>();
  }
}

// The three block shapes: chapter (one vector, up to 1024 threads), split (one vector, 256) and
// split-gqa (four vectors, 256).
template <typename T>
const Kernel& simt_kernel(int lpr, int vpb, int threads) {
  if (vpb == 4) return simt_kernel<T, 4, 256>(lpr);
  return threads > 256 ? simt_kernel<T, 1, 1024>(lpr) : simt_kernel<T, 1, 256>(lpr);
}

int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attribute, device);
  return value;
}

int sm_count() {
  static const int count = std::max(device_attribute(cudaDevAttrMultiProcessorCount), 1);
  return count;
}

bool has_bf16_mma() {  // mma.m16n8k16 with bf16: sm_80 and newer
  static const bool yes = device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8;
  return yes;
}

}  // namespace

Schedule parse_schedule(const std::string& name) {
  if (name == "auto") return Schedule::automatic;
  if (name == "split-mma") return Schedule::split_mma;
  if (name == "split-gqa") return Schedule::split_gqa;
  if (name == "split") return Schedule::split;
  if (name == "chapter-8") return Schedule::chapter8;
  if (name == "chapter-16") return Schedule::chapter16;
  if (name == "chapter-32") return Schedule::chapter32;
  throw std::invalid_argument(
      "[decode_attention] unknown schedule '" + name +
      "': use auto, split-mma, split, split-gqa, chapter-8, chapter-16 or chapter-32");
}

namespace {

bool aligned16(const void* base, const int64_t* strides, int dims) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || strides[3] != 1) return false;
  for (int a = 0; a < dims; ++a) {
    if (strides[a] % 8 != 0) return false;  // 8 two-byte elements
  }
  return true;
}

// The tensor-core kernel takes sm_80+, bf16/f16, D of 64 or 128 (registers) and rows it can read with
// 16-byte loads; anything else runs split-gqa.
bool mma_applies(const DecodeProblem& p) {
  return has_bf16_mma() && (p.dtype == ElementType::bfloat16 || p.dtype == ElementType::float16) &&
         (p.head_dim == 64 || p.head_dim == 128) && aligned16(p.queries, p.q_strides, 3) &&
         aligned16(p.keys, p.k_strides, 3) && aligned16(p.values, p.v_strides, 3);
}

template <typename T>
const Kernel& mma_kernel(int head_dim) {
  return head_dim == 64 ? mma_kernel<T, 64>() : mma_kernel<T, 128>();
}

// Chunks of at least one step per walker (one round trip to memory each), and no more blocks
// than `per_sm` per SM (at most what it holds at once: a second wave would only add a tail). The
// merge keeps two floats per vector (`vpb` of them) and chunk in the kernel's shared memory.
int split_count(const DecodeProblem& p, int per_sm, uint32_t smem, int blocks, int min_chunk,
                int vpb, int threads) {
  if (unsigned(blocks) > kArrivalSlots / 64) return 1;  // enough blocks without a split
  if (vpb * ((p.head_dim + 3) / 4) > kMergeItems * threads) return 1;  // one merge pass per tile
  const int wanted = (p.context + min_chunk - 1) / min_chunk;
  const int room = per_sm * sm_count();
  const int fit = (static_cast<int>(smem / sizeof(float)) - vpb) / (2 * vpb);
  return std::clamp(std::min(room / blocks, fit), 1, wanted);
}

// `step`: positions a whole block takes per step; chunks are multiples of it, so that no warp
// waits on a partial step of another.
void finish_plan(Plan& plan, const DecodeProblem& p, int splits, int tiles, int step) {
  const int vectors = p.group * p.query_len;
  plan.chunk = (p.context + splits - 1) / splits;
  plan.chunk = (plan.chunk + step - 1) / step * step;
  splits = (p.context + plan.chunk - 1) / plan.chunk;  // no empty chunks
  plan.splits = splits;
  plan.attend_grid[0] = p.kv_rows * tiles;
  plan.attend_grid[1] = splits;
  plan.partial_floats =
      splits > 1 ? size_t(p.kv_rows) * vectors * splits * partial_stride(p.head_dim) : 0;
  if (splits > 1) {  // fresh arrival counters for this call, one per (kv_row, tile)
    static std::atomic<unsigned> next_slot{0};
    plan.arrival_slot = next_slot.fetch_add(plan.attend_grid[0], std::memory_order_relaxed);
  }
}

Plan plan_mma(const DecodeProblem& p) {
  Plan plan{};
  const Kernel& attend = p.dtype == ElementType::float16 ? mma_kernel<__half>(p.head_dim)
                                                         : mma_kernel<__nv_bfloat16>(p.head_dim);
  plan.attend = attend.function;
  plan.attend_threads = kMmaWarps * 32;
  plan.attend_smem = attend_smem_bytes(kMmaWarps, kMmaVectors, p.head_dim);
  const int tiles = (p.group * p.query_len + kMmaVectors - 1) / kMmaVectors;
  // A merge costs ~2-3 µs on the H200 (the arrival atomic and L2 round trips): more than the
  // steps it saves while the context is at most kMmaUnsplitSteps block steps, where one chunk is
  // faster (kernels-cuda/dev/h200-bench_attend-mma-min-steps.txt). Re-measured with the cheaper
  // merge: 2 steps wins kernel-only by 0.2-0.8 µs at S = 192/256, 4 wins through MLX, where K/V
  // stay in L2 and calls overlap (kernels-cuda/dev/h200-mlx-workspace-ab.txt).
  constexpr int kStep = kMmaWarps * kMmaStep, kMmaUnsplitSteps = 4;
  // Split for two blocks per SM, not the three it holds: a sweep of split counts (K/V from HBM,
  // calls in sequence) had its lowest latency near 256 blocks at most shapes from S = 2048 on;
  // filling all 396 slots was 2-11% slower at L=1/2 S >= 8192 and L=4/8 S = 2048-8192
  // (L=4 S=16384 is 2% faster that way), probably because the merge's extra chunks cost more
  // than the added warps bring (not profiled; kernels-cuda/dev/h200-bench_attend-split-sweep.txt).
  constexpr int kMmaSplitBlocksPerSM = 2;
  int splits = 1;
  if (p.context > kMmaUnsplitSteps * kStep) {
    splits = split_count(p, std::min(attend.resident, kMmaSplitBlocksPerSM), plan.attend_smem,
                         p.kv_rows * tiles, kStep, kMmaVectors, plan.attend_threads);
    splits = std::min(splits, ATTN_MMA_MAX_SPLITS);
  }
  finish_plan(plan, p, splits, tiles, kStep);
  return plan;
}

}  // namespace

Plan plan(const DecodeProblem& p, Schedule schedule) {
  if (schedule == Schedule::automatic) {
    // Kernel-only latency on the H200 (kernels-cuda/dev/h200-bench_attend-*.txt): split-mma is
    // the fastest from S = 64 on for every L (chapter-16: 5.30/6.70/12.5 µs at S = 64/128/256,
    // split-mma 5.22/5.96/8.19); `split` (one block per query vector, no split) up to 32 positions
    // at L = 1. Through MLX the short contexts are at its per-op floor either way
    // (benchmark_results/h200-qwen3-4b-attention-L1-short-*.json).
    schedule = p.query_len == 1 && p.context <= 32 ? Schedule::split : Schedule::split_mma;
  }
  if (schedule == Schedule::split_mma) {
    if (mma_applies(p)) return plan_mma(p);
    schedule = Schedule::split_gqa;
  }
  Plan plan{};
  int lpr = 1;  // lanes per row: the power of two that covers D with kDPL values per lane
  while (lpr * kDPL < p.head_dim && lpr < 32) lpr *= 2;
  const int vectors = p.group * p.query_len;
  const bool split = schedule == Schedule::split_gqa || schedule == Schedule::split;
  const int vpb = schedule == Schedule::split_gqa && vectors >= 4 ? 4 : 1;
  const int warps = split ? 8
                    : schedule == Schedule::chapter8 ? 8
                    : schedule == Schedule::chapter16 ? 16
                                                      : 32;
  const int threads = warps * 32;
  const Kernel& attend = p.dtype == ElementType::float32 ? simt_kernel<float>(lpr, vpb, threads)
                         : p.dtype == ElementType::float16
                             ? simt_kernel<__half>(lpr, vpb, threads)
                             : simt_kernel<__nv_bfloat16>(lpr, vpb, threads);
  plan.attend = attend.function;
  plan.attend_threads = threads;
  plan.attend_smem = attend_smem_bytes(warps, vpb, p.head_dim);
  if (plan.attend_smem > 48 * 1024) {
    throw std::invalid_argument("[decode_attention] schedule needs more than 48 KiB of shared memory");
  }
  const int tiles = (vectors + vpb - 1) / vpb;
  const int walkers = threads / lpr;
  const int step = walkers * (threads > 256 ? kTileFor<1024> : kTileFor<256>);
  const int splits =
      split ? split_count(p, attend.resident, plan.attend_smem, p.kv_rows * tiles, step, vpb,
                          threads)
            : 1;
  finish_plan(plan, p, splits, tiles, step);
  return plan;
}

}  // namespace attn_kernels::cuda
