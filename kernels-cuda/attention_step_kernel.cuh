// AttentionStep's preprocessing on NVIDIA GPUs: per (token, head), one warp (or half warp)
// normalises the q or k row (RMSNorm in MLX's roundings; only with qk_norm), rotates it (RoPE,
// non-traditional) and stores it (q to the attention's scratch, k into the cache) and copies v
// into the cache; with a quantized cache (StepProblem::bits, AttentionStepQuantized) k and v are
// quantized into it as MLX's CUDA mx.quantize does (quantize_row). step_preprocess runs it for
// every row as its own kernel (attention_step.cu), a warp per row; attend_mma_step
// (decode_attention_mma.cuh) runs the same row code for the rows one attention block needs, a
// half warp per row, so that both paths round alike. Included by nvcc's .cu files and by
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

// RoPE's rotation at `position` of a pair with inverse frequency inv_freq (StepProblem's, from the
// host): the angle as MLX forms it (the float32 product position * inv_freq), its cosine and sine
// in float32 (no double, no table of rotations: each lane takes its own pairs'). The angle (up to
// 2^17 at 131072 positions) loses its multiples of pi/2 in three parts (Cody-Waite: the first
// product is exact under the FMA, the quotient has at most 17 bits), and Taylor polynomials on
// [-pi/4, pi/4] (truncation below 2e-9) give the rest: within 7.1e-8 (1.2 units of 2^-24) of the
// double cosine and sine of the same float angle at every position up to 131080 and pair of D = 64
// and 128, bases 1e4, 5e5 and 1e6 (checked on the host). sincosf is no option: under
// --use_fast_math it is the unreduced MUFU approximation.
__device__ __forceinline__ float2 rope_cos_sin(int position, float inv_freq) {
  const float a = static_cast<float>(position) * inv_freq;
  const float k = rintf(a * 0.636619772f);  // the nearest multiple of pi/2
  float r = fmaf(-k, 1.57079637f, a);       // pi/2 = 1.57079637f - 4.37113883e-8f - 1.71512451e-15f
  r = fmaf(-k, -4.37113883e-8f, r);
  r = fmaf(-k, -1.71512451e-15f, r);
  const float r2 = r * r;
  const float s = fmaf(
      r * r2, fmaf(r2, fmaf(r2, fmaf(r2, 1.0f / 362880, -1.0f / 5040), 1.0f / 120), -1.0f / 6), r);
  const float c = fmaf(
      r2,
      fmaf(r2, fmaf(r2, fmaf(r2, fmaf(r2, -1.0f / 3628800, 1.0f / 40320), -1.0f / 720), 1.0f / 24),
           -0.5f),
      1.0f);
  switch (static_cast<int>(k) & 3) {  // the angle is r + k pi/2
    case 0: return float2{c, s};
    case 1: return float2{-s, c};
    case 2: return float2{-c, -s};
    default: return float2{s, -c};
  }
}

// One row of a quantized cache at `position` (c: 0 keys, 1 values) from the warp's D values,
// lane l holding dimensions l + 32m in x[m] (m < D / 32), as MLX's CUDA mx.quantize computes
// it (affine_quantize.cu): each group's maximum starts at 0, the divisions round correctly
// (this file is built with fast math), halves round away from zero, a code is clamped to
// [0, 2^bits - 1]; 32 / bits neighbouring lanes OR their codes into one word.
template <typename T, int kM>
__device__ __forceinline__ void quantize_row(const StepProblem& p, const float (&x)[kM], int lane,
                                             int b, int h, int position, int c) {
  const int M = p.head_dim / 32, per_group = p.group_size / 32, per_word = 32 / p.bits;
  const float n_bins = static_cast<float>((1 << p.bits) - 1);
  const int64_t* cs = c == 0 ? p.kc_strides : p.vc_strides;
  uint32_t* codes = static_cast<uint32_t*>(c == 0 ? p.k_cache : p.v_cache) + b * cs[0] +
                    h * cs[1] + position * cs[2];
  const int64_t at = b * p.sb_strides[0] + h * p.sb_strides[1] + position * p.sb_strides[2];
  T* scales = static_cast<T*>(c == 0 ? p.k_scales : p.v_scales) + at;
  T* biases = static_cast<T*>(c == 0 ? p.k_biases : p.v_biases) + at;
  float lo[kM], hi[kM];  // each m's extremes over the warp
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    lo[m] = m < M ? x[m] : 3.402823466e38f;
    hi[m] = m < M ? fmaxf(x[m], 0.0f) : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      lo[m] = fminf(lo[m], __shfl_xor_sync(0xffffffffu, lo[m], o));
      hi[m] = fmaxf(hi[m], __shfl_xor_sync(0xffffffffu, hi[m], o));
    }
  }
  auto divide = [](float n, float d) { return __fdiv_rn(n, d); };
  auto round = [](float v) { return roundf(v); };
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    if (m >= M) break;  // M is the warp's: the shuffles below stay converged
    const int first = m / per_group * per_group;
    float w_min = 3.402823466e38f, w_max = 0.0f;
