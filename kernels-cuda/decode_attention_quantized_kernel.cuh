// The device code of DecodeAttentionQuantized (see decode_attention_quantized.cu for the design):
// included by that file for nvcc, and by emulation/run_decode_attention_quantized.cpp, which
// runs it on the CPU with every thread of a block as a host thread (emulation/cuda_emu.h).
#pragma once

#include <cmath>
#include <cstdint>

// Conversions, finish() (the warps' combine, the split merge by the last block to arrive) and
// the arrival counters: DecodeAttention's, on states of the same layout.
#include "decode_attention_common.cuh"
#include "quantized_problem.h"

namespace attn_kernels::cuda::quantized {

constexpr int kVectors = 4;   // query vectors per block
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// Shared memory of a kernel whose blocks hold `vpb` vectors, before its own stages.
__host__ __device__ constexpr int states_smem_bytes(int vpb, int D) {
  return finish_smem_floats(kWarps, vpb, D) * int(sizeof(float));
}

// Code c (< 2^23) as a float, exactly: the bits of 2^23 + c, minus 2^23.
__device__ __forceinline__ float code_float(uint32_t bits_of_2p23_plus_c) {
  return __uint_as_float(bits_of_2p23_plus_c) - 8388608.0f;
}

// A lane's VALUES codes as floats. 8-bit: byte b of word k is code 4k + b. 4-bit: nibble i of
// word k is code 8k + i.
template <int BITS, int VALUES>
__device__ __forceinline__ void decode(float (&c)[VALUES], const uint32_t (&w)[VALUES * BITS / 32]) {
  if constexpr (BITS == 8) {
#pragma unroll
    for (int k = 0; k < VALUES / 4; ++k) {
      c[4 * k + 0] = code_float(__byte_perm(w[k], 0x4B000000u, 0x7540));
      c[4 * k + 1] = code_float(__byte_perm(w[k], 0x4B000000u, 0x7541));
      c[4 * k + 2] = code_float(__byte_perm(w[k], 0x4B000000u, 0x7542));
      c[4 * k + 3] = code_float(__byte_perm(w[k], 0x4B000000u, 0x7543));
    }
  } else {
#pragma unroll
    for (int k = 0; k < VALUES / 8; ++k) {
#pragma unroll
      for (int i = 0; i < 8; ++i) c[8 * k + i] = code_float(((w[k] >> (4 * i)) & 15u) | 0x4B000000u);
    }
  }
}

// One lane's words of one row: one 4-, 8- or 16-byte load where the rows allow, word by word
// (through the last axis' stride) otherwise; zeros for lanes past D.
template <int kWords>
__device__ __forceinline__ void load_words(uint32_t (&w)[kWords], const uint32_t* row,
                                           int first_word, int64_t stride, bool vector_loads,
                                           bool active) {
  if (!active) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = 0u;
  } else if (vector_loads) {
    if constexpr (kWords == 4) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(row + first_word));
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (kWords == 2) {
      const uint2 x = __ldg(reinterpret_cast<const uint2*>(row + first_word));
      w[0] = x.x, w[1] = x.y;
    } else {
      w[0] = __ldg(row + first_word);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = row[(first_word + k) * stride];
  }
}

// True when every row of `codes` can be read with aligned `bytes`-byte loads.
__device__ __forceinline__ bool rows_aligned(const uint32_t* codes, const int64_t* strides,
                                             int bytes) {
  const int words = bytes / 4;
  return strides[3] == 1 && reinterpret_cast<uintptr_t>(codes) % bytes == 0 &&
         strides[0] % words == 0 && strides[1] % words == 0 && strides[2] % words == 0;
}

