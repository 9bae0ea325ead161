// The CUDA backend's settings (attn_kernels.cuda_backend) for MLX builds without it: no CUDA
// graphs to limit, and outputs come from MLX's allocator.
#include "graph_limits.h"
#include "output_memory.h"

namespace attn_kernels {

std::optional<std::pair<int, int>> set_graph_limits(mx::Stream, int, int) {
  return std::nullopt;
}

std::optional<OutputMemory> output_memory(std::optional<bool>) {
  return std::nullopt;
}

}  // namespace attn_kernels
