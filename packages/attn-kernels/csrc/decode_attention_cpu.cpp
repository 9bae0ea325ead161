// The CPU attention kernels' dispatcher: picks the instruction-set path and runs its kernel body
// (cpu_kernel_body.h; over a quantized cache, cpu_kernel_quantized_body.h) through the split
// (cpu_split.h); the thread pool and its settings.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "cpu_kernel.h"
#include "cpu_scalar.h"
#include "cpu_split.h"
#include "thread_pool.h"

namespace attn_kernels {
namespace {

using namespace cpu;

struct PathInfo {
  CpuPath path;
  const char* name;
  const char* needs;  // what the CPU must have, for the error message
};

constexpr PathInfo kPaths[] = {
    {CpuPath::avx512, "avx512", "AVX-512 F, BW, DQ, VL, FMA and F16C (x86-64)"},
    {CpuPath::avx2, "avx2", "AVX2, FMA and F16C (x86-64)"},
    {CpuPath::portable, "portable", "nothing beyond the architecture's baseline"},
    {CpuPath::neon, "neon", "an arm64 CPU (NEON is part of its baseline)"},
};

bool cpu_runs(CpuPath path) {
  switch (path) {
#if defined(ATTN_CPU_X86)
    case CpuPath::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case CpuPath::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c");
    case CpuPath::portable:
      return true;
#elif defined(ATTN_CPU_ARM64)
    case CpuPath::neon:
      return true;
#else
    case CpuPath::portable:
      return true;
#endif
    default:
      return false;  // not built for this architecture
  }
}

Kernel kernel_for(CpuPath path) {
  switch (path) {
#if defined(ATTN_CPU_X86)
    case CpuPath::avx512: return kernel_avx512();
    case CpuPath::avx2: return kernel_avx2();
    case CpuPath::portable: return kernel_portable();
#elif defined(ATTN_CPU_ARM64)
    case CpuPath::neon: return kernel_neon();
#else
    case CpuPath::portable: return kernel_portable();
#endif
    default: break;
  }
  throw std::logic_error(std::string("CPU kernel path not built: ") + cpu_path_name(path));
}

std::string supported_names() {
  std::string names;
  for (CpuPath path : cpu_paths_supported()) {
    names += (names.empty() ? "" : ", ") + std::string(cpu_path_name(path));
  }
  return names;
}

// CPUs the cgroup's quota allows (cgroup v2 cpu.max "quota period"), or 0 when unlimited.
int cgroup_cpu_limit() {
#if defined(__linux__)
  std::ifstream file("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long period = 0;
  if (file >> quota >> period && quota != "max" && period > 0) {
    const long q = std::atol(quota.c_str());
    return static_cast<int>(std::max(1L, (q + period - 1) / period));
  }
#endif
  return 0;
}

// Below this many multiply-adds waking the pool costs more than it saves: a sleeping worker takes
// ~110 µs to wake on this project's VM (a no-op parallel_for), and between decode calls it always
// sleeps. Through MLX, Qwen3-4B shapes: one thread was faster up to S = 512 (200 vs 216-270 µs
// at 128, 373-428 vs 415-445 at 512), two from 1024 on (687-741 vs 812-1146); 2^22 = S 1024 there.
// (Workers that spun instead of sleeping won back to back but lost once other ops ran between
// calls on this VM: vCPUs that spun woke even later. Bounded polling is an option, below.)
constexpr int64_t kMinParallelWork = int64_t{1} << 22;
// How long the pool's workers poll for the next call before they sleep
// (ATTN_KERNELS_POOL_SPIN_US overrides it). 0, sleep at once, until a measurement shows polling
// helps: on 2 vCPUs 50 µs was within the noise, and polling
// workers take cores from the ops that follow attention in a decode step (docs/cpu-kernel.md,
// with the 16-core host's 0, 50 and 200 µs).
constexpr std::chrono::nanoseconds kDefaultWorkerSpin = std::chrono::microseconds(0);
// Context chunks are at least this long, so merging stays negligible.
constexpr int kMinChunk = 256;
// Units (KV row x context chunk) per thread the context split aims at
// (ATTN_KERNELS_CPU_UNITS_PER_THREAD overrides it; see cpu_context_chunks).
constexpr int kDefaultUnitsPerThread = 8;

// The split's sweep knobs, as the last evaluated op read them (cpu_split_from_env); read where
// the op runs. call_threads 0: the whole pool.
std::atomic<int> units_per_thread{kDefaultUnitsPerThread};
std::atomic<int> call_threads{0};

// The threads a problem runs on: the pool's (or ATTN_KERNELS_CALL_THREADS of them), or the caller
// alone below kMinParallelWork.
int pool_threads(const DecodeProblem& p) {
  return cpu_threads_for(int64_t{p.kv_rows} * p.context * p.group * p.query_len * p.head_dim);
}

// $name in microseconds (0 to 1e6), else `fallback`; std::invalid_argument naming the variable.
std::chrono::nanoseconds microseconds_from_env(const char* name,
                                               std::chrono::nanoseconds fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const double us = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(us >= 0.0) || us > 1e6) {
    throw std::invalid_argument(std::string(name) + "=" + env +
                                ": expected microseconds between 0 and 1000000");
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3));
}

// $name as an integer in [lo, hi], else `fallback`; std::invalid_argument naming the variable.
int integer_from_env(const char* name, int lo, int hi, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || n < lo || n > hi) {
    throw std::invalid_argument(std::string(name) + "=" + env + ": expected an integer between " +
                                std::to_string(lo) + " and " + std::to_string(hi));
  }
  return static_cast<int>(n);
}

