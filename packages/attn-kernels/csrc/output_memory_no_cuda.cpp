// output_memory for MLX builds without the CUDA backend: outputs come from MLX's allocator.
#include "output_memory.h"

namespace attn_kernels {

std::optional<OutputMemory> output_memory(std::optional<bool>) {
  return std::nullopt;
}

}  // namespace attn_kernels
