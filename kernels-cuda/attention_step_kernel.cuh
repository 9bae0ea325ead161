// AttentionStep's preprocessing on NVIDIA GPUs: per (token, head), one warp normalises the q or k
// row (RMSNorm in MLX's roundings; only with qk_norm), rotates it (RoPE, non-traditional) and
// stores it (q to the attention's scratch, k into the cache) and copies v into the cache.
// step_preprocess runs it for every row as its own kernel (attention_step.cu); attend_mma_step
// (decode_attention_mma.cuh) runs the same warp code for the rows one attention block needs, so
// that both paths round alike. Included by nvcc's .cu files and by
// emulation/run_attention_step.cpp (cuda_emu.h).
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cmath>
#include <cstdint>

#include "step_problem.h"

namespace attn_kernels::cuda::step {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

constexpr int kMaxPairsPerLane = 256 / 2 / 32;  // kMaxHeadDim / 2 pairs over 32 lanes

// RoPE's rotation of pair j (of D/2) at `position`: the angle as MLX forms it (rope_angle), its
// cosine and sine in double, each rounded once to float32.
__device__ __forceinline__ float2 rope_cos_sin(int position, int j, int half, float log2_base) {
  double sn, cs;
  sincos(static_cast<double>(rope_angle(position, j, half, log2_base)), &sn, &cs);
  return float2{static_cast<float>(cs), static_cast<float>(sn)};
}

// One warp (all 32 lanes call it) prepares token i of batch b for head `head` of the Hq + Hkv:
// a q head to q_dst (D contiguous values), a k head into the k cache at offset + i with its v row
// copied into the v cache. `rotation`: token i's rope_cos_sin of every pair, or nullptr (the lanes
// compute their pairs').
template <typename T>
__device__ __forceinline__ void preprocess_row(const StepProblem& p, int b, int i, int head,
                                               int lane, T* q_dst, const float2* rotation) {
  const int D = p.head_dim, half = D / 2, position = p.offset + i;
  const bool is_q = head < p.q_heads;
  const int h = is_q ? head : head - p.q_heads;
  const int64_t* s = is_q ? p.q_strides : p.k_strides;
  const T* x = static_cast<const T*>(is_q ? p.q : p.k) + b * s[0] + i * s[1] + int64_t{h} * D * s[2];
  const T* w = static_cast<const T*>(is_q ? p.q_weight : p.k_weight);
  float lo[kMaxPairsPerLane], hi[kMaxPairsPerLane];
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxPairsPerLane; ++t) {
    const int j = lane + 32 * t;
    lo[t] = j < half ? to_float(x[j * s[2]]) : 0.0f;
    hi[t] = j < half ? to_float(x[(j + half) * s[2]]) : 0.0f;
    sum += lo[t] * lo[t] + hi[t] * hi[t];
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  const float r = p.qk_norm ? rsqrtf(sum / D + p.eps) : 1.0f;
  T* dst;
  int64_t ds;
  if (is_q) {
    dst = q_dst;
    ds = 1;
  } else {
    dst = static_cast<T*>(p.k_cache) + b * p.kc_strides[0] + h * p.kc_strides[1] +
          position * p.kc_strides[2];
    ds = p.kc_strides[3];
  }
#pragma unroll
  for (int t = 0; t < kMaxPairsPerLane; ++t) {
    const int j = lane + 32 * t;
    if (j >= half) break;
    // mx.fast.rms_norm's roundings: x·r to T, times the weight in T (exact in float, then
    // rounded once more), then RoPE in float32, rounded once. Without qk_norm: x as given.
    float a = lo[t], c = hi[t];
    if (p.qk_norm) {
      a = to_float(from_float<T>(to_float(w[j]) * to_float(from_float<T>(a * r))));
      c = to_float(from_float<T>(to_float(w[j + half]) * to_float(from_float<T>(c * r))));
    }
    const float2 cs = rotation ? rotation[j] : rope_cos_sin(position, j, half, p.log2_base);
    const float cf = cs.x, sf = cs.y;
    dst[j * ds] = from_float<T>(a * cf - c * sf);
    dst[(j + half) * ds] = from_float<T>(a * sf + c * cf);
  }
  if (!is_q) {
    const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + i * p.v_strides[1] +
                 int64_t{h} * D * p.v_strides[2];
    T* vdst = static_cast<T*>(p.v_cache) + b * p.vc_strides[0] + h * p.vc_strides[1] +
              position * p.vc_strides[2];
    for (int d = lane; d < D; d += 32) vdst[d * p.vc_strides[3]] = v[d * p.v_strides[2]];
  }
}

// grid: (B * L, heads / warps per block); one warp per (token, head).
template <typename T>
__global__ void step_preprocess(StepProblem p) {
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
  if (head >= p.q_heads + p.kv_heads) return;
  const int b = blockIdx.x / p.length, i = blockIdx.x % p.length;
  T* q_dst = head < p.q_heads ? static_cast<T*>(p.q_out) +
                                   ((int64_t{b} * p.q_heads + head) * p.length + i) * p.head_dim
                             : nullptr;
  preprocess_row<T>(p, b, i, head, lane, q_dst, nullptr);
}

}  // namespace attn_kernels::cuda::step