// grid (kv_rows * tiles, splits), kThreads threads, 4 blocks per SM (128 registers); shared
// memory: kWarps * kVectors states. Each lane holds 8 values of a row, each walker takes 2
// positions per step with one rescale ("8x2"; 16 values a lane, 4 positions a step, and the next
// step's rows loaded during this one were slower on the H200: docs/quantized-kv-cuda.md).
template <typename T, int BITS, int LPR>
__global__ void __launch_bounds__(kThreads, 4)
    attend_quantized(QuantizedProblem p, float* partials, int chunk, unsigned slot) {
  ATTN_SHARED_FLOATS(smem);
  constexpr int kValues = 8, kPositions = 2;
  constexpr int kWords = kValues * BITS / 32;
  constexpr int kWalkers = kThreads / LPR;
  const int lane = threadIdx.x % 32, sub = lane % LPR, warp = threadIdx.x / 32;
  const int walker = threadIdx.x / LPR;
  const int D = p.head_dim, L = p.query_len, S = p.context, vectors = p.group * L;
  const int tiles = (vectors + kVectors - 1) / kVectors;
  const int kv_row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int split = blockIdx.y, splits = gridDim.y;
  // The chunk's positions inside the batch row's range (every position without per-row ranges).
  const CacheRange range = p.range(kv_row / p.kv_heads);
  const int begin = max(split * chunk, range.start);
  const int end = min(min(S, split * chunk + chunk), range.end);
  const int d0 = sub * kValues, first_word = sub * kWords;
  const bool active = d0 < D;
  const int group = d0 / p.group_size;

  const uint32_t* k_codes = p.k_codes + p.kv_offset(p.k_strides[0], kv_row);
  const T* k_scales = static_cast<const T*>(p.k_scales) + p.kv_offset(p.k_strides[1], kv_row) +
                      group * p.k_strides[1][3];
  const T* k_biases = static_cast<const T*>(p.k_biases) + p.kv_offset(p.k_strides[2], kv_row) +
                      group * p.k_strides[2][3];
  const uint32_t* v_codes = p.v_codes + p.kv_offset(p.v_strides[0], kv_row);
  const T* v_scales = static_cast<const T*>(p.v_scales) + p.kv_offset(p.v_strides[1], kv_row) +
                      group * p.v_strides[1][3];
  const T* v_biases = static_cast<const T*>(p.v_biases) + p.kv_offset(p.v_strides[2], kv_row) +
                      group * p.v_strides[2][3];
  const bool k_vector = rows_aligned(p.k_codes, p.k_strides[0], kWords * 4);
  const bool v_vector = rows_aligned(p.v_codes, p.v_strides[0], kWords * 4);

  float q[kVectors][kValues], acc[kVectors][kValues];
  float q_sum[kVectors], bias_acc[kVectors], m[kVectors], l[kVectors];
  int last[kVectors];  // last visible position (causal), -1 for an unused slot
  int64_t mask_base[kVectors];
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const int r = tile * kVectors + v;
    const int row = kv_row * p.group + r / L, i = r % L;
    last[v] = r < vectors ? visible_keys(range, L, i, p.causal).last : -1;
    mask_base[v] = r < vectors ? p.mask_offset(row, i) : 0;
    const T* qrow = static_cast<const T*>(p.queries) + (r < vectors ? p.q_offset(row, i) : 0);
    q_sum[v] = 0.0f;
#pragma unroll
    for (int e = 0; e < kValues; ++e) {
      q[v][e] = r < vectors && active ? to_float(qrow[(d0 + e) * p.q_strides[3]]) * p.scale : 0.0f;
      q_sum[v] += q[v][e];
      acc[v][e] = 0.0f;
    }
    bias_acc[v] = 0.0f;
    m[v] = kNegInf;
    l[v] = 0.0f;
  }

  constexpr int kStep = kPositions * kWalkers;

  for (int base = begin; base < end; base += kStep) {
    int j[kPositions];
    bool in[kPositions];
#pragma unroll
    for (int t = 0; t < kPositions; ++t) {
      j[t] = base + t * kWalkers + walker;
      in[t] = j[t] < end;
    }
    uint32_t kw[kPositions][kWords], vw[kPositions][kWords];
    float ks[kPositions], kb[kPositions], vs[kPositions], vb[kPositions];
#pragma unroll
    for (int t = 0; t < kPositions; ++t) {
      const int at = in[t] ? j[t] : begin;  // a row that exists; its weight is zero
      load_words<kWords>(kw[t], k_codes + at * p.k_strides[0][2], first_word, p.k_strides[0][3],
                         k_vector, active);
      load_words<kWords>(vw[t], v_codes + at * p.v_strides[0][2], first_word, p.v_strides[0][3],
                         v_vector, active);
      ks[t] = active ? to_float(k_scales[at * p.k_strides[1][2]]) : 0.0f;
      kb[t] = active ? to_float(k_biases[at * p.k_strides[2][2]]) : 0.0f;
      vs[t] = active ? to_float(v_scales[at * p.v_strides[1][2]]) : 0.0f;
      vb[t] = active ? to_float(v_biases[at * p.v_strides[2][2]]) : 0.0f;
    }
    float score[kPositions][kVectors];
#pragma unroll
    for (int t = 0; t < kPositions; ++t) {
      float c[kValues];
      decode<BITS, kValues>(c, kw[t]);
#pragma unroll
      for (int v = 0; v < kVectors; ++v) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kValues; ++e) dot = fmaf(q[v][e], c[e], dot);
        score[t][v] = fmaf(ks[t], dot, kb[t] * q_sum[v]);
      }
    }
