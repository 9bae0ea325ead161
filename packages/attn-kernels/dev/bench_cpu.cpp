// Kernel-only timing of the CPU paths (no MLX, no Python): decode_attention_cpu on Qwen3-4B
// shapes (bf16, Hq=32, Hkv=8, D=128, L=1), K/V either hot (one set, reused) or cold (sets
// rotated over 1.5 GB so every call streams from DRAM), the paths interleaved call by call in
// one process; one KV head on one thread (the kernel's own rate); and the thread pool's hand-off
// (an empty parallel_for over every thread, workers asleep before each call as between decode
// steps, and back to back; workers sleeping at once after a call, and polling for
// ATTN_KERNELS_POOL_SPIN_US or the default first). From the repository root:
//
//   make bench-cpu-kernel ARGS="[PATH...]"      ARGS=handoff: the hand-off alone
//
// PATH: avx512, avx2, portable, neon (default: every path this CPU runs). ATTN_KERNELS_NUM_THREADS
// caps the threads as in the extension; ATTN_KERNELS_POOL_SPIN_US, ATTN_KERNELS_CALL_THREADS and
// ATTN_KERNELS_CPU_UNITS_PER_THREAD apply as they do to the op. Prints one line per (state, S,
// path): median and min µs, GB/s of K+V, and the fraction of the read rate measured first.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cpu_kernel.h"
#include "attention_case.h"
#include "thread_pool.h"

using namespace attn_kernels;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The pool's hand-off: one task per thread, each spinning for 50 µs; the call's time beyond 50 µs
// is what it costs to get every thread going (and to learn they are done), from sleeping workers
// (2 ms between calls, as between decode steps) and back to back, with the workers sleeping at
// once after a call (spin 0, the previous pool) and polling for `spin` first.
void handoff(int threads, std::chrono::nanoseconds spin) {
  ThreadPool pool(threads);
  auto task = [](int) {
    const auto end = Clock::now() + std::chrono::microseconds(50);
    while (Clock::now() < end) {
    }
  };
  for (const auto worker_spin : {std::chrono::nanoseconds(0), spin}) {
    pool.set_worker_spin(worker_spin);
    std::vector<double> asleep, back_to_back;
    for (int i = 0; i < 400; ++i) {
      const bool sleep = i % 2 == 0;
      if (sleep) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const auto start = Clock::now();
      pool.parallel_for(threads, task);
      const double us = std::chrono::duration<double>(Clock::now() - start).count() * 1e6 - 50;
      (sleep ? asleep : back_to_back).push_back(us);
    }
    std::printf("pool hand-off, %d threads x 50 us tasks, worker spin %4.0f us: +%.1f us from "
                "sleep, +%.1f us back to back (medians of 200)\n", threads,
                worker_spin.count() / 1e3, median(asleep), median(back_to_back));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<CpuPath> paths;
  const bool handoff_only = argc == 2 && argv[1] == std::string("handoff");
  if (handoff_only) {
    handoff(cpu_threads(), cpu_worker_spin());
    return 0;
  }
  for (int a = 1; a < argc; ++a) {
    for (CpuPath path : cpu_paths_supported()) {
      if (argv[a] == std::string(cpu_path_name(path))) paths.push_back(path);
    }
  }
  if (paths.empty()) paths = cpu_paths_supported();
  cpu_path_from_env();  // applies the pool's spin and the split's knobs, as an op's evaluation
  const double read_gbs = measure_read_bandwidth(size_t{1} << 30, 5) / 1e9;
  std::printf("threads %d, read rate %.1f GB/s (2^30 bytes, best of 5)\n", cpu_threads(), read_gbs);
  handoff(cpu_threads(), cpu_worker_spin());
  for (const bool cold : {false, true}) {
    for (const int S : {1024, 4096, 16384, 65536}) {
      const double set_bytes = dev::Case::set_bytes(S);
      const int sets = cold ? std::max(2, static_cast<int>(1.5e9 / set_bytes)) : 1;
      dev::Case c(S, sets);
      const int calls = std::max(3 * sets, S >= 65536 ? 15 : 31);
      std::vector<std::vector<double>> us(paths.size());
      for (int i = 0, call = 0; i < calls; ++i) {
        for (size_t k = 0; k < paths.size(); ++k, ++call) {
          const size_t n = (k + i) % paths.size();  // rotate which path goes first
          c.use_set(call % sets);  // cold: a set no call has read for sets - 1 calls
          const auto start = Clock::now();
          decode_attention_cpu(c.p, paths[n]);
          const auto stop = Clock::now();
          if (i >= sets) us[n].push_back(std::chrono::duration<double>(stop - start).count() * 1e6);
        }
      }
      for (size_t n = 0; n < paths.size(); ++n) {
        const double m = median(us[n]), floor_us = c.kv_bytes() / read_gbs / 1e3;
        std::printf("%s S=%-6d %-8s median %8.1f us (min %8.1f)  %5.1f GB/s  %3.0f%% of floor\n",
                    cold ? "cold" : "hot ", S, cpu_path_name(paths[n]), m,
                    *std::min_element(us[n].begin(), us[n].end()), c.kv_bytes() / m / 1e3,
                    100 * floor_us / m);
      }
    }
  }
  // The kernel's own rate: one KV head (4 query heads), K/V hot, below the pool's threshold so
  // one thread; ns per position (K+V of a position: 512 bytes).
  for (const int S : {1024, 4096}) {
    dev::Case c(S, 1);
    c.p.rows = c.p.q_heads = c.p.group;
    c.p.kv_rows = c.p.kv_heads = 1;
    std::vector<std::vector<double>> ns(paths.size());
    for (int i = 0; i < 200000 / S; ++i) {
      for (size_t k = 0; k < paths.size(); ++k) {
        const size_t n = (k + i) % paths.size();
        const auto start = Clock::now();
        decode_attention_cpu(c.p, paths[n]);
        ns[n].push_back(std::chrono::duration<double>(Clock::now() - start).count() * 1e9 / S);
      }
    }
    for (size_t n = 0; n < paths.size(); ++n) {
      std::printf("one head, one thread, S=%-5d %-8s %5.1f ns per position\n", S,
                  cpu_path_name(paths[n]), median(ns[n]));
    }
  }
}
