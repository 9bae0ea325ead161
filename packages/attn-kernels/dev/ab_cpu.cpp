// In-process A/B of two versions of the CPU kernel (this VM's speed drifts by 20-40% between
// runs, so separate processes cannot resolve a 10% change): calls alternate between the two
// (ABBA), K/V cold (sets rotated over ~600 MB, as between decode steps) or hot (--hot: one set),
// and the medians and their ratio are printed. The other version is compiled from a git
// revision's sources with its namespace renamed; from the repository root:
//
//   make ab-cpu-kernel BASE=HEAD~1 ARGS="[--hot] [HQ/HKV/D/DTYPE/S[/L] ...]"
//
// e.g. ARGS="32/32/128/f32/16384" (no GQA, float32). "old" is BASE's kernel, "new" this tree's.
// Shapes default to Qwen3-4B's (32/8/128/bf16, L = 1) at S = 256, 1024 and 4096; DTYPE is f32 or
// bf16, L > 1 is causal. Both versions run the path ATTN_KERNELS_CPU_PATH names (or the best
// one); each has its own thread pool, and only one works at a time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "attention_case.h"
#include "cpu_kernel.h"

namespace attn_old {
// attn_kernels::DecodeProblem under the renamed namespace: the same layout, so both versions must
// have it (the geometry became a base struct at the commit that added attention_geometry.h).
struct DecodeProblem;
enum class CpuPath { avx512, avx2, portable, neon };
void decode_attention_cpu(const DecodeProblem& p, CpuPath path);
}  // namespace attn_old

using namespace attn_kernels;

namespace {

bool parse_shape(const char* text, dev::Shape& shape, int& context) {
  char dtype[8] = {};
  shape.query_len = 1;
  const int fields = std::sscanf(text, "%d/%d/%d/%7[^/]/%d/%d", &shape.hq, &shape.hkv,
                                 &shape.head_dim, dtype, &context, &shape.query_len);
  shape.dtype = std::strcmp(dtype, "f32") == 0 ? ElementType::float32 : ElementType::bfloat16;
  return fields >= 5 && (std::strcmp(dtype, "f32") == 0 || std::strcmp(dtype, "bf16") == 0) &&
      shape.hq > 0 && shape.hkv > 0 && shape.hq % shape.hkv == 0 && shape.head_dim > 0 &&
      context >= shape.query_len && shape.query_len >= 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool hot = false;
  std::vector<std::pair<dev::Shape, int>> shapes;
  for (int a = 1; a < argc; ++a) {
    dev::Shape shape;
    int context = 0;
    if (std::strcmp(argv[a], "--hot") == 0) {
      hot = true;
    } else if (parse_shape(argv[a], shape, context)) {
      shapes.push_back({shape, context});
    } else {
      std::fprintf(stderr, "%s: expected --hot or HQ/HKV/D/DTYPE/S[/L] (DTYPE f32 or bf16)\n",
                   argv[a]);
      return 2;
    }
  }
  if (shapes.empty()) {
    for (const int S : {256, 1024, 4096}) shapes.push_back({dev::Shape{}, S});
  }
  const CpuPath path = cpu_path_from_env();
  std::printf("%s, read rate %.1f GB/s\n", hot ? "hot" : "cold",
              measure_read_bandwidth(size_t{1} << 30, 5) / 1e9);
  for (const auto& [shape, S] : shapes) {
    const double set_bytes = dev::Case::set_bytes(S, shape);
    const int sets = hot ? 1 : std::max(2, static_cast<int>(600e6 / set_bytes));
    dev::Case c(S, sets, shape);
    std::vector<double> old_us, new_us;
    const int pairs = std::max(S <= 1024 ? 400 : 100, 3 * sets);
    for (int i = 0; i < 2 * pairs; ++i) {
      const bool old = (i / 2 + i) % 2 == 0;  // ABBA order: neither always goes first
      c.use_set(i % sets);
      const auto start = std::chrono::steady_clock::now();
      if (old) {
        attn_old::decode_attention_cpu(*reinterpret_cast<const attn_old::DecodeProblem*>(&c.p),
                                       static_cast<attn_old::CpuPath>(path));
      } else {
        decode_attention_cpu(c.p, path);
      }
      const double us =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() * 1e6;
      if (i >= 2 * sets) (old ? old_us : new_us).push_back(us);
    }
    std::sort(old_us.begin(), old_us.end());
    std::sort(new_us.begin(), new_us.end());
    const double a = old_us[old_us.size() / 2], b = new_us[new_us.size() / 2];
    std::printf("%d/%d/%d/%s/%d/%d: old %8.1f us  new %8.1f us  new/old %.3f  (%.1f / %.1f GB/s)\n",
                shape.hq, shape.hkv, shape.head_dim,
                shape.dtype == ElementType::float32 ? "f32" : "bf16", S, shape.query_len, a, b,
                b / a, c.kv_bytes() / a / 1e3, c.kv_bytes() / b / 1e3);
  }
}
