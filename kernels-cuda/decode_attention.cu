// DecodeAttention on NVIDIA GPUs. One kernel family, two schedules (chosen in plan()):
//
//   chapter-G  one block per query vector, G warps; warp w visits positions w, w+G, ...
//              (the chapter's design: no GQA sharing, no context split)
//   split-gqa  one block per (key/value head, tile of up to 4 query vectors of that head,
//              context chunk): each K/V row leaves HBM once per step for all query heads that
//              share it, and the context is split (flash-decoding) so every SM has warps; a
//              second small kernel merges the chunks.
//
// Within a block every lane keeps D/32 scaled query values per vector in registers, warps run
// the online-softmax recurrence over their positions, then combine through shared memory: the
// first warp computes the common max and rescale factors, one thread the denominator, and the
// threads each combine output dimensions. bf16/f16 are loaded and stored directly; arithmetic
// is float32. No MLX headers here (nvcc cannot compile them); see eval_gpu_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "decode_attention_cuda.h"

namespace attn_kernels::cuda {
namespace {

constexpr float kNegInf = -INFINITY;
constexpr int kUnroll = 4;

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

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// Lane `lane` holds dims lane*DPL .. lane*DPL+DPL-1 of a row; contiguous rows load as one
// DPL-element vector per lane (8 bytes for bf16 at D=128), coalesced across the warp.
template <typename T, int DPL>
__device__ __forceinline__ void load_fragment(
    float (&dst)[DPL], const T* row, int lane, int D, int64_t stride) {
  const int d0 = lane * DPL;
  if (stride == 1 && d0 + DPL <= D && (reinterpret_cast<uintptr_t>(row + d0) % (DPL * sizeof(T))) == 0) {
    struct alignas(DPL * sizeof(T)) Vec {
      T v[DPL];
    };
    const Vec vec = *reinterpret_cast<const Vec*>(row + d0);
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      dst[e] = to_float(vec.v[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      dst[e] = d0 + e < D ? to_float(row[(d0 + e) * stride]) : 0.0f;
    }
  }
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

// grid: (kv_rows * tiles, splits); block: G warps. Shared memory: G * VPB * (D + 2) floats plus
// VPB denominators. With splits == 1 the block writes the output; otherwise it writes
// (max, denominator, unnormalised accumulator) per vector to `partials` for merge().
template <typename T, int DPL, int VPB>
__global__ void attend(DecodeProblem p, float* partials, int chunk) {
  extern __shared__ float smem[];
  const int G = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int D = p.head_dim, L = p.query_len, S = p.context;
  const int vectors = p.group * L;
  const int tiles = (vectors + VPB - 1) / VPB;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  const int begin = split * chunk, end = min(S, begin + chunk);

  const T* Q = static_cast<const T*>(p.queries);
  const T* K = static_cast<const T*>(p.keys) + kv_row * p.k_strides[0];
  const T* V = static_cast<const T*>(p.values) + kv_row * p.v_strides[0];

  float q[VPB][DPL], acc[VPB][DPL], m[VPB], l[VPB];
  int last[VPB];  // last visible position (causal), -1 for an unused slot
  int64_t mask_base[VPB];
#pragma unroll
  for (int v = 0; v < VPB; ++v) {
    const int r = tile * VPB + v;
    const int row = kv_row * p.group + r / L, i = r % L;
    last[v] = r < vectors ? (p.causal ? S - L + i : S - 1) : -1;
    mask_base[v] = int64_t{row} * p.m_strides[0] + int64_t{i} * p.m_strides[1];
    if (r < vectors) {
      load_fragment<T, DPL>(q[v], Q + row * p.q_strides[0] + i * p.q_strides[1], lane, D, p.q_strides[2]);
    } else {
#pragma unroll
      for (int e = 0; e < DPL; ++e) q[v][e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      q[v][e] *= p.scale;
      acc[v][e] = 0.0f;
    }
    m[v] = kNegInf;
    l[v] = 0.0f;
  }

  // kUnroll positions per step (w, w+G, w+2G, ...): their K and V loads are all in flight
  // before the first score is needed.
  for (int j0 = begin + warp; j0 < end; j0 += G * kUnroll) {
    float k[kUnroll][DPL], val[kUnroll][DPL];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = min(j0 + u * G, end - 1);
      load_fragment<T, DPL>(k[u], K + j * p.k_strides[1], lane, D, p.k_strides[2]);
      load_fragment<T, DPL>(val[u], V + j * p.v_strides[1], lane, D, p.v_strides[2]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * G;
      if (j >= end) break;
#pragma unroll
      for (int v = 0; v < VPB; ++v) {
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) partial += q[v][e] * k[u][e];
        float score = warp_sum(partial);
        if (j > last[v]) continue;
        if (p.mask) score += mask_value(p, mask_base[v] + int64_t{j} * p.m_strides[2]);
        if (score == kNegInf) continue;
        // new_max = max(m, s); both factors computed once, applied to l and every dimension.
        const float new_max = fmaxf(m[v], score);
        const float old_factor = __expf(m[v] - new_max);
        const float weight = __expf(score - new_max);
        l[v] = l[v] * old_factor + weight;
        m[v] = new_max;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[v][e] = acc[v][e] * old_factor + weight * val[u][e];
      }
    }
  }

  // Warp partials to shared memory: [warp][vector][max, denominator, D accumulators].
  const int stride = D + 2;
  float* denominators = smem + G * VPB * stride;
#pragma unroll
  for (int v = 0; v < VPB; ++v) {
    float* slot = smem + (warp * VPB + v) * stride;
    if (lane == 0) {
      slot[0] = m[v];
      slot[1] = l[v];
    }
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane * DPL + e;
      if (d < D) slot[2 + d] = acc[v][e];
    }
  }
  __syncthreads();
  // The first warp: common max, each warp's rescale factor (stored over its max), and one lane
  // the denominator.
  if (warp == 0) {
    for (int v = 0; v < VPB; ++v) {
      const float mw = lane < G ? smem[(lane * VPB + v) * stride] : kNegInf;
      const float common = warp_max(mw);
      const float factor = mw == kNegInf ? 0.0f : __expf(mw - common);
      const float lw = lane < G ? smem[(lane * VPB + v) * stride + 1] : 0.0f;
      const float total = warp_sum(lw * factor);
      __syncwarp();
      if (lane < G) smem[(lane * VPB + v) * stride] = factor;
      if (lane == 0) {
        denominators[2 * v] = common;
        denominators[2 * v + 1] = total;
      }
    }
  }
  __syncthreads();
  // Threads combine output dimensions across warps.
  for (int idx = threadIdx.x; idx < VPB * D; idx += blockDim.x) {
    const int v = idx / D, d = idx % D;
    const int r = tile * VPB + v;
    if (r >= vectors) continue;
    float sum = 0.0f;
    for (int w = 0; w < G; ++w) {
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
CUfunction handle(const void* kernel) {
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, kernel) != cudaSuccess) {
    throw std::runtime_error("[decode_attention] cudaGetFuncBySymbol failed");
  }
  return reinterpret_cast<CUfunction>(f);
}

template <typename T, int VPB>
const void* attend_kernel(int dpl) {
  switch (dpl) {
    case 1: return reinterpret_cast<const void*>(&attend<T, 1, VPB>);
    case 2: return reinterpret_cast<const void*>(&attend<T, 2, VPB>);
    case 4: return reinterpret_cast<const void*>(&attend<T, 4, VPB>);
    default: return reinterpret_cast<const void*>(&attend<T, 8, VPB>);
  }
}

template <typename T>
const void* attend_kernel(int dpl, int vpb) {
  return vpb == 1 ? attend_kernel<T, 1>(dpl) : attend_kernel<T, 4>(dpl);
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
  if (name == "chapter-8") return Schedule::chapter8;
  if (name == "chapter-16") return Schedule::chapter16;
  if (name == "chapter-32") return Schedule::chapter32;
  throw std::invalid_argument(
      "[decode_attention] unknown schedule '" + name +
      "': use auto, split-gqa, chapter-8, chapter-16 or chapter-32");
}

Plan plan(const DecodeProblem& p, Schedule schedule) {
  Plan plan{};
  const int dpl_needed = (p.head_dim + 31) / 32;
  const int dpl = dpl_needed <= 1 ? 1 : dpl_needed <= 2 ? 2 : dpl_needed <= 4 ? 4 : 8;
  const int vectors = p.group * p.query_len;
  int warps, vpb, splits = 1;
  if (schedule == Schedule::split_gqa) {
    vpb = vectors >= 4 ? 4 : 1;
    warps = 8;
    const int tiles = (vectors + vpb - 1) / vpb;
    const int blocks = p.kv_rows * tiles;
    // About two unrolled steps per warp, but no more than four waves of blocks; a context
    // that needs at most two chunks is not split (the merge launch costs more).
    const int per_block = warps * kUnroll * 2;
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
  plan.attend_smem = static_cast<uint32_t>((warps * vpb * (p.head_dim + 2) + 2 * vpb) * sizeof(float));
  plan.partial_floats = splits > 1 ? size_t(p.kv_rows) * vectors * splits * (p.head_dim + 2) : 0;
  plan.merge_blocks = p.kv_rows * vectors;
  plan.merge_threads = std::min(p.head_dim, 256);
  switch (p.dtype) {
    case ElementType::float32:
      plan.attend = handle(attend_kernel<float>(dpl, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<float>));
      break;
    case ElementType::float16:
      plan.attend = handle(attend_kernel<__half>(dpl, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<__half>));
      break;
    default:
      plan.attend = handle(attend_kernel<__nv_bfloat16>(dpl, vpb));
      plan.merge = handle(reinterpret_cast<const void*>(&merge<__nv_bfloat16>));
      break;
  }
  return plan;
}

}  // namespace attn_kernels::cuda
