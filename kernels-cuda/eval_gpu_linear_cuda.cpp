// DecodeLinear::eval_gpu through MLX's CUDA command encoder: the quantized kernel
// (linear_quantized.cuh, planned by linear_quantized.cu) as one graph node, after a copy of any
// input whose rows are not contiguous (rare: a transposed or sliced view; the strided copy of
// attention_step.cu). Dense weights, float32 and a gate never get here: decode_linear() refuses
// them on a GPU stream and attn_kernels.linear runs MLX's own ops for them.
#include <stdexcept>

#include "attention_step_cuda.h"
#include "linear.h"
#include "linear_quantized_cuda.h"
#include "op_checks.h"
#include "output_memory_cuda.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

namespace attn_kernels {

namespace {

const void* device_pointer(const mx::array& a) {
  return static_cast<const void*>(mx::gpu_ptr<char>(a));
}

// `a` as the kernel can read it: itself, or a row-contiguous copy made on the encoder's stream
// (kept alive until the graph has run).
mx::array readable(mx::cu::CommandEncoder& encoder, const mx::array& a, bool in_place) {
  if (in_place) return a;
  if (a.ndim() > 4) {
    throw std::runtime_error("[decode_linear] x with more than 4 dimensions whose rows do not "
                             "collapse into one stride: make it contiguous first");
  }
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  allocate_output(copy, copy.nbytes(), encoder);
  cuda::StridedCopy c{device_pointer(a), mx::gpu_ptr<void>(copy), {1, 1, 1, 1}, {0, 0, 0, 0},
                      static_cast<int64_t>(a.size())};
  const int nd = static_cast<int>(a.ndim()), lead = 4 - nd;
  for (int d = 0; d < nd; ++d) {
    c.shape[lead + d] = a.shape(d);
    c.strides[lead + d] = a.strides()[d];
  }
  encoder.set_input_array(a);
  encoder.set_output_array(copy);
  void* args[] = {&c};
  const cuda::CopyLaunch launch = cuda::plan_copy(c, a.itemsize());
  encoder.add_kernel_node_raw(launch.kernel, dim3(launch.blocks), dim3(cuda::kCopyThreads),
                              dim3(1, 1, 1), 0, args);
  encoder.add_temporary(copy);
  return copy;
}

}  // namespace

void DecodeLinear::eval_gpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  if (bits_ == 0 || has_gate_) {
    throw std::runtime_error("[decode_linear] the GPU kernel takes quantized weights, no gate");
  }
  auto& out = outputs[0];
  auto& encoder = mx::cu::get_command_encoder(stream());
  allocate_output(out, out.nbytes(), encoder);
  const int64_t stride = collapsed_row_stride(inputs[0]);
  std::vector<mx::array> operands;
  operands.push_back(readable(encoder, inputs[0], stride != 0));
  for (size_t i = 1; i < inputs.size(); ++i) {
    operands.push_back(readable(encoder, inputs[i], inputs[i].flags().row_contiguous));
  }
  LinearProblem p{};
  p.inputs = inputs[0].shape(-1);
  p.outputs = inputs[1].shape(0);
  p.rows = static_cast<int>(inputs[0].size() / p.inputs);
  p.dtype = element_type(inputs[0].dtype());
  p.bits = bits_;
  p.group_size = group_size_;
  p.x = device_pointer(operands[0]);
  p.x_row_stride = stride ? stride : p.inputs;
  p.weight = device_pointer(operands[1]);
  p.scales = device_pointer(operands[2]);
  p.biases = device_pointer(operands[3]);
  p.bias = has_bias_ ? device_pointer(operands[4]) : nullptr;
  p.out = mx::gpu_ptr<char>(out);
  // What the kernel reads: an input itself, or the copy made of it, whose node already follows
  // the input's writer. Naming the originals instead let the kernel run beside the copies (the
  // GPU strided test saw wrong outputs); naming both counted each weight's bytes twice toward
  // MLX's graph size (it commits a graph every 1000 MB of inputs on sm_90).
  for (const auto& in : operands) encoder.set_input_array(in);
  encoder.set_output_array(out);
  if (p.rows == 0) return;
  const cuda::LinearPlan plan = cuda::plan_linear_quantized(p);
  void* args[] = {&p};
  encoder.add_kernel_node_raw(plan.kernel, dim3(plan.grid[0], plan.grid[1]), dim3(plan.threads),
                              dim3(1, 1, 1), plan.smem, args);
}

}  // namespace attn_kernels
