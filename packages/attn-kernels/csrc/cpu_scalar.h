// Element types of the CPU kernel and their scalar conversions to and from float. Builtins, not
// standard-library templates: see the note at the top of cpu_kernel_body.h.
#pragma once

#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define ATTN_ALWAYS_INLINE inline __attribute__((always_inline))

// Half <-> float, one value: a native half type where it converts in hardware (__fp16 on arm64,
// _Float16 with AVX512-FP16), else F16C's instructions, else by hand. GCC 12's _Float16 on other
// x86-64 targets converts through libgcc (__truncsfhf2: ~10 ns a value, 43% of a float16 call's
// time at S = 32, L = 8). Both fallbacks round to nearest even as _Float16 does: equal to it on
// every float and every half (checked once by hand; cpu_kernel_check keeps every 251st float).
#if defined(__aarch64__)
#define ATTN_HALF __fp16
#elif defined(__AVX512FP16__)
#define ATTN_HALF _Float16
#endif

namespace attn_kernels::cpu {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

ATTN_ALWAYS_INLINE float to_float(float x) {
  return x;
}
ATTN_ALWAYS_INLINE float to_float(BFloat16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16);
}
ATTN_ALWAYS_INLINE float to_float(Float16 x) {
#if defined(ATTN_HALF)
  return static_cast<float>(__builtin_bit_cast(ATTN_HALF, x.bits));
#elif defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t sign = (x.bits & 0x8000u) << 16, exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ff;
  if (exp == 0x1f) {
    return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  }
  if (exp == 0) {
    const float v = __builtin_ldexpf(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
#endif
}
// Boolean masks: true keeps a key.
ATTN_ALWAYS_INLINE float to_float(bool x) {
  return x ? 0.0f : -__builtin_inff();
}

ATTN_ALWAYS_INLINE void store(float* dst, float x) {
  *dst = x;
}
ATTN_ALWAYS_INLINE void store(BFloat16* dst, float x) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  if (x != x) {
    dst->bits = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  dst->bits = static_cast<uint16_t>(u >> 16);
}
ATTN_ALWAYS_INLINE void store(Float16* dst, float x) {
#if defined(ATTN_HALF)
  dst->bits = __builtin_bit_cast(uint16_t, static_cast<ATTN_HALF>(x));
#elif defined(__F16C__)
  dst->bits = static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
#else
  const uint32_t u = __builtin_bit_cast(uint32_t, x), sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    dst->bits = static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    return;
  }
  if (abs >= 0x477ff000u) {
    dst->bits = static_cast<uint16_t>(sign | 0x7c00u);
    return;
  }
  if (abs < 0x38800000u) {
    const float v = __builtin_bit_cast(float, abs) * 16777216.0f;  // 2^24: subnormal units
    dst->bits = static_cast<uint16_t>(sign | static_cast<uint32_t>(__builtin_nearbyintf(v)));
    return;
  }
  uint32_t h = abs - 0x38000000u;
  h += 0xfffu + ((h >> 13) & 1u);
  dst->bits = static_cast<uint16_t>(sign | (h >> 13));
#endif
}

// x = n ln2 + r with n a whole number (returned in `n`) and |r| <= ln2/2, then e^r by a degree-6
// polynomial (relative error ~2e-7): the steps exp_nonpositive and exp_nonpositive_lanes share
// (F: float or a GCC/Clang vector of floats).
template <typename F>
ATTN_ALWAYS_INLINE F exp_reduced(F x, F& n) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  n = (x * 1.44269504f + kRound) - kRound;
  const F r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  F poly = F{} + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  return poly * r + 1.0f;
}

// exp(x) for x <= 0 without a libm call: 2^n from the exponent bits times exp_reduced's
// polynomial. Exactly 0 below -87 and for -inf; NaN stays NaN.
ATTN_ALWAYS_INLINE float exp_nonpositive(float x) {
  float n;
  const float poly = exp_reduced(x < -87.0f ? -87.0f : x, n);
  const int32_t power = n == n ? static_cast<int32_t>(n) : 0;
  const float scale = __builtin_bit_cast(float, (power + 127) << 23);
  return x < -87.0f ? 0.0f : poly * scale;
}

// exp_nonpositive on every lane of a GCC/Clang vector of floats (any width).
template <typename V>
ATTN_ALWAYS_INLINE V exp_nonpositive_lanes(V x) {
  using Ints = decltype(x < x);  // the lanes as int32 (a comparison's result type)
  V n;
  const V poly = exp_reduced(x < -87.0f ? V{} - 87.0f : x, n);
  const Ints power = n == n ? __builtin_convertvector(n, Ints) : Ints{};
  const V scale = (V)((power + 127) << 23);
  return x < -87.0f ? V{} : poly * scale;
}

// max that keeps a NaN from either side (std::max drops one from its second argument).
ATTN_ALWAYS_INLINE float nan_max(float a, float b) {
  return (a != a || a > b) ? a : b;
}

}  // namespace attn_kernels::cpu
