// Kernel-only timing of the CPU linear kernel (no MLX, no Python): linear_cpu on a decode step's
// projections, weights cold (sets rotated over 1.5 GB call by call, so every call streams W from
// DRAM as a decode step does) or with --hot one set reused (W from the caches: the compute's
// rate), the paths interleaved call by call in one process. From the repository root:
//
//   make bench-linear-kernel ARGS="[--shape NxK] [--rows M] [--format F] [--group G] [--hot]
//                                  [PATH...]"
//
// Defaults: Qwen3-4B's gate/up (19456 x 2560) and down (2560 x 9728), rows 1 and 8, formats
// bf16, f16, f32, q4 and q8 (4- and 8-bit, --group 32, 64 (default) or 128: models use 64 and
// 128, which take different code paths). PATH: avx512, avx2, portable, neon (default: every
// path this CPU runs). Prints per (shape, format, rows, path): median and min µs, GB/s of the
// weights (codes, scales and biases as stored) and the fraction of the read rate measured first.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_linear.h"

using namespace attn_kernels;
using Clock = std::chrono::steady_clock;

namespace {

struct Format {
  const char* name;
  ElementType dtype;
  int bits;
};
constexpr Format kFormats[] = {{"bf16", ElementType::bfloat16, 0},
                               {"f16", ElementType::float16, 0},
                               {"f32", ElementType::float32, 0},
                               {"q4", ElementType::bfloat16, 4},
                               {"q8", ElementType::bfloat16, 8}};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One weight set: bytes filled with a pattern that is a finite value in every dtype.
struct Weights {
  std::vector<uint8_t> w, scales, biases;
  Weights(const Format& f, int n, int k, int group) {
    const size_t elem = f.dtype == ElementType::float32 ? 4 : 2;
    w.assign(f.bits ? size_t(n) * k * f.bits / 8 : size_t(n) * k * elem, 0x3c);
    const size_t groups = f.bits ? size_t(n) * k / group : 0;
    scales.assign(groups * elem, 0x3c);
    biases.assign(groups * elem, 0x3c);
  }
  size_t bytes() const { return w.size() + scales.size() + biases.size(); }
};

void run(int n, int k, int rows, const Format& f, int group, const std::vector<CpuPath>& paths,
         double read, bool hot) {
  const size_t elem = f.dtype == ElementType::float32 ? 4 : 2;
  const size_t one = Weights(f, n, k, group).bytes();
  // Every call reads the set after the previous call's, paths interleaved included, so that no
  // path finds W in a cache another path just filled: the sets span 1.5 GB, three times the
  // largest L3 seen here (480 MB; with 600 MB and one set per round of paths, the paths after the
  // first read much of W from L3, up to 1.5x the DRAM rate).
  const int sets = hot ? 1 : std::max<size_t>(2, (size_t(1536) << 20) / one);
  std::vector<Weights> weights;
  for (int s = 0; s < sets; ++s) weights.emplace_back(f, n, k, group);
  std::vector<uint8_t> x(size_t(rows) * k * elem, 0x3c), out(size_t(rows) * n * elem);
  LinearProblem p{};
  p.rows = rows;
  p.outputs = n;
  p.inputs = k;
  p.dtype = f.dtype;
  p.bits = f.bits;
  p.group_size = group;
  p.x = x.data();
  p.x_row_stride = k;
  p.out = out.data();
  std::vector<std::vector<double>> us(paths.size());
  const int iterations = hot ? 104 : std::max(8 * sets / int(paths.size()), 8) + 4;
  for (int it = 0, call = 0; it < iterations; ++it) {
    for (size_t i = 0; i < paths.size(); ++i, ++call) {
      const Weights& w = weights[call % sets];
      p.weight = w.w.data();
      p.scales = w.scales.data();
      p.biases = w.biases.data();
      const auto start = Clock::now();
      linear_cpu(p, paths[i]);
      const double t = std::chrono::duration<double>(Clock::now() - start).count() * 1e6;
      if (it >= 4) us[i].push_back(t);  // after a warm-up round
    }
  }
  for (size_t i = 0; i < paths.size(); ++i) {
    const double med = median(us[i]);
    const double gbs = one / med / 1e3;
    std::printf("%5d x %-5d %-4s M=%d %-8s %9.1f us (min %9.1f) %6.1f GB/s %5.1f%% of the read "
                "rate\n", n, k, f.name, rows, cpu_path_name(paths[i]), med,
                *std::min_element(us[i].begin(), us[i].end()), gbs, 100 * gbs / read);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int, int>> shapes;
  std::vector<int> rows;
  std::vector<const Format*> formats;
  std::vector<CpuPath> paths;
  bool hot = false;
  int group = 64;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--shape" && a + 1 < argc) {
      int n = 0, k = 0;
      if (std::sscanf(argv[++a], "%dx%d", &n, &k) != 2 || n < 1 || k < 64 || k % 64) {
        std::fprintf(stderr, "error: --shape NxK, K a multiple of 64, got %s\n", argv[a]);
        return 2;
      }
      shapes.push_back({n, k});
    } else if (arg == "--hot") {
      hot = true;
    } else if (arg == "--group" && a + 1 < argc) {
      group = std::atoi(argv[++a]);
      if (group != 32 && group != 64 && group != 128) {
        std::fprintf(stderr, "error: --group 32, 64 or 128, got %s\n", argv[a]);
        return 2;
      }
    } else if (arg == "--rows" && a + 1 < argc) {
      rows.push_back(std::max(1, std::atoi(argv[++a])));
    } else if (arg == "--format" && a + 1 < argc) {
      const std::string name = argv[++a];
      const Format* f = nullptr;
      for (const Format& g : kFormats) f = name == g.name ? &g : f;
      if (!f) {
        std::fprintf(stderr, "error: --format bf16|f16|f32|q4|q8, got %s\n", name.c_str());
        return 2;
      }
      formats.push_back(f);
    } else {
      bool found = false;
      for (CpuPath path : cpu_paths_supported()) {
        if (arg == cpu_path_name(path)) paths.push_back(path), found = true;
      }
      if (!found) {
        std::fprintf(stderr, "error: %s is not an option or a path this CPU runs\n", argv[a]);
        return 2;
      }
    }
  }
  if (shapes.empty()) shapes = {{19456, 2560}, {2560, 9728}};
  if (rows.empty()) rows = {1, 8};
  if (formats.empty()) {
    for (const Format& f : kFormats) formats.push_back(&f);
  }
  if (paths.empty()) paths = cpu_paths_supported();
  const double read = measure_read_bandwidth(size_t(1) << 30, 5) / 1e9;
  std::printf("read rate %.1f GB/s (%d threads)\n", read, cpu_threads());
  for (const auto& [n, k] : shapes) {
    for (const Format* f : formats) {
      for (int m : rows) run(n, k, m, *f, group, paths, read, hot);
    }
  }
  return 0;
}
