// set_graph_limits on MLX's CUDA backend: the stream's CommandEncoder keeps its limits in
// private members (max_ops_per_graph_, max_mb_per_graph_; mlx/backend/cuda/device.h, 0.32.4),
// set from the environment when the encoder is made and read by needs_commit() after every op.
// They are reached as attention_step.cpp reaches array_desc_: through pointers to the private
// members, which an explicit instantiation may name ([temp.spec.general]).
#include "graph_limits.h"
#include "mlx/backend/cuda/device.h"

namespace attn_kernels {

namespace {

struct MaxOpsTag {
  friend constexpr auto member(MaxOpsTag);
};
struct MaxMbTag {
  friend constexpr auto member(MaxMbTag);
};
template <typename Tag, auto Member>
struct Access {
  friend constexpr auto member(Tag) { return Member; }
};
template struct Access<MaxOpsTag, &mx::cu::CommandEncoder::max_ops_per_graph_>;
template struct Access<MaxMbTag, &mx::cu::CommandEncoder::max_mb_per_graph_>;

}  // namespace

std::optional<std::pair<int, int>> set_graph_limits(mx::Stream stream, int max_ops, int max_mb) {
  if (stream.device != mx::Device::gpu) {
    return std::nullopt;
  }
  auto& encoder = mx::cu::get_command_encoder(stream);
  int& ops = encoder.*member(MaxOpsTag{});
  int& mb = encoder.*member(MaxMbTag{});
  const std::pair<int, int> before{ops, mb};
  if (max_ops > 0) ops = max_ops;
  if (max_mb > 0) mb = max_mb;
  return before;
}

}  // namespace attn_kernels
