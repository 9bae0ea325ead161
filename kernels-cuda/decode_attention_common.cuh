// The device code DecodeAttention's attend kernels share (decode_attention.cu's SIMT kernels and
// decode_attention_mma.cuh's tensor-core kernel) and DecodeAttentionQuantized's kernels reuse:
// conversions, the mask, the block combine (finish) and the split merge by the last block to
// arrive. Included by decode_attention.cu and decode_attention_quantized_kernel.cuh for nvcc and
// by the emulation runners (emulation/cuda_emu.h). Included by one translation unit per program
// (anonymous namespace and the __device__ arrival counters).
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cmath>
#include <cstdint>

#include "decode_problem.h"
#include "shared_memory.cuh"

// ATTN_BLOCKS_PER_SM, ATTN_MMA_PREFETCH and ATTN_MMA_BLOCKS_PER_SM are knobs for
// kernels-cuda/dev/bench_attend.cu; ATTN_MMA_MAX_SPLITS caps split-mma's split count for builds
// timed through MLX (benchmark_results/raw/h200-mlx-split-cap.txt). ATTN_TILE: decode_attention.cu.
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

namespace attn_kernels::cuda {
namespace {

constexpr float kNegInf = -INFINITY;

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

// The score after the mask: an additive mask adds (times `unit`: a kernel that keeps its scores
// in log2 units passes log2(e)), a boolean one removes the key whatever its score (NaN included),
// as the readable path's mx.where does. Problem: DecodeProblem or QuantizedProblem.
template <typename Problem>
__device__ __forceinline__ float apply_mask(const Problem& p, int64_t at, float score,
                                            float unit = 1.0f) {
  switch (p.mask_kind) {
    case kMaskFloat32: return score + unit * static_cast<const float*>(p.mask)[at];
    case kMaskFloat16: return score + unit * __half2float(static_cast<const __half*>(p.mask)[at]);
    case kMaskBFloat16:
      return score + unit * __bfloat162float(static_cast<const __nv_bfloat16*>(p.mask)[at]);
    case kMaskBool: return static_cast<const bool*>(p.mask)[at] ? score : kNegInf;
  }
  return score;
}

// fmaxf drops a NaN argument; softmax must not: a NaN score makes its row NaN, as in the readable
// path.
__device__ __forceinline__ float max_nan(float a, float b) {
  return a > b || isnan(a) ? a : b;
}

#if defined(__CUDACC__)
// cp.async (sm_80+; before it, builds for older GPUs copy in place: their plans never pick the
// kernels that stage through it, and the merge stages only where those kernels ask it to).
// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), in flight until waited for;
// only the first src_bytes (0-16) are read, the rest of the 16 are zeros.
__device__ __forceinline__ void copy_async16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  for (int i = 0; i < 16; ++i) {
    static_cast<char*>(dst)[i] = i < src_bytes ? static_cast<const char*>(src)[i] : char(0);
  }
#else
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src),
               "r"(src_bytes)
               : "memory");
#endif
}
// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void copy_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N groups of this thread's copies are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
#endif

// kernels-cuda/dev/bench_quantized.cu builds with ATTN_QUANTIZED_TRACE to see where a call's time
// goes: per block, %globaltimer stamps (ns) at the points that name a TraceSlot, and the SM the
// block ran on. Nothing otherwise.
enum TraceSlot {
  kTraceEntry,
  kTraceCopiesIssued,   // the prologue's copies are issued (mmat)
  kTraceQueriesLoaded,  // thread 0's first query load is back (mmat)
  kTraceQueries,   // the queries are f16 operands (mmat)
  kTraceWalk,      // the loop starts (mmat)
  kTraceWalkEnd,   // + warp: each warp's walk is done (mmat)
  kTraceFinish = kTraceWalkEnd + 4,
  kTraceArrived,   // last_to_arrive() has answered (split calls)
  kTraceMergeStates,  // the merge has the chunks' (max, denominator) pairs in shared memory
  kTraceMergeFactors,  // ... and their rescale factors
  kTraceExit,
  kTraceSm,
  kTraceSink,  // trace_stamp_after()'s value
  kTraceSlots
};
#if defined(ATTN_QUANTIZED_TRACE) && defined(__CUDACC__)
__device__ unsigned long long* quantized_trace;
__device__ __forceinline__ unsigned long long* trace_block() {
  return quantized_trace + (blockIdx.y * gridDim.x + blockIdx.x) * kTraceSlots;
}
__device__ __forceinline__ void trace_stamp(int slot) {
  unsigned long long* block = trace_block();
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  block[slot] = t;
  if (slot == kTraceEntry) {
    unsigned sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    block[kTraceSm] = sm;
  }
}
// A stamp taken once `value` (a load's result) is in a register: storing it waits for the load.
__device__ __forceinline__ void trace_stamp_after(int slot, uint32_t value) {
  unsigned long long* block = trace_block();
  block[kTraceSink] = value;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
  block[slot] = t;
}
#else
__device__ __forceinline__ void trace_stamp(int) {}
__device__ __forceinline__ void trace_stamp_after(int, uint32_t) {}
#endif

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