#pragma unroll
    for (int n = 0; n < kM; ++n) {
      if (n >= first && n < first + per_group) {
        w_min = fminf(w_min, lo[n]);
        w_max = fmaxf(w_max, hi[n]);
      }
    }
    const AffineGroup a = affine_group(w_min, w_max, p.bits, divide, round);
    const float code = fminf(fmaxf(roundf(__fdiv_rn(x[m] - a.bias, a.scale)), 0.0f), n_bins);
    const int slot = lane % per_word;
    unsigned word = static_cast<unsigned>(code) << (p.bits * slot);
    for (int o = 1; o < per_word; o *= 2) word |= __shfl_xor_sync(0xffffffffu, word, o);
    if (slot == 0) codes[(lane + 32 * m) / per_word * cs[3]] = word;
    if (lane == 0 && m == first) {
      const int g = 32 * m / p.group_size;
      scales[g * p.sb_strides[3]] = from_float<T>(a.scale);
      biases[g * p.sb_strides[3]] = from_float<T>(a.bias);
    }
  }
}

// kLanes lanes (32: a warp; 16: a half warp) prepare token i of batch b for head `head` of the
// Hq + Hkv: a q head to q_dst (D contiguous values), a k head into the k cache at offset + i with
// its v row copied into the v cache. All kLanes lanes call it; with kLanes = 16 both halves of
// the warp must (the shuffles name all 32 lanes): a half with no row passes active = false.
// Pair j belongs to slot j % 32, as in the 32-lane form; a half warp's lane holds slots lane and
// lane + 16 and adds their sums first, which is the 32-lane butterfly's first step: both forms
// round alike. kMaxD: the largest D the caller passes (sizes the lanes' registers).
template <typename T, int kLanes = 32, int kMaxD = 256>
__device__ __forceinline__ void preprocess_row(const StepProblem& p, int b, int i, int head,
                                               int lane, T* q_dst, bool active = true) {
  static_assert(kLanes == 32 || kLanes == 16);
  constexpr int kSlots = 32 / kLanes, kPairs = (kMaxD / 2 + 31) / 32;  // per slot
  // Each batch row at its own place and RoPE position (the same for all without per-row ranges).
  const int D = p.head_dim, half = D / 2, position = p.write_position(b) + i;
  const int rotation = p.rope_position(b) + i;  // the position RoPE rotates by
  const bool is_q = head < p.q_heads;
  const int h = is_q ? head : head - p.q_heads;
  const int64_t* s = is_q ? p.q_strides : p.k_strides;
  const T* x = static_cast<const T*>(is_q ? p.q : p.k) + b * s[0] + i * s[1] + int64_t{h} * D * s[2];
  const T* w = static_cast<const T*>(is_q ? p.q_weight : p.k_weight);
  // Every load first (the row, its norm weights, a k row's v row): one memory round trip before
  // the stores, not one per kind.
  float lo[kSlots][kPairs], hi[kSlots][kPairs], w_lo[kSlots][kPairs], w_hi[kSlots][kPairs];
  float part[kSlots];
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
    part[u] = 0.0f;
#pragma unroll
    for (int t = 0; t < kPairs; ++t) {
      const int j = lane + kLanes * u + 32 * t;
      const bool here = active && j < half;
      lo[u][t] = here ? to_float(x[j * s[2]]) : 0.0f;
      hi[u][t] = here ? to_float(x[(j + half) * s[2]]) : 0.0f;
      w_lo[u][t] = here && p.qk_norm ? to_float(w[j]) : 0.0f;
      w_hi[u][t] = here && p.qk_norm ? to_float(w[j + half]) : 0.0f;
      part[u] += lo[u][t] * lo[u][t] + hi[u][t] * hi[u][t];
    }
  }
  constexpr int kV = kMaxD / kLanes;  // a lane's values of the v row
  T v_row[kV];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + i * p.v_strides[1] +
               int64_t{h} * D * p.v_strides[2];