#pragma unroll
    for (int offset = LPR / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int t = 0; t < kPositions; ++t) {
#pragma unroll
        for (int v = 0; v < kVectors; ++v) {
          score[t][v] += __shfl_xor_sync(0xffffffffu, score[t][v], offset);
        }
      }
    }
    float weight[kPositions][kVectors];
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
#pragma unroll
      for (int t = 0; t < kPositions; ++t) {
        float s = score[t][v];
        if (!in[t] || j[t] > last[v]) {
          s = kNegInf;
        } else if (p.mask) {
          s = apply_mask(p, mask_base[v] + int64_t{j[t]} * p.m_strides[3], s);
        }
        score[t][v] = s;
      }
      float tile_max = score[0][v];
#pragma unroll
      for (int t = 1; t < kPositions; ++t) tile_max = fmaxf(tile_max, score[t][v]);
      if (tile_max > m[v]) {  // rescale only when the running max grows
        const float factor = m[v] == kNegInf ? 0.0f : __expf(m[v] - tile_max);
        m[v] = tile_max;
        l[v] *= factor;
        bias_acc[v] *= factor;
#pragma unroll
        for (int e = 0; e < kValues; ++e) acc[v][e] *= factor;
      }
#pragma unroll
      for (int t = 0; t < kPositions; ++t) {
        weight[t][v] = score[t][v] == kNegInf ? 0.0f : __expf(score[t][v] - m[v]);
        l[v] += weight[t][v];
      }
    }
#pragma unroll
    for (int t = 0; t < kPositions; ++t) {
      float c[kValues];
      decode<BITS, kValues>(c, vw[t]);
#pragma unroll
      for (int v = 0; v < kVectors; ++v) {
        const float ws = weight[t][v] * vs[t];
        bias_acc[v] = fmaf(weight[t][v], vb[t], bias_acc[v]);
#pragma unroll
        for (int e = 0; e < kValues; ++e) acc[v][e] = fmaf(ws, c[e], acc[v][e]);
      }
    }
  }

  // The walkers of a warp (lanes that differ above log2(LPR)) into one state.
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
#pragma unroll
    for (int e = 0; e < kValues; ++e) acc[v][e] += bias_acc[v];
#pragma unroll
    for (int offset = LPR; offset < 32; offset *= 2) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[v], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[v], offset);
      const float common = fmaxf(m[v], m_other);
      const float f_self = m[v] == kNegInf ? 0.0f : __expf(m[v] - common);
      const float f_other = m_other == kNegInf ? 0.0f : __expf(m_other - common);
      l[v] = l[v] * f_self + l_other * f_other;
#pragma unroll
      for (int e = 0; e < kValues; ++e) {
        const float a_other = __shfl_xor_sync(0xffffffffu, acc[v][e], offset);
        acc[v][e] = acc[v][e] * f_self + a_other * f_other;
      }
      m[v] = common;
    }
  }
  const int stride = partial_stride(D);
  if (lane < LPR && active) {
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
      float* state = smem + (warp * kVectors + v) * stride;
      if (sub == 0) {
        state[0] = m[v];
        state[1] = l[v];
      }
#pragma unroll
      for (int e = 0; e < kValues; ++e) state[4 + d0 + e] = acc[v][e];
    }
  }
  __syncthreads();

  finish<T, kVectors, false>(p, smem, partials, kv_row, tile, split, splits, slot);
}

}  // namespace attn_kernels::cuda::quantized
