// DecodeAttentionQuantized::eval_gpu on Apple GPUs: picks
// decode_attention_quantized_<dtype>_g<G>_b<bits> from attn_kernels.metallib (built beside the
// extension by metal.cmake) and dispatches one threadgroup per (key/value row, tile of up to four
// query vectors).
#include <dlfcn.h>

#include <filesystem>
#include <string>

#include "decode_attention_quantized.h"
#include "decode_attention_quantized_params.h"
#include "mlx/backend/metal/device.h"

namespace attn_kernels {

namespace {

constexpr int kVectors = 4;  // query vectors per threadgroup, as in the kernel

std::string quantized_binary_dir() {
  Dl_info info;
  dladdr(reinterpret_cast<void*>(&quantized_binary_dir), &info);
  return std::filesystem::path(info.dli_fname).parent_path().string();
}

const char* quantized_type_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

}  // namespace

void DecodeAttentionQuantized::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  // Geometry and strides only: the buffers are bound to the encoder below.
  const QuantizedProblem problem = this->problem(inputs, [](const mx::array&) { return nullptr; });
  QuantizedAttentionParams params{};
  static_cast<AttentionGeometry&>(params) = problem;
  params.group_size = problem.group_size;
  params.bits = problem.bits;
  for (int a = 0; a < 4; ++a) {
    for (int t = 0; t < 3; ++t) {
      params.k_strides[t * 4 + a] = problem.k_strides[t][a];
      params.v_strides[t * 4 + a] = problem.v_strides[t][a];
    }
  }

  // Eight SIMD groups, four where their partials would pass Metal's 32 KB (D > 128).
  const int groups = 8 * kVectors * (problem.head_dim + 2) * sizeof(float) <= 32 * 1024 ? 8 : 4;
  const std::string name = std::string("decode_attention_quantized_") +
      quantized_type_name(out.dtype()) + "_g" + std::to_string(groups) + "_b" +
      std::to_string(problem.bits);
  auto& d = mx::metal::device(stream().device);
  auto* library = d.get_library("attn_kernels", quantized_binary_dir() + "/attn_kernels.metallib");
  auto* kernel = d.get_kernel(name, library);

  auto& encoder = mx::metal::get_command_encoder(stream());
  encoder.set_compute_pipeline_state(kernel);
  for (int i = 0; i < 7; ++i) {
    encoder.set_input_array(inputs[i], i);
  }
  // Without a mask or per-row ranges, their buffers are bound to the queries and never read.
  int next = 7;
  encoder.set_input_array(has_mask_ ? inputs[next++] : inputs[0], 7);
  encoder.set_output_array(out, 8);
  encoder.set_bytes(params, 9);
  encoder.set_input_array(row_ranges_ & kRowStarts ? inputs[next++] : inputs[0], 10);
  encoder.set_input_array(row_ranges_ & kRowEnds ? inputs[next++] : inputs[0], 11);
  encoder.set_threadgroup_memory_length(
      groups * kVectors * (problem.head_dim + 2) * sizeof(float), 0);
  const int vectors = problem.group * problem.query_len;
  const size_t blocks =
      static_cast<size_t>(problem.kv_rows) * ((vectors + kVectors - 1) / kVectors);
  encoder.dispatch_threadgroups(MTL::Size(blocks, 1, 1), MTL::Size(groups * 32, 1, 1));
}

}  // namespace attn_kernels