// The shared memory finish() takes: one state per warp and vector, then a (max, denominator)
// pair per vector.
__host__ __device__ constexpr int finish_smem_floats(int warps, int vpb, int D) {
  return warps * vpb * partial_stride(D) + 2 * vpb;
}

// The most chunks whose merge fits `smem_floats` (merge_chunks_with: factors and denominators of
// every chunk, a total per vector).
__host__ __device__ constexpr int max_merged_splits(int smem_floats, int vpb) {
  return (smem_floats - vpb) / (2 * vpb);
}

// Called by every thread after its partial stores; true in the last block of the group to
// arrive, which then sees every block's partials. The barrier orders the block's stores before
// thread 0's arrival; the arrival is a release (publishes them) and an acquire (the last block
// then sees every other block's), so no thread needs a fence of its own.
__device__ bool last_to_arrive(unsigned slot, int splits) {
  ATTN_SHARED_FLAG(last);
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* counter = &arrivals[(slot + blockIdx.x) % kArrivalSlots];
#if !defined(__CUDACC__) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700)
    __threadfence();  // no acq_rel atomics before sm_70 (nor in the emulation)
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

// The last block's merge of `count` vectors from `first` (at most VPB, and no more than ITEMS items
// a thread cover: finish() merges larger tiles in parts). Each thread takes four output
// dimensions of up to ITEMS vectors and issues the 16-byte accumulator loads of its first UNROLL
// chunks before anything else, so that they travel together with the chunks' (max, denominator)
// pairs, which the threads load next (__ldcg: other SMs wrote them, this SM's L1 may hold nothing
// valid) into shared memory; one warp per vector turns them into the common max, rescale factors
// and denominator; then the threads sum their accumulators over the chunks. A merge of up to UNROLL
// chunks costs one round trip to L2. (Folding each chunk in online instead, with no shared phase,
// was 1.2 µs slower at 32 chunks; docs/cuda-kernel.md.) With STAGE_FLOATS of shared memory (0: none
// to spare), the chunks after the first UNROLL go there with cp.async at the same time, as many as
// fit, each thread's own items only (no barrier): a round trip (~1.5 µs on the H200) for each
// UNROLL of them saved. (A template parameter, so that the kernels without it compile none of its
// code: compiled for them too, it made the bf16 tensor-core kernel spill at its 168-register
// bound.)
template <typename T, int VPB, int ITEMS, int UNROLL, int STAGE_FLOATS, typename Problem>
__device__ void merge_chunks_with(const Problem& p, float* smem, const float* partials,
                                  int kv_row, int first, int count, int splits) {
  const int D = p.head_dim, L = p.query_len, vectors = p.group * L, stride = partial_stride(D);
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
  // [chunk - UNROLL][item k][thread]: the staged chunks' accumulators (16-byte aligned).
  const int staged_at = (2 * VPB * splits + VPB + 3) / 4 * 4;
  const int chunk_floats = 4 * ITEMS * int(blockDim.x);
  const int staged =
      STAGE_FLOATS > 0 ? max(0, min(splits - UNROLL, (STAGE_FLOATS - staged_at) / chunk_floats))
                       : 0;
  float4* stage = reinterpret_cast<float4*>(smem + staged_at);
  if constexpr (STAGE_FLOATS > 0) {
    for (int j = 0; j < staged; ++j) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        copy_async16(stage + (j * ITEMS + k) * blockDim.x + threadIdx.x,
                     column[k] + int64_t{UNROLL + j} * (stride / 4), 16);
      }
    }
    copy_async_commit();
  }
  // No barrier first: last_to_arrive()'s ends every thread's reads of finish()'s shared state.
  // A thread's pairs are all loaded before it stores any: one round trip for up to
  // kPairLoads * blockDim.x of them (a store between loads made it one per blockDim.x): 256 at
  // 128 threads, Qwen3-4B's splits (8 vectors' 32 chunks, 4 vectors' 33); more take another
  // (at 4 the fused step kernel spilled at its 168-register bound). Loads past the last pair are
  // skipped, not clamped to it: hundreds of threads reading one address queue on its L2 line
  // (4-bit mmat, 33 chunks: the merging block 6.7 -> 5.0 µs; H200).
  constexpr int kPairLoads = 2;
  const int pairs = count * splits;
  for (int first_at = threadIdx.x; first_at < pairs; first_at += kPairLoads * blockDim.x) {
    float2 state[kPairLoads];
#pragma unroll
    for (int k = 0; k < kPairLoads; ++k) {
      const int at = first_at + k * int(blockDim.x);
      if (at < pairs) {
        state[k] = __ldcg(reinterpret_cast<const float2*>(base + int64_t{at} * stride));
      }
    }
#pragma unroll
    for (int k = 0; k < kPairLoads; ++k) {
      const int at = first_at + k * int(blockDim.x);
      if (at < pairs) {
        factors[at] = state[k].x;
        sums[at] = state[k].y;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) trace_stamp(kTraceMergeStates);
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
  if (threadIdx.x == 0) trace_stamp(kTraceMergeFactors);

  float sum[ITEMS][4] = {};
  auto add = [&](int k, int chunk, const float4& acc) {
    const float w = factors[vector[k] * splits + chunk];
    sum[k][0] += acc.x * w;
    sum[k][1] += acc.y * w;
    sum[k][2] += acc.z * w;
    sum[k][3] += acc.w * w;
  };
  auto add_batch = [&](int s0) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (s0 + u >= splits) break;  // the loads repeat the last chunk: 0 * inf would be NaN
        add(k, s0 + u, x[k][u]);
      }
    }
  };
  add_batch(0);
  if constexpr (STAGE_FLOATS > 0) {
    if (staged > 0) copy_async_wait<0>();  // this thread's own copies: no other thread reads them
    for (int j = 0; j < staged; ++j) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        add(k, UNROLL + j, stage[(j * ITEMS + k) * blockDim.x + threadIdx.x]);
      }
    }
  }
  for (int s0 = UNROLL + staged; s0 < splits; s0 += UNROLL) {
    load_batch(s0);
    add_batch(s0);
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
// -0.36; ../benchmark_results/raw/h200-bench_attend-merge32.txt). The SIMT kernels' 128-register cap would spill
// (WIDE false: the quantized kernels, sized for 2-4 blocks per SM, take 16).
template <typename T, int VPB, bool WIDE, int STAGE_FLOATS, typename Problem>
__device__ void merge_chunks(const Problem& p, float* smem, const float* partials, int kv_row,
                             int first, int count, int splits) {
  if (count * ((p.head_dim + 3) / 4) <= int(blockDim.x)) {
    constexpr int kWide = kMergeItems * kMergeUnroll;
    if (WIDE && splits > kWide) {
      merge_chunks_with<T, VPB, 1, 2 * kWide, STAGE_FLOATS>(p, smem, partials, kv_row, first,
                                                            count, splits);
    } else {
      merge_chunks_with<T, VPB, 1, kWide, STAGE_FLOATS>(p, smem, partials, kv_row, first, count,
                                                        splits);
    }
  } else {
    merge_chunks_with<T, VPB, kMergeItems, kMergeUnroll, STAGE_FLOATS>(p, smem, partials, kv_row,
                                                                       first, count, splits);
  }
}

// The end of every attend kernel: shared memory holds one online-softmax state per warp and
// vector, [warp][vector][max, denominator, 2 unused, D accumulators] (the partials' layout,
// partial_stride(D) floats: 16-byte aligned accumulators). One thread per vector computes the
// common max, each warp's rescale factor (stored over its max) and the denominator; then the
// threads combine output dimensions across warps and write the output (one chunk) or the
// block's partial state, which the group's last block merges.
// Shared memory: finish_smem_floats(); a split call's merge takes 2 * M * splits + M floats
// (M = min(VPB, kMmaVectors), the vectors of one merge) and stages chunks in the rest of
// STAGE_FLOATS, the kernel's shared floats (merge_chunks_with).
template <typename T, int VPB, bool WIDE_MERGE = VPB >= kMmaVectors, int STAGE_FLOATS = 0,
          typename Problem>
__device__ void finish(const Problem& p, float* smem, float* partials, int kv_row, int tile,
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
  if (splits > 1) {
    const bool last = last_to_arrive(slot, splits);
    if (threadIdx.x == 0) trace_stamp(kTraceArrived);
    if (last) {
      // The tile merges in parts, one after the other (the partials' layout does not depend on
      // the tile): at most 8 vectors (a 16-vector tile of split-mma-16 keeps the merge's
      // registers) and no more than kMergeItems items a thread cover (D = 256 at 128 threads:
      // 4 vectors, so that its 8-vector tiles split too).
      constexpr int kMergeVPB = VPB > kMmaVectors ? kMmaVectors : VPB;
      const int per_part = min(kMergeVPB, kMergeItems * int(blockDim.x) / quads);
      const int begin = tile * VPB, end = min(vectors, begin + VPB);
      for (int first = begin; first < end; first += per_part) {
        if (first > begin) __syncthreads();  // the last part's reads of its shared factors
        merge_chunks<T, kMergeVPB, WIDE_MERGE, STAGE_FLOATS>(p, smem, partials, kv_row, first,
                                                             min(per_part, end - first), splits);
      }
    }
  }
}

}  // namespace
}  // namespace attn_kernels::cuda
