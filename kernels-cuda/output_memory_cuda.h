// allocate_output: our ops' output buffers on MLX's CUDA backend (output_memory.h says why).
#pragma once

#include <cstddef>

#include "mlx/array.h"
#include "mlx/backend/cuda/device.h"

namespace attn_kernels {

namespace mx = mlx::core;

// Gives `out` a buffer of `bytes` (at least out.nbytes(); a split call keeps its partial states
// behind the output): device memory ordered on the encoder's stream, or allocator::malloc's
// managed memory where output_memory() was switched off or the device has no memory pools.
void allocate_output(mx::array& out, size_t bytes, mx::cu::CommandEncoder& encoder);

}  // namespace attn_kernels