// The sweep knobs of the split, read on the thread evaluating an op (as the path and the pool's
// spin): ATTN_KERNELS_CALL_THREADS, the threads one call uses (1 to the pool's size; unset: all
// of them), and ATTN_KERNELS_CPU_UNITS_PER_THREAD (1 to 64; unset: kDefaultUnitsPerThread).
void cpu_split_from_env() {
  call_threads.store(integer_from_env("ATTN_KERNELS_CALL_THREADS", 1, cpu_pool().size(), 0),
                     std::memory_order_relaxed);
  units_per_thread.store(
      integer_from_env("ATTN_KERNELS_CPU_UNITS_PER_THREAD", 1, 64, kDefaultUnitsPerThread),
      std::memory_order_relaxed);
}

template <typename T>
void run(const DecodeProblem& p, const Kernel& kernel) {
  const SplitLayout layout{padded_dim(p.head_dim, kernel.width), kernel.scratch_floats(p),
                           p.dtype == ElementType::bfloat16, kernel.width};
  run_split<T>(p, p.out, layout, [&](int kv_row, int begin, int end, float* state, float* scratch) {
    kernel.attend(p, kv_row, begin, end, state, scratch);
  });
}

// Sums 64-bit words in independent lanes: a pure streaming read the compiler vectorises.
#if defined(ATTN_CPU_X86) && defined(__linux__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
uint64_t sum_words(const uint64_t* data, size_t n) {
  uint64_t lanes[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      lanes[l] += data[i + l];
    }
  }
  uint64_t total = 0;
  for (uint64_t x : lanes) {
    total += x;
  }
  return total;
}

}  // namespace

const char* cpu_path_name(CpuPath path) {
  for (const PathInfo& info : kPaths) {
    if (info.path == path) return info.name;
  }
  return "?";
}

std::vector<CpuPath> cpu_paths_supported() {
  std::vector<CpuPath> paths;
  for (const PathInfo& info : kPaths) {
    if (cpu_runs(info.path)) paths.push_back(info.path);
  }
  return paths;
}

CpuPath cpu_path_from_env() {
  // The ops resolve the path when they are evaluated, on the calling thread: the pool's
  // variables are read there too (a bad value raises there, not inside the dispatched task, and
  // the CPU stream's thread never reads the environment while Python may be writing it).
  cpu_pool().set_worker_spin(cpu_worker_spin());
  cpu_pool_prewake();
  cpu_split_from_env();
  const char* env = std::getenv("ATTN_KERNELS_CPU_PATH");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) {
    return cpu_paths_supported().front();
  }
  for (const PathInfo& info : kPaths) {
    if (std::strcmp(env, info.name) == 0) {
      if (!cpu_runs(info.path)) {
        throw std::invalid_argument(
            std::string("ATTN_KERNELS_CPU_PATH=") + env + ": needs " + info.needs +
            ", which this CPU or build lacks; paths here: " + supported_names());
      }
      return info.path;
    }
  }
  throw std::invalid_argument(
      std::string("ATTN_KERNELS_CPU_PATH=") + env +
      ": unknown path (avx512, avx2, portable, neon or auto); paths here: " + supported_names());
}

int cpu_threads() {
  if (const char* env = std::getenv("ATTN_KERNELS_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) {
      return n;
    }
  }
  int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#if defined(__linux__)
  // hardware_concurrency counts the host's CPUs; a container may run on a few of them.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    n = std::min(n, std::max(1, CPU_COUNT(&set)));
  }
