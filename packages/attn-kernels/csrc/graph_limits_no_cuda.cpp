// set_graph_limits for MLX builds without the CUDA backend: no CUDA graphs to limit.
#include "graph_limits.h"

namespace attn_kernels {

std::optional<std::pair<int, int>> set_graph_limits(mx::Stream, int, int) {
  return std::nullopt;
}

}  // namespace attn_kernels
