// What the stand-alone CUDA timing programs share (bench_attend.cu, bench_quantized.cu): error
// checks, bf16 on the host, the copy bandwidth that a floor is counted against, the BENCH_*
// environment lists and the timed replays of a graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace bench {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Copy rate (read + write bytes per second) of a 1 GiB device-to-device copy.
inline double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  std::vector<float> ms;
  for (int i = 0; i < 7; ++i) {
    cudaEventRecord(t0);
    CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float m;
    cudaEventElapsedTime(&m, t0, t1);
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);
}

// The next value of a xorshift64 stream (state nonzero): cheap bits for inputs by the gigabyte.
inline uint64_t xorshift(uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// "512,4096" -> {512, 4096}; empty when unset.
inline std::vector<int> env_list(const char* name) {
  std::vector<int> values;
  if (const char* text = std::getenv(name)) {
    for (const char* at = text; *at; ++at) {
      if (at == text || at[-1] == ',') values.push_back(std::atoi(at));
    }
  }
  return values;
}

// µs per call of `replays` launches of a graph of `calls` calls, after `warmup` untimed ones,
// sorted (each launch between two events on `stream`).
inline std::vector<double> replay_us(cudaGraphExec_t exec, cudaStream_t stream, int warmup,
                                     int replays, int calls) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  std::vector<double> us;
  for (int r = 0; r < warmup + replays; ++r) {
    cudaEventRecord(t0, stream);
    CHECK(cudaGraphLaunch(exec, stream));
    cudaEventRecord(t1, stream);
    CHECK(cudaEventSynchronize(t1));
    float ms;
    cudaEventElapsedTime(&ms, t0, t1);
    if (r >= warmup) us.push_back(ms * 1e3 / calls);
  }
  CHECK(cudaGetLastError());
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  std::sort(us.begin(), us.end());
  return us;
}

}  // namespace bench
