// set_graph_limits on MLX's CUDA backend: the stream's CommandEncoder keeps its limits in
// private members (max_ops_per_graph_, max_mb_per_graph_; mlx/backend/cuda/device.h, 0.32.4),
// set from the environment when the encoder is made and read by needs_commit() after every op;
// reached as private_member.h describes.
#include "graph_limits.h"
#include "mlx/backend/cuda/device.h"
#include "private_member.h"

namespace attn_kernels {

struct EncoderMaxOps {
  friend constexpr auto private_member(EncoderMaxOps);
};
struct EncoderMaxMb {
  friend constexpr auto private_member(EncoderMaxMb);
};
template struct PrivateMember<EncoderMaxOps, &mx::cu::CommandEncoder::max_ops_per_graph_>;
template struct PrivateMember<EncoderMaxMb, &mx::cu::CommandEncoder::max_mb_per_graph_>;

std::optional<std::pair<int, int>> set_graph_limits(mx::Stream stream, int max_ops, int max_mb) {
  if (stream.device != mx::Device::gpu) {
    return std::nullopt;
  }
  auto& encoder = mx::cu::get_command_encoder(stream);
  int& ops = encoder.*private_member(EncoderMaxOps{});
  int& mb = encoder.*private_member(EncoderMaxMb{});
  const std::pair<int, int> before{ops, mb};
  if (max_ops > 0) ops = max_ops;
  if (max_mb > 0) mb = max_mb;
  return before;
}

}  // namespace attn_kernels
