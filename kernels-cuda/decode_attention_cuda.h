// The CUDA launch plan: which kernels, grids and shared memory for a problem and schedule.
// Free of MLX headers (nvcc compiles the .cu that implements it).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "decode_problem.h"

namespace attn_kernels::cuda {

enum class Schedule {
  automatic,
  split_mma,
  split_mma16,
  split_gqa,
  split,
  chapter8,
  chapter16,
  chapter32
};

Schedule parse_schedule(const std::string& name);

// One launch: attend(problem, partials, chunk, arrival_slot) on attend_grid.
struct Plan {
  CUfunction attend;
  unsigned attend_grid[2];  // (kv_rows * tiles, splits)
  unsigned attend_threads;
  uint32_t attend_smem;
  int chunk;
  int splits;
  size_t partial_floats;  // workspace for the chunks' partial states, 0 when splits == 1
  unsigned arrival_slot;  // first of this call's arrival counters (splits > 1)
  // split-mma with L <= 8 only (else nullptr): the same launch with AttentionStep's
  // preprocessing folded in, attend_step(problem, partials, chunk, arrival_slot, StepProblem)
  // with attend_step_smem bytes (decode_attention_mma.cuh).
  CUfunction attend_step;
  uint32_t attend_step_smem;
};

Plan plan(const DecodeProblem& problem, Schedule schedule);

}  // namespace attn_kernels::cuda
