// DecodeAttentionQuantized::eval_gpu through MLX's CUDA command encoder (as eval_gpu_cuda.cpp).
#include "decode_attention_quantized.h"
#include "decode_attention_quantized_cuda.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "output_memory_cuda.h"

namespace attn_kernels {

void DecodeAttentionQuantized::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  // gpu_ptr, not data(): data() would move a device buffer into unified memory (a copy).
  QuantizedProblem problem = this->problem(
      inputs, [](const mx::array& a) { return static_cast<const void*>(mx::gpu_ptr<char>(a)); });
  const cuda::QuantizedPlan plan = cuda::plan_quantized(problem);
  // The chunks' partial states live behind the output (256-byte aligned), as in eval_gpu_cuda.cpp.
  const size_t partials_at = (out.nbytes() + 255) / 256 * 256;
  auto& encoder = mx::cu::get_command_encoder(stream());
  allocate_output(
      out, plan.splits > 1 ? partials_at + plan.partial_floats * sizeof(float) : out.nbytes(),
      encoder);
  problem.out = mx::gpu_ptr<char>(out);
  float* partials =
      plan.splits > 1 ? reinterpret_cast<float*>(mx::gpu_ptr<char>(out) + partials_at) : nullptr;
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  void* args[] = {&problem, &partials, &chunk, &slot};
  encoder.add_kernel_node_raw(plan.attend, dim3(plan.grid[0], plan.grid[1]), dim3(plan.threads),
                              dim3(1, 1, 1), plan.smem, args);
}

}  // namespace attn_kernels
