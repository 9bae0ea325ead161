// A small SIMT machine for metal_shim.h: runs every thread of a threadgroup as a host thread,
// with a real threadgroup barrier and SIMD-group reductions that exchange values among the 32
// lanes of a group (each lane waits for all 32, as on the GPU). Threadgroups run one after
// another, each with its own threadgroup memory.
#pragma once

#include <barrier>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "metal_shim.h"

namespace simt {

constexpr int kSimdWidth = 32;

struct Threadgroup {
  explicit Threadgroup(int threads) : threadgroup_barrier(threads), exchange(threads) {
    for (int g = 0; g < threads / kSimdWidth; ++g) {
      simd_barriers.push_back(std::make_unique<std::barrier<>>(kSimdWidth));
    }
  }
  std::barrier<> threadgroup_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> simd_barriers;
  std::vector<float> exchange;
};

inline thread_local Threadgroup* current = nullptr;
inline thread_local int current_thread = 0;

template <typename Reduce>
float simd_reduce(float x, Reduce reduce) {
  const int group = current_thread / kSimdWidth;
  auto& barrier = *current->simd_barriers[group];
  current->exchange[current_thread] = x;
  barrier.arrive_and_wait();
  float result = current->exchange[group * kSimdWidth];
  for (int lane = 1; lane < kSimdWidth; ++lane) {
    result = reduce(result, current->exchange[group * kSimdWidth + lane]);
  }
  barrier.arrive_and_wait();  // nobody overwrites the exchange before all have read it
  return result;
}

// Runs body(thread_index) for every thread of `groups` threadgroups of `threads` threads.
inline void dispatch(int groups, int threads, const std::function<void(int group, int thread)>& body) {
  for (int g = 0; g < groups; ++g) {
    Threadgroup tg(threads);
    std::vector<std::thread> workers;
    workers.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        current = &tg;
        current_thread = t;
        body(g, t);
      });
    }
    for (auto& w : workers) {
      w.join();
    }
  }
}

}  // namespace simt

namespace metal {
inline float simd_sum(float x) {
  return simt::simd_reduce(x, [](float a, float b) { return a + b; });
}
inline float simd_max(float x) {
  return simt::simd_reduce(x, [](float a, float b) { return std::fmax(a, b); });
}
inline void simdgroup_barrier(mem_flags) {
  simt::current->simd_barriers[simt::current_thread / simt::kSimdWidth]->arrive_and_wait();
}
inline void threadgroup_barrier(mem_flags) {
  simt::current->threadgroup_barrier.arrive_and_wait();
}
}  // namespace metal
