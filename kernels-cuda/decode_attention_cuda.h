// The CUDA launch plan: which kernels, grids and shared memory for a problem and schedule.
// Free of MLX headers (nvcc compiles the .cu that implements it).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "decode_problem.h"

namespace attn_kernels::cuda {

enum class Schedule { automatic, split_mma, split_gqa, split, chapter8, chapter16, chapter32 };

Schedule parse_schedule(const std::string& name);

struct Plan {
  CUfunction attend;
  CUfunction merge;  // null when splits == 1
  unsigned attend_grid[2];
  unsigned attend_threads;
  uint32_t attend_smem;
  int chunk;
  int splits;
  size_t partial_floats;  // workspace for the merge, 0 when splits == 1
  unsigned merge_blocks;
  unsigned merge_threads;
  uint32_t merge_smem;  // one rescale factor per chunk
};

Plan plan(const DecodeProblem& problem, Schedule schedule);

}  // namespace attn_kernels::cuda
