// In-process A/B of two versions of the CPU kernel (this VM's speed drifts by 20-40% between
// runs, so separate processes cannot resolve a 10% change): calls alternate between the two,
// K/V hot, and the medians and their ratio are printed. The old version is compiled with its
// namespace renamed. From the repository root:
//
//   mkdir -p /tmp/old && git archive HEAD~1 packages/attn-kernels/csrc | tar -x -C /tmp/old
//   make build/cpu-kernel/host/decode_attention_cpu.o build/cpu-kernel/host/cpu_kernel_avx2.o ...
//   (the new objects; the old ones: the same compiler lines with -Dattn_kernels=attn_old on the
//   files under /tmp/old), then
//   g++ -O3 -std=gnu++20 -I packages/attn-kernels/csrc packages/attn-kernels/dev/ab_cpu.cpp \
//       NEW_OBJECTS OLD_OBJECTS -o /tmp/ab_cpu -lpthread && /tmp/ab_cpu
//
// Both versions run the path ATTN_KERNELS_CPU_PATH names (or the best one); each has its own
// thread pool, and only one works at a time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "qwen3_case.h"

#include "cpu_kernel.h"

namespace attn_old {
// attn_kernels::DecodeProblem under the renamed namespace: the same layout, so both versions must
// have it (the geometry became a base struct at the commit that added attention_geometry.h).
struct DecodeProblem;
enum class CpuPath { avx512, avx2, portable, neon };
void decode_attention_cpu(const DecodeProblem& p, CpuPath path);
}  // namespace attn_old

using namespace attn_kernels;

int main() {
  const CpuPath path = cpu_path_from_env();
  for (const int S : {256, 1024, 4096}) {
    dev::Qwen3Case c(S, 1);
    std::vector<double> old_us, new_us;
    const int pairs = S <= 1024 ? 400 : 100;
    for (int i = 0; i < 2 * pairs; ++i) {
      const bool old = (i / 2 + i) % 2 == 0;  // ABBA order: neither always goes first
      const auto start = std::chrono::steady_clock::now();
      if (old) {
        attn_old::decode_attention_cpu(*reinterpret_cast<const attn_old::DecodeProblem*>(&c.p),
                                       static_cast<attn_old::CpuPath>(path));
      } else {
        decode_attention_cpu(c.p, path);
      }
      const double us =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() * 1e6;
      (old ? old_us : new_us).push_back(us);
    }
    std::sort(old_us.begin(), old_us.end());
    std::sort(new_us.begin(), new_us.end());
    const double a = old_us[old_us.size() / 2], b = new_us[new_us.size() / 2];
    std::printf("S=%-5d old %8.1f us  new %8.1f us  new/old %.3f  (%.1f / %.1f GB/s)\n", S, a, b,
                b / a, c.kv_bytes() / a / 1e3, c.kv_bytes() / b / 1e3);
  }
}
