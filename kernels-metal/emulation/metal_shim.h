// Lets a host C++20 compiler parse, type-check and run a Metal kernel source: address spaces
// become nothing, Metal's scalar types map to host types, and the SIMD-group and threadgroup
// operations are implemented by simt.h over real threads. Attributes such as [[buffer(0)]] are
// unknown to the host compiler and ignored (-Wno-attributes).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#define kernel
#define device
#define constant const  // constant-space data is read-only on the GPU too
#define threadgroup

using uint = unsigned int;
using uchar = unsigned char;
using ushort = uint16_t;
using half = _Float16;  // IEEE binary16, as Metal's half

namespace metal {

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

template <typename To, typename From>
inline To as_type(From x) {
  return std::bit_cast<To>(x);
}

inline float max(float a, float b) {
  return std::fmax(a, b);
}
inline float min(float a, float b) {
  return std::fmin(a, b);
}

namespace fast {
inline float exp(float x) {
  return std::exp(x);
}
}  // namespace fast

inline float exp2(float x) {
  return std::exp2(x);
}
inline float rsqrt(float x) {
  return 1.0f / std::sqrt(x);
}

namespace precise {
inline float cos(float x) {
  return std::cos(x);
}
inline float sin(float x) {
  return std::sin(x);
}
}  // namespace precise

// Implemented in simt.h: the calling thread's SIMD group exchanges values with its 31 peers.
float simd_sum(float x);
float simd_max(float x);
void simdgroup_barrier(mem_flags);
void threadgroup_barrier(mem_flags);

}  // namespace metal
