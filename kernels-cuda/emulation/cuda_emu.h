// Lets a host C++20 compiler run decode_attention_quantized_kernel.cuh: every thread of a block
// is a host thread (blocks run one after another), __syncthreads is a real barrier of the block,
// warp shuffles exchange values among the 32 threads of a warp (each waits for all 32, as the
// *_sync intrinsics do), atomics are std::atomic_ref, loads through __ldg/__ldcg are plain
// loads and cp.async is a plain copy. Queries, scales, biases and outputs run in float storage for the SIMT kernel and in half
// storage (_Float16) for the mma kernel, whose mma.sync the kernel itself emulates with shuffles.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;
struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline float2 make_float2(float x, float y) {
  return {x, y};
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return {x, y, z, w};
}

namespace emu {

struct Block {
  explicit Block(int threads, size_t shared_floats)
      : barrier(threads), exchange(threads), shared(shared_floats) {
    for (int w = 0; w < threads / 32; ++w) {
      warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<float> exchange;
  std::vector<float> shared;
  bool flag = false;
};

inline thread_local Block* block = nullptr;

// Every block of the grid in turn, each with `threads` host threads running `kernel`.
inline void launch(unsigned gx, unsigned gy, int threads, size_t shared_floats,
                   const std::function<void()>& kernel) {
  blockDim.x = threads;
  gridDim.x = gx;
  gridDim.y = gy;
  for (unsigned y = 0; y < gy; ++y) {
    for (unsigned x = 0; x < gx; ++x) {
      Block grid_block(threads, shared_floats);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          block = &grid_block;
          threadIdx.x = t;
          blockIdx.x = x;
          blockIdx.y = y;
          kernel();
        });
      }
      for (auto& t : pool) t.join();
    }
  }
}

// A runner's one argument, the folder of its inputs (usage and exit status 2 otherwise).
inline std::string runner_folder(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    std::exit(2);
  }
  return argv[1];
}

// A runner's input file as an array of T (raw bytes, native order).
template <typename T>
std::vector<T> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::vector<char> raw{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  std::vector<T> out(raw.size() / sizeof(T));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(T));
  return out;
}

}  // namespace emu

#define ATTN_SHARED_FLOATS(name) float* name = emu::block->shared.data()
#define ATTN_SHARED_FLAG(name) bool& name = emu::block->flag

inline float __shfl_xor_sync(unsigned, float x, int offset) {
  const int t = static_cast<int>(threadIdx.x);
  auto& barrier = *emu::block->warp_barriers[t / 32];
  emu::block->exchange[t] = x;
  barrier.arrive_and_wait();
  const float other = emu::block->exchange[t ^ offset];
  barrier.arrive_and_wait();  // nobody overwrites the exchange before all have read it
  return other;
}
inline unsigned __shfl_xor_sync(unsigned mask, unsigned x, int offset) {
  return std::bit_cast<unsigned>(__shfl_xor_sync(mask, std::bit_cast<float>(x), offset));
}
// __shfl_sync: the value of lane `source` of the caller's warp (4-byte values).
template <typename V>
inline V __shfl_sync(unsigned, V x, int source) {
  static_assert(sizeof(V) == 4);
  const int t = static_cast<int>(threadIdx.x);
  auto& barrier = *emu::block->warp_barriers[t / 32];
  emu::block->exchange[t] = std::bit_cast<float>(x);
  barrier.arrive_and_wait();
  const V other = std::bit_cast<V>(emu::block->exchange[t / 32 * 32 + source]);
  barrier.arrive_and_wait();
  return other;
}
inline void __syncthreads() {
  emu::block->barrier.arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::block->warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}
// cp.async (decode_attention_quantized_stages.cuh) as a plain copy, done when issued, so the
// commit and the wait have nothing to do; the __syncwarp that follows a wait in the kernel is
// the barrier that makes the lanes' copies visible to each other, on the GPU as here.
inline void copy_async16(void* dst, const void* src, int src_bytes) {
  std::memcpy(dst, src, src_bytes);
  std::memset(static_cast<char*>(dst) + src_bytes, 0, 16 - src_bytes);
}
inline void copy_async_commit() {}
template <int N>
inline void copy_async_wait() {}
inline void __threadfence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __uint_as_float(unsigned u) {
  return std::bit_cast<float>(u);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
  uint8_t bytes[8];
  std::memcpy(bytes, &x, 4);
  std::memcpy(bytes + 4, &y, 4);
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned(bytes[(selector >> (4 * i)) & 7]) << (8 * i);
  return r;
}
using std::isnan;
using std::max;
using std::min;
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline float __fdiv_rn(float a, float b) {  // the host's division rounds correctly
  return a / b;
}
inline float fmaxf(float a, float b) {
  return std::fmax(a, b);
}
inline float fmaf(float a, float b, float c) {
  return std::fma(a, b, c);
}

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __half2float(__half x) {
  return float(std::bit_cast<_Float16>(x.bits));
}
inline float __bfloat162float(__nv_bfloat16 x) {
  return std::bit_cast<float>(uint32_t(x.bits) << 16);
}
inline __half __float2half_rn(float x) {
  return {std::bit_cast<uint16_t>(static_cast<_Float16>(x))};
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {  // round to nearest even (finite x)
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