#endif
  if (const int limit = cgroup_cpu_limit(); limit > 0) {
    n = std::min(n, limit);
  }
  return n;
}

double measure_read_bandwidth(size_t bytes, int repeats) {
  const size_t words = bytes / sizeof(uint64_t);
  std::vector<uint64_t> buffer(words, 1);
  const int threads = cpu_pool().size();
  const size_t per_thread = (words / threads) / 8 * 8;
  std::vector<uint64_t> sums(threads);
  double best = 0.0;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    cpu_pool().parallel_for(threads, [&](int t) {
      sums[t] = sum_words(buffer.data() + t * per_thread, per_thread);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(per_thread * threads * sizeof(uint64_t)) / seconds);
  }
  if (sums[0] != per_thread) {  // keeps the reads observable
    throw std::logic_error("measure_read_bandwidth: unexpected sum");
  }
  return best;
}

void decode_attention_cpu(const DecodeProblem& p, CpuPath path) {
  const Kernel kernel = kernel_for(path);
  switch (p.dtype) {
    case ElementType::float32: run<float>(p, kernel); break;
    case ElementType::float16: run<Float16>(p, kernel); break;
    case ElementType::bfloat16: run<BFloat16>(p, kernel); break;
    case ElementType::boolean: break;  // rejected by the op
  }
}

void decode_attention_quantized_cpu(const QuantizedProblem& p, CpuPath path) {
  const Kernel kernel = kernel_for(path);
  const SplitLayout layout{p.head_dim, kernel.quantized_scratch_floats(p), p.bits == 4,
                           kernel.width};
  auto attend = [&](int kv_row, int begin, int end, float* state, float* scratch) {
    kernel.attend_quantized(p, kv_row, begin, end, state, scratch);
  };
  switch (p.dtype) {
    case ElementType::float32: run_split<float>(p, p.out, layout, attend); break;
    case ElementType::float16: run_split<Float16>(p, p.out, layout, attend); break;
    case ElementType::bfloat16: run_split<BFloat16>(p, p.out, layout, attend); break;
    case ElementType::boolean: break;  // rejected by the op
  }
}

std::chrono::nanoseconds cpu_worker_spin() {
  return microseconds_from_env("ATTN_KERNELS_POOL_SPIN_US", kDefaultWorkerSpin);
}

std::chrono::nanoseconds cpu_pool_prewake() {
  return microseconds_from_env("ATTN_KERNELS_POOL_PREWAKE_US", std::chrono::nanoseconds(0));
}

void decode_attention_cpu_prepare(const DecodeProblem& p) {
  if (const auto window = cpu_pool_prewake(); window.count() > 0 && pool_threads(p) > 1) {
    cpu_pool().prewake(window);
  }
}

int cpu_threads_for(int64_t multiply_adds) {
  if (multiply_adds < kMinParallelWork) return 1;
  const int pool = cpu_pool().size(), limit = call_threads.load(std::memory_order_relaxed);
  return limit > 0 ? std::min(limit, pool) : pool;
}

// Split the context too until there are at least 8 units per thread, so every thread starts at
// once and the pool's first-come hand-out evens out late starters. In-process A/B, Qwen3-4B
// shapes, 2 threads, 8 vs 4 units per thread: 0.95/0.89 of the time at S = 1024, 0.97/0.98 at
// 4096; 16 per thread: 1.05/1.03 at 1024. (16 threads, 8 KV heads: 16 chunks, 256 positions
// each at S = 4096; bench-eval-overhead --call-threads sweeps it.)
int cpu_context_chunks(int kv_rows, int context, int threads) {
  const int per_thread = units_per_thread.load(std::memory_order_relaxed);
  if (threads <= 1 || kv_rows >= per_thread * threads) return 1;
  const int wanted = (per_thread * threads + kv_rows - 1) / kv_rows;
  return std::max(1, std::min(wanted, context / kMinChunk));
}

ThreadPool& cpu_pool() {
  // Its worker spin is set where an op resolves its path (cpu_path_from_env), at every
  // evaluation, as ATTN_KERNELS_CPU_PATH is read, so one process can compare settings.
  static ThreadPool instance(cpu_threads());
  [[maybe_unused]] static const bool spin_set =
      (instance.set_worker_spin(kDefaultWorkerSpin), true);
  return instance;
}

}  // namespace attn_kernels
