// How often MLX's CUDA backend commits the graph it builds on a stream: every `ops` kernels or
// `mb` "MB" of inputs (MLX_MAX_OPS_PER_BUFFER and MLX_MAX_MB_PER_BUFFER, read once per process;
// 100 and 1000 on sm_90). A batched decode step holds ~400 kernels, so it commits mid-step.
#pragma once

#include <optional>
#include <utility>

#include "mlx/stream.h"

namespace attn_kernels {

namespace mx = mlx::core;

// The stream's limits (ops, mb) before the call, then each of max_ops and max_mb that is > 0
// set; nullopt where MLX builds no CUDA graphs (a CPU stream, a CPU or Metal build).
std::optional<std::pair<int, int>> set_graph_limits(mx::Stream stream, int max_ops, int max_mb);

}  // namespace attn_kernels
