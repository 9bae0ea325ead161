// The CPU kernel's pieces and how they meet, free of MLX headers (the arm64 test driver builds
// them with a cross compiler alone). One kernel body (cpu_kernel_body.h) is compiled once per
// instruction set (cpu_kernel_<path>.cpp, each with its own compiler flags); the dispatcher
// (decode_attention_cpu.cpp) picks one at run time, splits the work over its thread pool and
// merges the partial results.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "decode_problem.h"
#include "quantized_problem.h"

// The architecture the paths are built for: x86-64 (avx512, avx2, portable), arm64 (neon), or
// neither (portable).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_CPU_X86 1
#elif defined(__aarch64__)
#define ATTN_CPU_ARM64 1
#endif

namespace attn_kernels {

enum class CpuPath { avx512, avx2, portable, neon };

const char* cpu_path_name(CpuPath path);
// The paths this build has and this CPU can run, best first.
std::vector<CpuPath> cpu_paths_supported();
// $ATTN_KERNELS_CPU_PATH when set (and not "auto"), else the first supported path. Throws
// std::invalid_argument, naming the variable, for a name that is unknown, not built for this
// architecture, or needs instructions this CPU lacks.
CpuPath cpu_path_from_env();

void decode_attention_cpu(const DecodeProblem& problem, CpuPath path);
void decode_attention_quantized_cpu(const QuantizedProblem& problem, CpuPath path);

// Best read rate (bytes/s) of the CPU kernel's thread pool streaming over `bytes` of memory.
double measure_read_bandwidth(size_t bytes, int repeats);

// Threads the pool runs (the caller included): $ATTN_KERNELS_NUM_THREADS, else the CPUs this
// process may run on (affinity mask and cgroup CPU quota), not every CPU of the host.
int cpu_threads();

// How long the pool's workers poll for the next call after their last task before they sleep:
// $ATTN_KERNELS_POOL_SPIN_US (microseconds), else the default (decode_attention_cpu.cpp).
// std::invalid_argument naming the variable when it is not a number in [0, 1e6].
std::chrono::nanoseconds cpu_worker_spin();

// How long workers woken ahead of a call poll for it: $ATTN_KERNELS_POOL_PREWAKE_US, default 0
// (no prewake). Same errors as cpu_worker_spin.
std::chrono::nanoseconds cpu_pool_prewake();

// Called where the op is evaluated, before its task is dispatched to the CPU stream's thread:
// with a prewake window set and a problem big enough for the pool, wakes the pool's workers so
// that their wake-up overlaps the stream thread's.
void decode_attention_cpu_prepare(const DecodeProblem& problem);

class ThreadPool;
// The CPU kernels' one pool of cpu_threads() threads (the bf16 and the quantized kernel share it).
ThreadPool& cpu_pool();

// How the CPU kernels (bf16 and quantized) split a call: the threads `multiply_adds` of work runs
// on (the pool's, or the caller alone when waking workers would cost more), and the context
// chunks per KV head that give those threads enough units to start at once.
int cpu_threads_for(int64_t multiply_adds);
int cpu_context_chunks(int kv_rows, int context, int threads);

namespace cpu {

// One compiled copy of the kernel body.
struct Kernel {
  // Floats per vector register. The head dimension is walked in pairs of vectors (2 * width
  // values); rows whose length is not a multiple of that are zero-padded.
  int width;
  // Floats of scratch `attend` needs.
  size_t (*scratch_floats)(const DecodeProblem& p);
  // Key/value row kv_row, positions [begin, end), every query vector of its group (group * L of
  // them). Writes per vector: running max, denominator, then the padded accumulator in
  // `accumulator_index` order (see below).
  void (*attend)(const DecodeProblem& p, int kv_row, int begin, int end, float* state,
                 float* scratch);
  // The same over a quantized cache (cpu_kernel_quantized_body.h): accumulators of head_dim
  // floats, in bf16's accumulator_index order at 4 bits, in order at 8.
  size_t (*quantized_scratch_floats)(const QuantizedProblem& p);
  void (*attend_quantized)(const QuantizedProblem& p, int kv_row, int begin, int end,
                           float* state, float* scratch);
};

Kernel kernel_avx512();
Kernel kernel_avx2();
Kernel kernel_portable();
Kernel kernel_neon();

constexpr int kStateHeader = 2;  // max, denominator

[[gnu::always_inline]] inline int padded_dim(int d, int width) {
  return (d + 2 * width - 1) / (2 * width) * (2 * width);
}

// Where dimension d of an accumulator (and of a widened query or K/V row) sits. bf16 is widened
// without shuffles: a 32-bit lane holds values 2i and 2i+1; a shift puts the even one in a
// float and a mask keeps the odd one. So each pair of vectors holds the even dimensions of its
// 2 * width, then the odd ones; other types keep their order.
[[gnu::always_inline]] inline int accumulator_index(int d, ElementType dtype, int width) {
  if (dtype != ElementType::bfloat16) {
    return d;
  }
  const int pair = 2 * width, base = d / pair * pair, e = d % pair;
  return base + (e & 1) * width + e / 2;
}

}  // namespace cpu
}  // namespace attn_kernels
