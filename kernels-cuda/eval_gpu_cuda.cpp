// eval_gpu through MLX's CUDA command encoder: kernels are added to MLX's graph as raw driver
// functions (see decode_attention.cu for why).
#include <optional>

#include "decode_attention.h"
#include "decode_attention_cuda.h"
#include "mlx/backend/cuda/device.h"

namespace attn_kernels {

void DecodeAttention::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);

  DecodeProblem problem = make_problem(inputs, out, scale_, causal_);
  const cuda::Plan plan = cuda::plan(problem, cuda::parse_schedule(schedule_));
  // (max, denominator, accumulator) per context chunk, for the merge; kept alive by the encoder
  // until the graph has run.
  float* partials = nullptr;
  std::optional<mx::array> workspace;
  if (plan.splits > 1) {
    workspace.emplace(mx::Shape{static_cast<int>(plan.partial_floats)}, mx::float32, nullptr,
                      std::vector<mx::array>{});
    workspace->set_data(mx::allocator::malloc(workspace->nbytes()));
    encoder.add_temporary(*workspace);
    encoder.set_output_array(*workspace);
    partials = workspace->data<float>();
  }
  int chunk = plan.chunk;
  void* attend_args[] = {&problem, &partials, &chunk};
  encoder.add_kernel_node_raw(
      plan.attend, dim3(plan.attend_grid[0], plan.attend_grid[1]), dim3(plan.attend_threads),
      dim3(1, 1, 1), plan.attend_smem, attend_args);
  if (plan.splits > 1) {
    // MLX orders graph nodes by the arrays they read and write: the merge reads the workspace.
    encoder.set_input_array(*workspace);
    encoder.set_output_array(out);
    int splits = plan.splits;
    void* merge_args[] = {&problem, &partials, &splits};
    encoder.add_kernel_node_raw(
        plan.merge, dim3(plan.merge_blocks), dim3(plan.merge_threads), dim3(1, 1, 1), plan.merge_smem,
        merge_args);
  }
}

}  // namespace attn_kernels
