// eval_gpu on Apple GPUs: picks decode_attention_<dtype>_g<G> from attn_kernels.metallib (built
// beside the extension by metal.cmake) and dispatches one threadgroup per query vector.
#include <dlfcn.h>

#include <filesystem>
#include <string>

#include "decode_attention.h"
#include "decode_attention_params.h"
#include "mlx/backend/metal/device.h"

namespace attn_kernels {

namespace {

// The folder of this extension module, where attn_kernels.metallib is installed.
std::string binary_dir() {
  Dl_info info;
  dladdr(reinterpret_cast<void*>(&binary_dir), &info);
  return std::filesystem::path(info.dli_fname).parent_path().string();
}

const char* type_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

// Simdgroups per threadgroup: the requested schedule, else the chapter's 32, reduced until the
// partials (G * (D + 2) + G + 1 floats) fit Metal's 32 KB of threadgroup memory.
int groups_for(const std::string& schedule, int head_dim) {
  int groups = schedule == "chapter-8" ? 8 : schedule == "chapter-16" ? 16 : 32;
  while (groups > 8 && (groups * (head_dim + 2) + groups + 1) * sizeof(float) > 32 * 1024) {
    groups /= 2;
  }
  return groups;
}

}  // namespace

void DecodeAttention::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  // Geometry and strides only: the buffers are bound to the encoder below.
  const DecodeProblem problem = this->problem(inputs, [](const mx::array&) { return nullptr; });
  DecodeAttentionParams params{};
  static_cast<AttentionGeometry&>(params) = problem;
  for (int i = 0; i < 4; ++i) {
    params.k_strides[i] = problem.k_strides[i];
    params.v_strides[i] = problem.v_strides[i];
  }

  const int groups = groups_for(schedule_, problem.head_dim);
  const std::string name = std::string("decode_attention_") + type_name(out.dtype()) + "_g" +
      std::to_string(groups);
  auto& d = mx::metal::device(stream().device);
  auto* library = d.get_library("attn_kernels", binary_dir() + "/attn_kernels.metallib");
  auto* kernel = d.get_kernel(name, library);

  auto& encoder = mx::metal::get_command_encoder(stream());
  encoder.set_compute_pipeline_state(kernel);
  encoder.set_input_array(inputs[0], 0);
  encoder.set_input_array(inputs[1], 1);
  encoder.set_input_array(inputs[2], 2);
  // Without a mask or per-row ranges, their buffers are bound to the queries and never read.
  int next = 3;
  encoder.set_input_array(has_mask_ ? inputs[next++] : inputs[0], 3);
  encoder.set_output_array(out, 4);
  encoder.set_bytes(params, 5);
  encoder.set_input_array(row_ranges_ & kRowStarts ? inputs[next++] : inputs[0], 6);
  encoder.set_input_array(row_ranges_ & kRowEnds ? inputs[next++] : inputs[0], 7);
  encoder.set_threadgroup_memory_length(
      (groups * (problem.head_dim + 2) + groups + 1) * sizeof(float), 0);
  const size_t vectors = static_cast<size_t>(problem.rows) * problem.query_len;
  encoder.dispatch_threadgroups(MTL::Size(vectors, 1, 1), MTL::Size(groups * 32, 1, 1));
}

}  // namespace attn_kernels
