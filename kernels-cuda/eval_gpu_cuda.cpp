// eval_gpu through MLX's CUDA command encoder: kernels are added to MLX's graph as raw driver
// functions (see decode_attention.cu for why).
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
  // (max, denominator, accumulator) per context chunk, merged inside the same launch; kept
  // alive by the encoder until the graph has run.
  float* partials = nullptr;
  if (plan.splits > 1) {
    mx::array workspace(mx::Shape{static_cast<int>(plan.partial_floats)}, mx::float32, nullptr,
                        std::vector<mx::array>{});
    workspace.set_data(mx::allocator::malloc(workspace.nbytes()));
    encoder.add_temporary(workspace);
    partials = workspace.data<float>();
  }
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  void* args[] = {&problem, &partials, &chunk, &slot};
  encoder.add_kernel_node_raw(
      plan.attend, dim3(plan.attend_grid[0], plan.attend_grid[1]), dim3(plan.attend_threads),
      dim3(1, 1, 1), plan.attend_smem, args);
}

}  // namespace attn_kernels
