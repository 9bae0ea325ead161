// DecodeAttention on NVIDIA GPUs. One kernel family, two schedules (chosen in plan()):
//
//   chapter-G  one block per query vector, G warps; warp w visits positions w, w+G, ...
//              (the chapter's design: no GQA sharing, no context split)
//   split      one block per (query vector, context chunk), 8 warps: flash-decoding's split
//              of the context without GQA sharing (K/V rows are re-read per query head, mostly
//              from L2)
//   split-gqa  one block per (key/value head, tile of up to 4 query vectors of that head,
//              context chunk): each K/V row leaves HBM once per step for all query heads that
//              share it, and the context is split (flash-decoding) so every SM has warps; a
//              second small kernel merges the chunks.
//
// Within a block each row of D values is spread over a group of lanes that keeps its slice of
// the scaled queries in registers; groups ("walkers") run the online-softmax recurrence over
// their positions, then combine through shared memory: one thread per query vector computes
// the common max, the rescale factors and the denominator, and the threads each combine output
// dimensions. bf16/f16 are loaded and stored directly; arithmetic
// is float32. No MLX headers here (nvcc cannot compile them); see eval_gpu_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <unordered_map>
#include <stdexcept>
#include <string>

#include "decode_attention_cuda.h"

namespace attn_kernels::cuda {
namespace {

constexpr float kNegInf = -INFINITY;
// Positions whose K/V loads a walker has in flight at once (fewer where a block may have 1024
// threads and registers are scarce).
template <int VPB>
struct Unroll {
  static constexpr int value = 2;
};

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

template <typename T>
__device__ __forceinline__ void load_fragment(
    float (&dst)[kDPL], const T* row, int sublane, int D, int64_t stride) {
  const int d0 = sublane * kDPL;
  if (stride == 1 && d0 + kDPL <= D &&
      (reinterpret_cast<uintptr_t>(row + d0) % (kDPL * sizeof(T))) == 0) {
    struct alignas(kDPL * sizeof(T)) Vec {
      T v[kDPL];
    };
    const Vec vec = *reinterpret_cast<const Vec*>(row + d0);
#pragma unroll
    for (int e = 0; e < kDPL; ++e) dst[e] = to_float(vec.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kDPL; ++e) dst[e] = d0 + e < D ? to_float(row[(d0 + e) * stride]) : 0.0f;
  }
}

template <int LPR>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int offset = LPR / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float mask_value(const DecodeProblem& p, int64_t at) {
  switch (p.mask_dtype) {
    case ElementType::float32: return static_cast<const float*>(p.mask)[at];
    case ElementType::float16: return __half2float(static_cast<const __half*>(p.mask)[at]);
    case ElementType::bfloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p.mask)[at]);
    case ElementType::boolean: return static_cast<const bool*>(p.mask)[at] ? 0.0f : kNegInf;
  }
  return 0.0f;
}

// grid: (kv_rows * tiles, splits); block: G warps = G * 32 / LPR row walkers; walker w visits
// positions w, w + walkers, ... of the block's chunk. Shared memory: G * VPB * (D + 2) + 2 * VPB
// floats. With splits == 1 the block writes the output; otherwise it writes (max,
// denominator, unnormalised accumulator) per vector to `partials` for merge().
// Single-vector blocks run up to 32 warps (chapter-32): registers must fit 1024 threads. GQA
// blocks (256 threads) are held to two per SM's registers, so loads of two blocks overlap.
template <typename T, int VPB, int LPR>
__global__ void __launch_bounds__(VPB == 1 ? 1024 : 256, VPB == 1 ? 1 : 2) attend(DecodeProblem p, float* partials, int chunk) {
  extern __shared__ float smem[];
  constexpr int kRowsPerWarp = 32 / LPR;
  constexpr int kUnroll = Unroll<VPB>::value;
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

  // kUnroll positions per step: their K and V loads are all in flight before the first score.
  // The walkers of a warp step together (their shuffles need the whole warp): the loop runs
  // while the warp's first walker has work, and a walker past the end ignores its scores.
  const int warp_offset = walker % kRowsPerWarp;
  for (int j0 = begin + walker; j0 - warp_offset < end; j0 += walkers * kUnroll) {
    float k[kUnroll][kDPL], val[kUnroll][kDPL];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = min(j0 + u * walkers, end - 1);
      load_fragment<T>(k[u], K + j * p.k_strides[2], sublane, D, p.k_strides[3]);
      load_fragment<T>(val[u], V + j * p.v_strides[2], sublane, D, p.v_strides[3]);
    }
    // All scores of the step first: their shuffle chains are independent and overlap.
    float score[kUnroll][VPB];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int v = 0; v < VPB; ++v) {
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < kDPL; ++e) partial += q[v][e] * k[u][e];
        score[u][v] = row_sum<LPR>(partial);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * walkers;
