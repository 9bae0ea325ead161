// Kernel-only timing of the CPU path (no MLX, no Python): decode_attention_cpu on Qwen3-4B
// shapes (bf16, Hq=32, Hkv=8, D=128, L=1), K/V either hot (one set, reused) or cold (sets
// rotated over ~600 MB so every call streams from DRAM). From the repository root:
//
//   g++ -O3 -DNDEBUG -std=c++20 -I packages/attn-kernels/csrc \
//       -I "$(uv run python -c 'import mlx, os; print(os.path.join(mlx.__path__[0], "include"))')" \
//       packages/attn-kernels/csrc/decode_attention_cpu.cpp packages/attn-kernels/dev/bench_cpu.cpp \
//       -o /tmp/bench_cpu -lpthread && /tmp/bench_cpu
//
// ATTN_KERNELS_NUM_THREADS and ATTN_KERNELS_PORTABLE apply as in the extension (the one-head rows
// use one thread by themselves: too little work to wake the pool). In-process A/B of
// two versions of the kernel: ab_cpu.cpp.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "qwen3_case.h"

namespace attn_kernels {
void decode_attention_cpu(const DecodeProblem& p);
double measure_read_bandwidth(size_t bytes, int repeats);
}  // namespace attn_kernels

using namespace attn_kernels;

int main() {
  std::printf("read rate %.1f GB/s (2^30 bytes, best of 5)\n",
              measure_read_bandwidth(size_t{1} << 30, 5) / 1e9);
  for (const bool cold : {false, true}) {
    for (const int S : {1024, 4096, 16384}) {
      const double set_bytes = 4.0 * dev::kHkv * S * dev::kD;
      const int sets = cold ? std::max(2, static_cast<int>(600e6 / set_bytes)) : 1;
      dev::Qwen3Case c(S, sets);
      const int calls = std::max(3 * sets, 21);
      std::vector<double> us;
      for (int i = 0; i < calls; ++i) {
        c.use_set(i % sets);
        const auto start = std::chrono::steady_clock::now();
        decode_attention_cpu(c.p);
        const auto stop = std::chrono::steady_clock::now();
        if (i >= sets) us.push_back(std::chrono::duration<double>(stop - start).count() * 1e6);
      }
      std::sort(us.begin(), us.end());
      const double median = us[us.size() / 2];
      std::printf("%s S=%-6d median %8.1f us (min %8.1f)  %5.1f GB/s\n", cold ? "cold" : "hot ", S,
                  median, us.front(), c.kv_bytes() / median / 1e3);
    }
  }
  // The kernel's own rate: one KV head (4 query heads), one thread, K/V from L1 (S = 64) to L3,
  // many calls in a row; ns per position (= per position and KV head).
  for (const int S : {64, 256, 1024, 4096, 8192}) {
    dev::Qwen3Case c(S, 1);
    c.p.rows = c.p.q_heads = c.p.group;
    c.p.kv_rows = c.p.kv_heads = 1;
    const int calls = std::max(200, 400000 / S);
    std::vector<double> ns;
    for (int round = 0; round < 7; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) decode_attention_cpu(c.p);
      const auto stop = std::chrono::steady_clock::now();
      ns.push_back(std::chrono::duration<double>(stop - start).count() * 1e9 / calls / S);
    }
    std::sort(ns.begin(), ns.end());
    std::printf("one head, one thread, S=%-5d (K+V %5.0f KB): %5.1f ns per position (min %5.1f)\n", S,
                4.0 * S * dev::kD / 1024, ns[ns.size() / 2], ns.front());
  }
}
