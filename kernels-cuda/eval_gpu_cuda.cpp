// eval_gpu through MLX's CUDA command encoder: kernels are added to MLX's graph as raw driver
// functions (see decode_attention.cu for why).
#include "decode_attention.h"
#include "decode_attention_cuda.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "output_memory_cuda.h"

namespace attn_kernels {

void DecodeAttention::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  // Device pointers as MLX's own kernels take them: data() would move every input that lives in
  // device memory into unified memory (a copy on its first use; kernels-cuda/README.md).
  const auto device_pointer = [](const mx::array& a) { return mx::gpu_ptr<void>(a); };
  DecodeProblem problem = this->problem(inputs, device_pointer);
  const cuda::Plan plan = cuda::plan(problem, cuda::parse_schedule(schedule_));
  // A split call's (max, denominator, accumulator) per context chunk, merged inside the same
  // launch, live behind the output (256-byte aligned) in its allocation: a workspace array of
  // its own cost 0.5-1.5 µs more per split call (benchmark_results/raw/h200-mlx-workspace-ab.txt).
  const size_t partials_at = (out.nbytes() + 255) / 256 * 256;
  const mx::array& q = inputs[0];
  auto& encoder = mx::cu::get_command_encoder(stream());
  if (plan.splits == 1 && q.is_donatable() && q.flags().row_contiguous && q.size() == out.size()) {
    // As MLX's own sdpa_vector does: an unsplit call writes over a query that nothing else holds
    // (a decode step's q), no allocation. Safe in place: a query row is read only by the block
    // that writes its output row, into registers, before the block's barrier ahead of finish().
    out.copy_shared_buffer(q);
  } else {
    allocate_output(
        out, plan.splits > 1 ? partials_at + plan.partial_floats * sizeof(float) : out.nbytes(),
        encoder);
  }
  problem.out = device_pointer(out);
  float* partials = plan.splits > 1
      ? reinterpret_cast<float*>(mx::gpu_ptr<char>(out) + partials_at)
      : nullptr;
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  void* args[] = {&problem, &partials, &chunk, &slot};
  encoder.add_kernel_node_raw(
      plan.attend, dim3(plan.attend_grid[0], plan.attend_grid[1]), dim3(plan.attend_threads),
      dim3(1, 1, 1), plan.attend_smem, args);
}

}  // namespace attn_kernels
