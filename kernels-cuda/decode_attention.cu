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
//   split-mma  split-gqa's work split on tensor cores (attend_mma, decode_attention_mma.cuh):
//              the SIMT kernels spend ~80 warp instructions per position and stop at ~37% of
//              HBM bandwidth; this one spends ~14 and reads at 91-97% (docs/cuda-kernel.md).
//   split-mma-16  split-mma with tiles of 16 query vectors where a KV head has more than 8
//              (GQA 4 at L >= 3): half the blocks read each K/V chunk.
//
// In the SIMT kernels each row of D values is spread over a group of lanes that keeps its slice
// of the scaled queries in registers; groups ("walkers") run the online-softmax recurrence over
// tiles of positions, then every kernel combines its warps through shared memory (finish()):
// one thread per query vector computes the common max, the rescale factors and the
// denominator, and the threads each combine output dimensions. bf16/f16 are loaded and stored
// directly; arithmetic is float32. No MLX headers here (nvcc cannot compile them); see
// eval_gpu_cuda.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "decode_attention_common.cuh"
#include "decode_attention_cuda.h"
#include "decode_attention_mma.cuh"

namespace attn_kernels::cuda {
namespace {

// Positions a walker takes per step ("tile"): all their K and V loads are in flight before the
// first score, and the running max and the accumulators are rescaled once per tile instead of
// once per position. Blocks of up to 1024 threads have at most 64 registers a thread: half.
// ATTN_TILE is a knob for kernels-cuda/dev/bench_attend.cu (the others:
// decode_attention_common.cuh).
#ifndef ATTN_TILE
#define ATTN_TILE 2
#endif

template <int kMaxThreads>
constexpr int kTileFor = kMaxThreads > 256 ? 2 : ATTN_TILE;

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
  // The chunk's positions inside the batch row's range (every position without per-row ranges).
  const CacheRange range = p.range(kv_row / p.kv_heads);
  const int begin = max(split * chunk, range.start);
  const int end = min(min(S, split * chunk + chunk), range.end);

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
    last[v] = r < vectors ? visible_keys(range, L, i, p.causal).last : -1;
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

// finish()'s shared memory: one (max, denominator, 2 unused, D accumulators) per warp and vector,
// then a (common max, denominator) per vector; the merge reuses it.
uint32_t attend_smem_bytes(int warps, int vpb, int head_dim) {
  return static_cast<uint32_t>(finish_smem_floats(warps, vpb, head_dim) * sizeof(float));
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

template <typename T, int D, int VPB>
const Kernel& mma_kernel() {
  static const Kernel kernel =
      resolve(reinterpret_cast<const void*>(&attend_mma<T, D, VPB>), kMmaWarps * 32,
              attend_smem_bytes(kMmaWarps, VPB, D));
  return kernel;
}

template <typename T, int D>
CUfunction mma_step_kernel() {
  static const CUfunction kernel =
      resolve(reinterpret_cast<const void*>(&attend_mma_step<T, D>), kMmaWarps * 32,
              mma_step_smem_bytes<T>(D))
          .function;
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
  if (name == "split-mma-16") return Schedule::split_mma16;
  if (name == "split-gqa") return Schedule::split_gqa;
  if (name == "split") return Schedule::split;
  if (name == "chapter-8") return Schedule::chapter8;
  if (name == "chapter-16") return Schedule::chapter16;
  if (name == "chapter-32") return Schedule::chapter32;
  throw std::invalid_argument(
      "[decode_attention] unknown schedule '" + name +
      "': use auto, split-mma, split-mma-16, split, split-gqa, chapter-8, chapter-16 or "
      "chapter-32");
}

namespace {

bool aligned16(const void* base, const int64_t* strides, int dims) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || strides[3] != 1) return false;
  for (int a = 0; a < dims; ++a) {
    if (strides[a] % 8 != 0) return false;  // 8 two-byte elements
  }
  return true;
}

// The tensor-core kernel takes sm_80+, bf16/f16, the head dims compiled below (MmaSlices: multiples
// of 16 up to 256) and rows 16-byte aligned; anything else runs split-gqa.
bool mma_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

bool mma_applies(const DecodeProblem& p) {
  return has_bf16_mma() && (p.dtype == ElementType::bfloat16 || p.dtype == ElementType::float16) &&
         mma_head_dim(p.head_dim) && aligned16(p.queries, p.q_strides, 3) &&
         aligned16(p.keys, p.k_strides, 3) && aligned16(p.values, p.v_strides, 3);
}

// 16-vector tiles up to D = 128 (past it a lane's two query slices and accumulators would not fit
// its registers at 2 blocks per SM).
bool mma16_head_dim(int head_dim) {
  return head_dim <= 128;
}

template <typename T>
const Kernel& mma_kernel(int head_dim, int vpb) {
  if (vpb > kMmaVectors) {
    switch (head_dim) {
      case 64: return mma_kernel<T, 64, 2 * kMmaVectors>();
      case 80: return mma_kernel<T, 80, 2 * kMmaVectors>();
      case 96: return mma_kernel<T, 96, 2 * kMmaVectors>();
      default: return mma_kernel<T, 128, 2 * kMmaVectors>();
    }
  }
  switch (head_dim) {
    case 64: return mma_kernel<T, 64, kMmaVectors>();
    case 80: return mma_kernel<T, 80, kMmaVectors>();
    case 96: return mma_kernel<T, 96, kMmaVectors>();
    case 256: return mma_kernel<T, 256, kMmaVectors>();
    default: return mma_kernel<T, 128, kMmaVectors>();
  }
}

template <typename T>
CUfunction mma_step_kernel(int head_dim) {
  switch (head_dim) {
    case 64: return mma_step_kernel<T, 64>();
    case 80: return mma_step_kernel<T, 80>();
    case 96: return mma_step_kernel<T, 96>();
    case 256: return mma_step_kernel<T, 256>();
    default: return mma_step_kernel<T, 128>();
  }
}

// Chunks of at least one step per walker (one round trip to memory each), and no more blocks
// than `per_sm` per SM (at most what it holds at once: a second wave would only add a tail). The
// merge keeps two floats per vector (`vpb` of them) and chunk in the kernel's shared memory.
int split_count(const DecodeProblem& p, int per_sm, uint32_t smem, int blocks, int min_chunk,
                int vpb) {
  if (unsigned(blocks) > kArrivalSlots / 64) return 1;  // enough blocks without a split
  const int wanted = (p.context + min_chunk - 1) / min_chunk;
  const int room = per_sm * sm_count();
  const int fit = max_merged_splits(static_cast<int>(smem / sizeof(float)), vpb);
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

// vpb: query vectors per block, kMmaVectors or twice that (split-mma-16).
Plan plan_mma(const DecodeProblem& p, int vpb) {
  Plan plan{};
  const Kernel& attend = p.dtype == ElementType::float16
                             ? mma_kernel<__half>(p.head_dim, vpb)
                             : mma_kernel<__nv_bfloat16>(p.head_dim, vpb);
  plan.attend = attend.function;
  plan.attend_threads = kMmaWarps * 32;
  plan.attend_smem = attend_smem_bytes(kMmaWarps, vpb, p.head_dim);
  if (p.query_len <= kStepMaxLength && vpb == kMmaVectors) {  // the step folds 8-vector tiles
    const bool f16 = p.dtype == ElementType::float16;
    plan.attend_step = f16 ? mma_step_kernel<__half>(p.head_dim)
                           : mma_step_kernel<__nv_bfloat16>(p.head_dim);
    plan.attend_step_smem = f16 ? mma_step_smem_bytes<__half>(p.head_dim)
                                : mma_step_smem_bytes<__nv_bfloat16>(p.head_dim);
  }
  const int tiles = (p.group * p.query_len + vpb - 1) / vpb;
  // A merge costs ~2-3 µs on the H200 (the arrival atomic and L2 round trips): more than the
  // steps it saves while the context is at most kMmaUnsplitSteps block steps, where one chunk is
  // faster (benchmark_results/raw/h200-bench_attend-mma-min-steps.txt). Re-measured with the cheaper
  // merge: 2 steps wins kernel-only by 0.2-0.8 µs at S = 192/256, 4 wins through MLX, where K/V
  // stay in L2 and calls overlap (benchmark_results/raw/h200-mlx-workspace-ab.txt).
  constexpr int kStep = kMmaWarps * kMmaStep, kMmaUnsplitSteps = 4;
  // Split for two blocks per SM, not the three it holds: a sweep of split counts (K/V from HBM,
  // calls in sequence) had its lowest latency near 256 blocks at most shapes from S = 2048 on;
  // filling all 396 slots was 2-11% slower at L=1/2 S >= 8192 and L=4/8 S = 2048-8192
  // (L=4 S=16384 is 2% faster that way), probably because the merge's extra chunks cost more
  // than the added warps bring (not profiled; benchmark_results/raw/h200-bench_attend-split-sweep.txt).
  // D 80 splits for all three slots in one wave: at two an SM its calls wait on the steps in
  // flight (D 96 took as long with 20% more bytes); three took S = 131072 from 524 to 453 us
  // (raw/h100-bench_attend-narrow-d-splits.txt) and turned its L = 1 losses at G 1-2 into ties
  // or wins through MLX. D 64 lost at L = 1, G 8 that way and keeps two (results-h200.md).
  const int split_blocks_per_sm = p.head_dim == 80 ? 3 : 2;
  int splits = 1;
  if (p.context > kMmaUnsplitSteps * kStep) {
    splits = split_count(p, std::min(attend.resident, split_blocks_per_sm), plan.attend_smem,
                         p.kv_rows * tiles, kStep, kMmaVectors);
    splits = std::min(splits, ATTN_MMA_MAX_SPLITS);
  }
  finish_plan(plan, p, splits, tiles, kStep);
  return plan;
}

}  // namespace

Plan plan(const DecodeProblem& p, Schedule schedule) {
  if (schedule == Schedule::automatic) {
    // Kernel-only latency on the H200 (benchmark_results/raw/h200-bench_attend-*.txt): split-mma is
    // the fastest from S = 64 on for every L (chapter-16: 5.30/6.70/12.5 µs at S = 64/128/256,
    // split-mma 5.22/5.96/8.19); `split` (one block per query vector, no split) up to 32 positions
    // at L = 1. Through MLX the short contexts are at its per-op floor either way
    // (benchmark_results/h200-qwen3-4b-attention-L1-short-*.json).
    // Head dims 80, 96 and 256 too (benchmark_results/h100-attention-coverage-split-mma-*.json,
    // an H100: 1.0-10x mx.fast at D 80 and 96 to S = 131072, where split-gqa had lost from
    // S = 1024; 2.8-13x at D 256 to S = 8192). Where mma_applies() fails, split-gqa.
    // 16-vector tiles at D 128 where they won, chained, an H100
    // (h100-attention-G{4,8}-L2-L8-split-mma-16-chained-*.json, GQA 4 and 8, L 2-8): 48+ vectors
    // a KV head from S = 32768 (0.69x split-mma's time at GQA 8, L = 8, S = 131072); 32 on 8 KV
    // heads (GQA 4, L = 8: 0.73x at 131072) but on 4 heads (GQA 8, L = 4) only at 131072; 24 at
    // 131072 (GQA 4, L = 6: 0.90x); 16 tied or lost. Other head dims are not measured.
    const int vectors = p.group * p.query_len;
    const bool wide = p.head_dim == 128 && p.context >= 32768 &&
                      (vectors >= 6 * kMmaVectors || (vectors >= 4 * kMmaVectors && p.group <= 4) ||
                       (vectors >= 3 * kMmaVectors && p.context >= 131072));
    schedule = p.query_len == 1 && p.context <= 32 ? Schedule::split
               : wide                              ? Schedule::split_mma16
                                                   : Schedule::split_mma;
  }
  if (schedule == Schedule::split_mma16) {  // where a KV head has more than 8 vectors
    const bool wide = p.group * p.query_len > kMmaVectors && mma16_head_dim(p.head_dim);
    if (mma_applies(p)) return plan_mma(p, wide ? 2 * kMmaVectors : kMmaVectors);
    schedule = Schedule::split_gqa;
  }
  if (schedule == Schedule::split_mma) {
    if (mma_applies(p)) return plan_mma(p, kMmaVectors);
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
      split ? split_count(p, attend.resident, plan.attend_smem, p.kv_rows * tiles, step, vpb) : 1;
  finish_plan(plan, p, splits, tiles, step);
  return plan;
}

}  // namespace attn_kernels::cuda
