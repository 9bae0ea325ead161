// The CPU linear kernel's pieces and how they meet, free of MLX headers (as cpu_kernel.h for
// attention). One body (cpu_linear_body.h) is compiled once per instruction set, in the same
// files as the attention body (cpu_kernel_<path>.cpp); the dispatcher (linear_cpu.cpp) prepares
// the activations once per call and splits the weight's rows over the thread pool.
#pragma once

#include <cstddef>

#include "cpu_kernel.h"
#include "linear_problem.h"

namespace attn_kernels {

// out = x @ W^T (+ bias) on the path's kernel; rows of x in chunks of cpu::kLinearRows.
void linear_cpu(const LinearProblem& problem, CpuPath path);

namespace cpu {

// Rows of x one pass over the weights serves (a decode step's tokens, a speculative verify).
constexpr int kLinearRows = 8;

// One compiled copy of the linear body. Every function takes a problem of at most kLinearRows
// rows.
struct LinearKernel {
  // Floats per row of x once prepared: its values as floats, in the order the weight's
  // widening produces them (and scaled to meet the codes' bit positions where W is quantized),
  // then, for a quantized W, the sum of each group.
  size_t (*prepared_floats)(const LinearProblem& p);
  // Writes p.rows rows rounded up to 1, 2, 4 or 8 (the loops' row counts; the extra rows zero).
  // `prepared` has room for kLinearRows + 1 rows: a gated problem's hidden rows pass through the
  // row after the bucket's.
  void (*prepare)(const LinearProblem& p, float* prepared);
  // Columns [begin, end) of out (rows [begin, end) of W) for every row of x.
  void (*columns)(const LinearProblem& p, const float* prepared, int begin, int end);
};

LinearKernel linear_kernel_avx512();
LinearKernel linear_kernel_avx2();
LinearKernel linear_kernel_portable();
LinearKernel linear_kernel_neon();

}  // namespace cpu
}  // namespace attn_kernels