#pragma unroll
      for (int v = 0; v < VPB; ++v) {
        float s = score[u][v];
        if (j >= end || j > last[v]) continue;
        if (p.mask) s += mask_value(p, mask_base[v] + int64_t{j} * p.m_strides[3]);
        if (s == kNegInf) continue;
        // new_max = max(m, s); both factors computed once, applied to l and every dimension.
        const float new_max = fmaxf(m[v], s);
        const float old_factor = __expf(m[v] - new_max);
        const float weight = __expf(s - new_max);
        l[v] = l[v] * old_factor + weight;
        m[v] = new_max;
#pragma unroll
        for (int e = 0; e < kDPL; ++e) acc[v][e] = acc[v][e] * old_factor + weight * val[u][e];
      }
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
      const float common = fmaxf(m[v], m_other);
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
  const int stride = D + 2, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* denominators = smem + warps * VPB * stride;
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
        if (d < D) slot[2 + d] = acc[v][e];
      }
    }
  }
  __syncthreads();
  // One thread per vector: the common max, each warp's rescale factor (stored over its max)
  // and the final denominator.
  if (threadIdx.x < VPB) {
    const int v = threadIdx.x;
    float common = kNegInf;
    for (int w = 0; w < warps; ++w) common = fmaxf(common, smem[(w * VPB + v) * stride]);
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
  // Threads combine output dimensions across warps.
  for (int idx = threadIdx.x; idx < VPB * D; idx += blockDim.x) {
    const int v = idx / D, d = idx % D;
    const int r = tile * VPB + v;
    if (r >= vectors) continue;
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w) {
      const float* slot = smem + (w * VPB + v) * stride;
      sum += slot[2 + d] * slot[0];
    }
    const float common = denominators[2 * v], total = denominators[2 * v + 1];
    if (splits == 1) {
      const int row = kv_row * p.group + r / L, i = r % L;
      T* out = static_cast<T*>(p.out) + (int64_t{row} * L + i) * D;
      store(out + d, total > 0.0f ? sum / total : 0.0f);
    } else {
      float* part = partials + ((int64_t{kv_row} * vectors + r) * splits + split) * stride;
      if (d == 0) {
        part[0] = common;
        part[1] = total;
      }
      part[2 + d] = sum;
    }
  }
}

// One block per query vector, one thread per output dimension: combine the context chunks.
template <typename T>
__global__ void merge(DecodeProblem p, const float* partials, int splits) {
  const int D = p.head_dim, L = p.query_len;
  const int vectors = p.group * L;
  const int vec = blockIdx.x;  // kv_row * vectors + r
  const int kv_row = vec / vectors, r = vec % vectors;
  const int stride = D + 2;
  const float* part = partials + int64_t{vec} * splits * stride;
  float common = kNegInf;
  for (int s = 0; s < splits; ++s) common = fmaxf(common, part[s * stride]);
  const int row = kv_row * p.group + r / L, i = r % L;
  T* out = static_cast<T*>(p.out) + (int64_t{row} * L + i) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float total = 0.0f, sum = 0.0f;
    if (common != kNegInf) {
      for (int s = 0; s < splits; ++s) {
        const float f = __expf(part[s * stride] - common);
        total += part[s * stride + 1] * f;
        sum += part[s * stride + 2 + d] * f;
      }
    }
    store(out + d, total > 0.0f ? sum / total : 0.0f);
  }
}

// MLX's libmlx carries its own CUDA runtime: hand it driver handles, not runtime pointers.
// Resolved once per kernel (the lookup is not free and plan() runs on every call).
CUfunction handle(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, CUfunction> resolved;
  std::lock_guard lock(mutex);
  auto it = resolved.find(kernel);
  if (it != resolved.end()) return it->second;
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, kernel) != cudaSuccess) {
    throw std::runtime_error("[decode_attention] cudaGetFuncBySymbol failed");
  }
  return resolved[kernel] = reinterpret_cast<CUfunction>(f);
}

