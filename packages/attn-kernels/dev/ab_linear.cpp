// In-process A/B of two versions of the CPU linear kernel (this VM's speed drifts by 20-40%
// between runs, so separate processes cannot resolve a 10% change): calls alternate between the
// two (ABBA), bf16 x and one format of W, and the medians, their ratio and how many outputs differ
// are printed. The old version is compiled with its namespace renamed. From the repository root:
//
//   mkdir -p /tmp/old && git archive HEAD~1 packages/attn-kernels/csrc | tar -x -C /tmp/old
//   make build/cpu-kernel/host/linear_cpu.o build/cpu-kernel/host/cpu_kernel_avx2.o ...
//   (the new objects; the old ones: the same compiler lines with -Dattn_kernels=attn_old on
//   linear_cpu.cpp, decode_attention_cpu.cpp and every cpu_kernel_<path>.cpp under /tmp/old),
//   then (one line)
//   g++ -O3 -std=gnu++20 -I packages/attn-kernels/csrc packages/attn-kernels/dev/ab_linear.cpp
//       NEW_OBJECTS OLD_OBJECTS -o /tmp/ab_linear -lpthread
//   /tmp/ab_linear [--cold] [--f32] [--rows M] [--bits 0|4|8] [--group G] [--pairs N] NxK...
//
// --bits 0: dense W (bf16, or f32 with --f32: x and W in float32). --cold: weight sets rotated
// over ~600 MB, so that every call streams W from DRAM as a decode step does (default: one set,
// hot in the caches: the kernel's compute).
// Both versions run the path ATTN_KERNELS_CPU_PATH names (or the best one); each has its own
// thread pool, and only one works at a time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_linear.h"

namespace attn_old {
struct LinearProblem;  // attn_kernels::LinearProblem under the renamed namespace: the same layout
enum class CpuPath { avx512, avx2, portable, neon };
void linear_cpu(const LinearProblem& p, CpuPath path);
}  // namespace attn_old

using namespace attn_kernels;

namespace {

struct Weights {
  std::vector<uint8_t> w, scales, biases;
};

// Codes of every value, scales near 1 and biases near -1 (bf16), dense values finite (the high
// byte of every bf16 or f32 value 0x3c).
Weights make_weights(int n, int k, int bits, int group, int elem) {
  Weights s;
  s.w.resize(bits ? size_t(n) * k * bits / 8 : size_t(n) * k * elem);
  for (size_t i = 0; i < s.w.size(); ++i) {
    s.w[i] = bits || int(i % elem) != elem - 1 ? uint8_t(i * 2654435761u >> 13) : uint8_t(0x3c);
  }
  const size_t groups = bits ? size_t(n) * k / group : 0;
  s.scales.resize(2 * groups);
  s.biases.resize(2 * groups);
  for (size_t g = 0; g < groups; ++g) {
    const uint16_t scale = 0x3c00 + g % 7, bias = 0xbc00 + g % 5;
    std::memcpy(&s.scales[2 * g], &scale, 2);
    std::memcpy(&s.biases[2 * g], &bias, 2);
  }
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rows = 1, bits = 4, group = 64, pairs = 200;
  bool cold = false, f32 = false;
  std::vector<std::pair<int, int>> shapes;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    int n = 0, k = 0;
    if (arg == "--cold") {
      cold = true;
    } else if (arg == "--f32") {
      f32 = true;
    } else if (a + 1 < argc && (arg == "--rows" || arg == "--bits" || arg == "--group" ||
                                arg == "--pairs")) {
      const int v = std::atoi(argv[++a]);
      (arg == "--rows" ? rows : arg == "--bits" ? bits : arg == "--group" ? group : pairs) = v;
    } else if (std::sscanf(argv[a], "%dx%d", &n, &k) == 2 && n > 0 && k > 0) {
      shapes.push_back({n, k});
    } else {
      std::fprintf(stderr, "error: unknown argument %s (see the comment atop ab_linear.cpp)\n",
                   argv[a]);
      return 2;
    }
  }
  if (shapes.empty()) shapes = {{6144, 1024}, {19456, 2560}};
  const CpuPath path = cpu_path_from_env();
  for (const auto& [n, k] : shapes) {
    if (bits && (k % group || group % 32)) {
      std::fprintf(stderr, "error: K = %d is not a multiple of the group %d\n", k, group);
      return 2;
    }
    const int elem = f32 ? 4 : 2;  // x and out: bf16, or float32 with --f32 (then dense W too)
    const size_t one = make_weights(1, k, bits, group, elem).w.size() * n +
                       (bits ? size_t(n) * k / group * 4 : 0);
    const int sets = cold ? std::max<size_t>(2, (600u << 20) / one) : 1;
    std::vector<Weights> weights;
    for (int s = 0; s < sets; ++s) weights.push_back(make_weights(n, k, bits, group, elem));
    std::vector<uint16_t> x(size_t(rows) * k * elem / 2), out_old(size_t(rows) * n * elem / 2);
    std::vector<uint16_t> out_new(out_old);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f00 + i * 37 % 200 + ((i & 1) << 15);
    LinearProblem p{};
    p.rows = rows;
    p.outputs = n;
    p.inputs = k;
    p.dtype = f32 ? ElementType::float32 : ElementType::bfloat16;
    p.bits = bits;
    p.group_size = group;
    p.x = x.data();
    p.x_row_stride = k;
    std::vector<double> old_us, new_us;
    for (int i = 0; i < 2 * pairs + 4; ++i) {
      const Weights& w = weights[i / 2 % sets];
      p.weight = w.w.data();
      p.scales = w.scales.data();
      p.biases = w.biases.data();
      const bool old = (i / 2 + i) % 2 == 0;  // ABBA order: neither always goes first
      p.out = old ? out_old.data() : out_new.data();
      const auto start = std::chrono::steady_clock::now();
      if (old) {
        attn_old::linear_cpu(*reinterpret_cast<const attn_old::LinearProblem*>(&p),
                             static_cast<attn_old::CpuPath>(path));
      } else {
        linear_cpu(p, path);
      }
      const double us =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() * 1e6;
      if (i >= 4) (old ? old_us : new_us).push_back(us);  // after a warm-up pair each
    }
    int differ = 0;
    for (size_t i = 0; i < out_old.size(); ++i) differ += out_old[i] != out_new[i];
    const double a = median(old_us), b = median(new_us);
    std::printf("%6d x %-5d %s M=%d %s: old %8.1f us (%5.1f GB/s)  new %8.1f us (%5.1f GB/s)  "
                "new/old %.3f  outputs differing: %d of %zu\n",
                n, k, bits ? (bits == 4 ? "q4" : "q8") : f32 ? "f32" : "bf16", rows,
                cold ? "cold" : "hot",
                a, one / a / 1e3, b, one / b / 1e3, b / a, differ, out_old.size());
  }
}
