// The vector helpers of the CPU kernels' bodies (cpu_kernel_body.h: attention, cpu_linear_body.h:
// linear layers), written once in GCC/Clang vector extensions for the path the including file
// compiles (ATTN_CPU_PATH, ATTN_CPU_WIDTH floats per register): loads and stores, and the
// widening of float32, float16 and bfloat16 pairs of vectors.
//
// Everything here is internal (anonymous namespace) or a builtin, never a standard-library
// template: see cpu_kernel_body.h.
#pragma once

#include <cstdint>
#include <utility>

#if defined(__aarch64__)
#include <arm_neon.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_kernel.h"
#include "cpu_scalar.h"

#if !defined(ATTN_CPU_PATH) || !defined(ATTN_CPU_WIDTH)
#error "define ATTN_CPU_PATH and ATTN_CPU_WIDTH before including"
#endif

#define ATTN_CONCAT2(a, b) a##b
#define ATTN_CONCAT(a, b) ATTN_CONCAT2(a, b)

namespace attn_kernels::cpu {
namespace ATTN_CPU_PATH {
namespace {

constexpr int W = ATTN_CPU_WIDTH;

using Vec = float __attribute__((vector_size(W * sizeof(float))));
using Bits = uint32_t __attribute__((vector_size(W * sizeof(float))));

struct Pair {
  Vec a, b;
};

template <typename V>
ATTN_ALWAYS_INLINE V load(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}
ATTN_ALWAYS_INLINE void store_vec(float* p, Vec v) {
  __builtin_memcpy(p, &v, sizeof v);
}
ATTN_ALWAYS_INLINE void fill(float* begin, float* end, float value) {
  for (float* x = begin; x < end; ++x) *x = value;
}

// 2 * W consecutive values as floats in accumulator_index order (cpu_kernel.h).
ATTN_ALWAYS_INLINE Pair widen(const float* p) {
  return {load<Vec>(p), load<Vec>(p + W)};
}
ATTN_ALWAYS_INLINE Pair widen(const BFloat16* p) {
  const Bits bits = load<Bits>(p);  // lane i: value 2i in the low half, 2i + 1 in the high half
  return {(Vec)(bits << 16), (Vec)(bits & 0xffff0000u)};
}
using Shorts = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));

// W halves as floats. GCC 12 converts _Float16 vectors one lane at a time (vpinsrw and a scalar
// vcvtph2ps per lane: f16 weights read at 6.9 GB/s against bf16's 25 in the linear kernel), so
// x86 with F16C converts with vcvtph2ps itself, arm64 with fcvtl, and other targets by their bits:
// the exponent and mantissa shifted into a float's places and rescaled by 2^112 (exact for normal
// and subnormal halves), inf and NaN set apart.
ATTN_ALWAYS_INLINE Vec halves_to_floats(Shorts h) {
#if defined(__F16C__) && ATTN_CPU_WIDTH == 8
  return (Vec)_mm256_cvtph_ps((__m128i)h);
#elif defined(__AVX512F__) && ATTN_CPU_WIDTH == 16
  // The unmasked form warns (-Wmaybe-uninitialized) in GCC 12.
  return (Vec)_mm512_maskz_cvtph_ps(0xffff, (__m256i)h);
#elif defined(__aarch64__) && ATTN_CPU_WIDTH == 4
  return vcvt_f32_f16(vreinterpret_f16_u16((uint16x4_t)h));
#else
  const Bits u = __builtin_convertvector(h, Bits);
  const Bits magnitude = (u & 0x7fffu) << 13;
  const Vec finite = (Vec)magnitude * 0x1p112f;
  const Bits special = (Bits)(magnitude >= (0x7c00u << 13));  // inf, NaN: all ones
  const Bits bits = ((Bits)finite & ~special) | ((magnitude | 0x7f800000u) & special);
  return (Vec)(bits | ((u & 0x8000u) << 16));
#endif
}

ATTN_ALWAYS_INLINE Pair widen(const Float16* p) {
  return {halves_to_floats(load<Shorts>(p)), halves_to_floats(load<Shorts>(p + W))};
}

// W consecutive values (the first half of a pair) as a Pair in accumulator_index order, the
// lanes of the missing half zero: a head dim whose last pair is half full (80 on AVX-512).
using HalfBits = uint32_t __attribute__((vector_size(W / 2 * sizeof(uint32_t))));
template <size_t... L>
ATTN_ALWAYS_INLINE Bits zero_extend(HalfBits h, std::index_sequence<L...>) {
  return __builtin_shufflevector(h, HalfBits{}, static_cast<int>(L)...);
}
ATTN_ALWAYS_INLINE Pair widen_half(const float* p) {
  return {load<Vec>(p), Vec{}};
}
ATTN_ALWAYS_INLINE Pair widen_half(const BFloat16* p) {
  const Bits bits = zero_extend(load<HalfBits>(p), std::make_index_sequence<W>());
  return {(Vec)(bits << 16), (Vec)(bits & 0xffff0000u)};
}
ATTN_ALWAYS_INLINE Pair widen_half(const Float16* p) {
  return {halves_to_floats(load<Shorts>(p)), Vec{}};
}

// Prefetch into L2. An asm statement: GCC 12 deleted loops of
// _mm_prefetch as dead code, and the kernel once shipped without a single prefetch. The address
// goes in a register, not as a memory operand: with one, GCC stored every accumulator of the
// linear kernel's loops to the stack each iteration (8 stores a step at 8 rows of x; without
// them bf16 M = 8 took 0.91-0.94x the time, 4-bit M = 4 0.90-0.93x, attention unchanged:
// in-process A/B, dev/ab_linear.cpp and ab_cpu.cpp).
ATTN_ALWAYS_INLINE void prefetch_to_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, [%0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace
}  // namespace ATTN_CPU_PATH
}  // namespace attn_kernels::cpu
