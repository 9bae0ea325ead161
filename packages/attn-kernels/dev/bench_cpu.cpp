// Kernel-only timing of the CPU path (no MLX, no Python): decode_attention_cpu on Qwen3-4B
// shapes (bf16, Hq=32, Hkv=8, D=128, L=1), K/V either hot (one set, reused) or cold (sets
// rotated over ~600 MB so every call streams from DRAM). From the repository root:
//
//   g++ -O3 -DNDEBUG -std=c++20 -I packages/attn-kernels/csrc \
//       -I "$(uv run python -c 'import mlx, os; print(os.path.join(mlx.__path__[0], "include"))')" \
//       packages/attn-kernels/csrc/decode_attention_cpu.cpp packages/attn-kernels/dev/bench_cpu.cpp \
//       -o /tmp/bench_cpu -lpthread && /tmp/bench_cpu
//
// ATTN_KERNELS_NUM_THREADS and ATTN_KERNELS_PORTABLE apply as in the extension. Inputs are
// normal bf16 values near 1 (random bit patterns would include denormals, 3-5x slower).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "decode_problem.h"

namespace attn_kernels {
void decode_attention_cpu(const DecodeProblem& p);
double measure_read_bandwidth(size_t bytes, int repeats);
}  // namespace attn_kernels

using namespace attn_kernels;

int main() {
  constexpr int kHq = 32, kHkv = 8, kD = 128;
  std::printf("read rate %.1f GB/s (2^30 bytes, best of 5)\n",
              measure_read_bandwidth(size_t{1} << 30, 5) / 1e9);
  for (const bool cold : {false, true}) {
    for (const int S : {1024, 4096, 16384}) {
      const size_t n = size_t{kHkv} * S * kD;
      const int sets = cold ? std::max(2, static_cast<int>(600e6 / (4.0 * n))) : 1;
      std::vector<uint16_t> q(kHq * kD), kv(2 * n * sets), out(kHq * kD);
      for (size_t i = 0; i < q.size(); ++i) q[i] = 0x3f80 + ((uint32_t(i) * 40503u) >> 8) % 256 - 128;
      for (size_t i = 0; i < kv.size(); ++i) kv[i] = 0x3f80 + ((uint32_t(i) * 2654435761u) >> 24) - 128;
      DecodeProblem p{};
      p.queries = q.data();
      p.out = out.data();
      p.dtype = ElementType::bfloat16;
      p.mask_dtype = ElementType::float32;
      p.rows = kHq;
      p.kv_rows = kHkv;
      p.group = kHq / kHkv;
      p.query_len = 1;
      p.context = S;
      p.head_dim = kD;
      p.q_heads = kHq;
      p.kv_heads = kHkv;
      p.scale = 0.088f;
      const int64_t qs[4] = {kHq * kD, kD, kD, 1};
      const int64_t ks[4] = {int64_t{kHkv} * S * kD, int64_t{S} * kD, kD, 1};
      std::copy(qs, qs + 4, p.q_strides);
      std::copy(ks, ks + 4, p.k_strides);
      std::copy(ks, ks + 4, p.v_strides);
      const int calls = std::max(3 * sets, 21);
      std::vector<double> us;
      for (int i = 0; i < calls; ++i) {
        const int s = i % sets;
        p.keys = kv.data() + 2 * n * s;
        p.values = kv.data() + 2 * n * s + n;
        const auto start = std::chrono::steady_clock::now();
        decode_attention_cpu(p);
        const auto stop = std::chrono::steady_clock::now();
        if (i >= sets) us.push_back(std::chrono::duration<double>(stop - start).count() * 1e6);
      }
      std::sort(us.begin(), us.end());
      const double median = us[us.size() / 2];
      std::printf("%s S=%-6d median %8.1f us (min %8.1f)  %5.1f GB/s\n", cold ? "cold" : "hot ", S,
                  median, us.front(), 4.0 * n / median / 1e3);
    }
  }
}
