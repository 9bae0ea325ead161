// What the kernel-only checks (cpu_kernel_check.cpp, cpu_linear_check.cpp) share: tensors of
// an element type with the rounded values kept for the float64 reference, and cheap random
// numbers. Free of MLX (the arm64 checks are cross-compiled with nothing else).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernel.h"
#include "cpu_scalar.h"
#include "decode_problem.h"

namespace attn_kernels::check {

using cpu::BFloat16;
using cpu::Float16;

// Rounds a double to the element type (what the kernel will read) and stores its bits.
struct Tensor {
  ElementType dtype;
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // the rounded values, for the reference
  Tensor(ElementType t, size_t n) : dtype(t), bytes(n * size(t)), values(n) {}
  static size_t size(ElementType t) { return t == ElementType::float32 ? 4 : 2; }
  void set(size_t i, double x) {
    const float f = static_cast<float>(x);
    switch (dtype) {
      case ElementType::float32: std::memcpy(&bytes[4 * i], &f, 4); values[i] = f; break;
      case ElementType::float16: {
        Float16 h;
        cpu::store(&h, f);
        std::memcpy(&bytes[2 * i], &h, 2);
        values[i] = cpu::to_float(h);
        break;
      }
      case ElementType::bfloat16: {
        BFloat16 b;
        cpu::store(&b, f);
        std::memcpy(&bytes[2 * i], &b, 2);
        values[i] = cpu::to_float(b);
        break;
      }
      default: break;
    }
  }
  double get_output(size_t i) const {
    switch (dtype) {
      case ElementType::float32: { float f; std::memcpy(&f, &bytes[4 * i], 4); return f; }
      case ElementType::float16: {
        Float16 h;
        std::memcpy(&h, &bytes[2 * i], 2);
        return cpu::to_float(h);
      }
      case ElementType::bfloat16: {
        BFloat16 b;
        std::memcpy(&b, &bytes[2 * i], 2);
        return cpu::to_float(b);
      }
      default: return 0;
    }
  }
};

// Cheap random numbers (std::normal_distribution dominated the run time under qemu): splitmix64,
// and a sum of four uniforms as a near-normal value of mean 0 and variance 1.
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed) {}
  uint64_t operator()() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>((*this)() >> 11) * 0x1.0p-53; }
  double normal() {
    return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772;
  }
};

// The checks' command line: [--seeds N] [PATH...] (default: every path this CPU runs). False
// (after a message) for a path that is unknown or not supported here. Also what every check
// sets first: line-buffered output, and a pool of 4 threads (made on first use: more threads
// than tasks at times, and calls on part of the pool).
struct Options {
  std::vector<CpuPath> paths;
  uint32_t seeds = 2;
};
inline bool parse_options(int argc, char** argv, Options& options) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  setenv("ATTN_KERNELS_NUM_THREADS", "4", 0);
  for (int a = 1; a < argc; ++a) {
    if (argv[a] == std::string("--seeds") && a + 1 < argc) {
      options.seeds = static_cast<uint32_t>(std::atoi(argv[++a]));
      continue;
    }
    bool found = false;
    for (CpuPath path : cpu_paths_supported()) {
      if (argv[a] == std::string(cpu_path_name(path))) options.paths.push_back(path), found = true;
    }
    if (!found) {
      std::fprintf(stderr, "error: path %s is unknown or not supported by this CPU\n", argv[a]);
      return false;
    }
  }
  if (options.paths.empty()) options.paths = cpu_paths_supported();
  return true;
}

// Prints each path's passed and failed runs ("<path>: N <what>passed, F failed"); the exit status.
inline int report(const Options& options, const std::vector<int>& failed, size_t runs,
                  const char* what) {
  int total = 0;
  for (size_t n = 0; n < options.paths.size(); ++n) {
    std::printf("%s: %zu %spassed, %d failed\n", cpu_path_name(options.paths[n]),
                runs - failed[n], what, failed[n]);
    total += failed[n];
  }
  return total == 0 ? 0 : 1;
}

}  // namespace attn_kernels::check