#pragma unroll
  for (int e = 0; e < kV; ++e) {
    const int d = lane + kLanes * e;
    if (active && !is_q && d < D) v_row[e] = v[d * p.v_strides[2]];
  }
  // The rotations next in the source: arithmetic the loads' latency can hide.
  float2 rot[kSlots][kPairs];
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
#pragma unroll
    for (int t = 0; t < kPairs; ++t) {
      const int j = lane + kLanes * u + 32 * t;
      rot[u][t] = active && j < half ? rope_cos_sin(rotation, p.inv_freq[j]) : float2{};
    }
  }
  float sum = part[0];
#pragma unroll
  for (int u = 1; u < kSlots; ++u) sum += part[u];
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  // A k head whose row's position is outside the caches (a bad per-row offset) writes nothing.
  if (!active || (!is_q && (position < 0 || position >= p.capacity))) return;
  const float r = p.qk_norm ? rsqrtf(sum / D + p.eps) : 1.0f;
  if constexpr (kLanes == 32) {
    if (p.bits && !is_q) {  // a quantized cache: the rows in the dtype, then quantized
      constexpr int kM = kMaxD / 32;
      float row[kM] = {};
#pragma unroll
      for (int t = 0; t < kPairs; ++t) {
        const int j = lane + 32 * t;
        if (j >= half) break;
        float a = lo[0][t], c = hi[0][t];
        if (p.qk_norm) {
          a = to_float(from_float<T>(w_lo[0][t] * to_float(from_float<T>(a * r))));
          c = to_float(from_float<T>(w_hi[0][t] * to_float(from_float<T>(c * r))));
        }
        const float2 cs = rot[0][t];
        row[t] = to_float(from_float<T>(a * cs.x - c * cs.y));  // dimension j = lane + 32 t
        row[t + half / 32] = to_float(from_float<T>(a * cs.y + c * cs.x));  // j + half
      }
      quantize_row<T>(p, row, lane, b, h, position, 0);
#pragma unroll
      for (int e = 0; e < kV; ++e) row[e] = e < D / 32 ? to_float(v_row[e]) : 0.0f;
      quantize_row<T>(p, row, lane, b, h, position, 1);
      return;
    }
  }
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
  for (int u = 0; u < kSlots; ++u) {
#pragma unroll
    for (int t = 0; t < kPairs; ++t) {
      const int j = lane + kLanes * u + 32 * t;
      if (j >= half) break;
      // mx.fast.rms_norm's roundings: x·r to T, times the weight in T (exact in float, then
      // rounded once more), then RoPE in float32, rounded once. Without qk_norm: x as given.
      float a = lo[u][t], c = hi[u][t];
      if (p.qk_norm) {
        a = to_float(from_float<T>(w_lo[u][t] * to_float(from_float<T>(a * r))));
        c = to_float(from_float<T>(w_hi[u][t] * to_float(from_float<T>(c * r))));
      }
      const float2 cs = rot[u][t];
      dst[j * ds] = from_float<T>(a * cs.x - c * cs.y);
      dst[(j + half) * ds] = from_float<T>(a * cs.y + c * cs.x);
    }
  }
  if (!is_q) {
    T* vdst = static_cast<T*>(p.v_cache) + b * p.vc_strides[0] + h * p.vc_strides[1] +
              position * p.vc_strides[2];
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      const int d = lane + kLanes * e;
      if (d < D) vdst[d * p.vc_strides[3]] = v_row[e];
    }
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
  preprocess_row<T>(p, b, i, head, lane, q_dst);
}

}  // namespace attn_kernels::cuda::step