template <typename T, int VPB>
const void* attend_kernel(int lpr) {
  switch (lpr) {
    case 1: return reinterpret_cast<const void*>(&attend<T, VPB, 1>);
    case 2: return reinterpret_cast<const void*>(&attend<T, VPB, 2>);
    case 4: return reinterpret_cast<const void*>(&attend<T, VPB, 4>);
    case 8: return reinterpret_cast<const void*>(&attend<T, VPB, 8>);
    case 16: return reinterpret_cast<const void*>(&attend<T, VPB, 16>);
    default: return reinterpret_cast<const void*>(&attend<T, VPB, 32>);
  }
}

template <typename T>
const void* attend_kernel(int lpr, int vpb) {
  return vpb == 1 ? attend_kernel<T, 1>(lpr) : attend_kernel<T, 4>(lpr);
}

int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 1;
  }();
  return count;
}

}  // namespace

Schedule parse_schedule(const std::string& name) {
  if (name == "auto" || name == "split-gqa") return Schedule::split_gqa;
  if (name == "split") return Schedule::split;
  if (name == "chapter-8") return Schedule::chapter8;
  if (name == "chapter-16") return Schedule::chapter16;
  if (name == "chapter-32") return Schedule::chapter32;
  throw std::invalid_argument(
      "[decode_attention] unknown schedule '" + name +
      "': use auto, split, split-gqa, chapter-8, chapter-16 or chapter-32");
}

Plan plan(const DecodeProblem& p, Schedule schedule) {
  Plan plan{};
  int lpr = 1;  // lanes per row: the power of two that covers D with kDPL values per lane
  while (lpr * kDPL < p.head_dim && lpr < 32) lpr *= 2;
  const int vectors = p.group * p.query_len;
  int warps, vpb, splits = 1;
  if (schedule == Schedule::split_gqa || schedule == Schedule::split) {
    vpb = schedule == Schedule::split_gqa && vectors >= 4 ? 4 : 1;
    warps = 8;
    const int walkers = warps * 32 / lpr;
    const int blocks = p.kv_rows * ((vectors + vpb - 1) / vpb);
    // About two unrolled steps per walker, but no more than eight blocks per SM; a context that
    // needs at most two chunks is not split (the merge launch costs more).
    const int per_block = walkers * (vpb == 1 ? Unroll<1>::value : Unroll<4>::value) * 2;
    const int wanted = (p.context + per_block - 1) / per_block;
    const int room = std::max(1, sm_count() * 8 / blocks);
    splits = wanted <= 2 ? 1 : std::min(wanted, room);
  } else {
    vpb = 1;
    warps = schedule == Schedule::chapter8 ? 8 : schedule == Schedule::chapter16 ? 16 : 32;
  }
  const int tiles = (vectors + vpb - 1) / vpb;
  plan.chunk = (p.context + splits - 1) / splits;
  splits = (p.context + plan.chunk - 1) / plan.chunk;  // no empty chunks
  plan.splits = splits;
  plan.attend_grid[0] = p.kv_rows * tiles;
  plan.attend_grid[1] = splits;
  plan.attend_threads = warps * 32;
  plan.attend_smem =
      static_cast<uint32_t>((warps * vpb * (p.head_dim + 2) + 2 * vpb) * sizeof(float));
  if (plan.attend_smem > 48 * 1024) {
    throw std::invalid_argument("[decode_attention] schedule needs more than 48 KiB of shared memory");
  }
  plan.partial_floats = splits > 1 ? size_t(p.kv_rows) * vectors * splits * (p.head_dim + 2) : 0;
  plan.merge_blocks = p.kv_rows * vectors;
  plan.merge_threads = std::min(p.head_dim, 256);
  switch (p.dtype) {
    case ElementType::float32:
      plan.attend = handle(attend_kernel<float>(lpr, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<float>));
      break;
    case ElementType::float16:
      plan.attend = handle(attend_kernel<__half>(lpr, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<__half>));
      break;
    default:
      plan.attend = handle(attend_kernel<__nv_bfloat16>(lpr, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<__nv_bfloat16>));
      break;
  }
  return plan;
}

}  // namespace attn_kernels::cuda
