// Where our ops' outputs live on MLX's CUDA backend. The one allocation MLX 0.32 exports,
// allocator::malloc, returns CUDA managed memory; and when its buffer cache hands it a block one
// of MLX's own ops freed (device memory), it first moves that block into managed memory with a
// synchronous cudaMemcpy (mlx/backend/cuda/allocator.cpp). So on CUDA our outputs come from
// device memory the extension keeps (kernels-cuda/output_memory_cuda.cpp) unless switched back.
#pragma once

#include <cstdint>
#include <optional>

namespace attn_kernels {

struct OutputMemory {
  bool device;           // outputs in the extension's device memory (else allocator::malloc)
  int64_t live_bytes;    // held by arrays now
  int64_t cached_bytes;  // freed, kept for reuse
  int64_t allocations;   // cudaMallocAsync calls so far (a reuse is not one)
};

// The state after setting `device` where given; nullopt without the CUDA backend.
std::optional<OutputMemory> output_memory(std::optional<bool> device);

}  // namespace attn_kernels
