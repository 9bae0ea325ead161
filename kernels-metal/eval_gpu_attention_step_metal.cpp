// AttentionStep's eval_gpu on Apple GPUs: attention_step.metal's preprocessing (q/k RMSNorm,
// RoPE, the K/V cache write), then decode_attention.metal's kernel over the caches, from
// attn_kernels.metallib; a strided copy first for a cache that cannot be donated, and the
// token-first reorder after attention when L > 1. MLX's Metal encoder orders the dispatches by
// the buffers they name (the rotated queries live in out's allocation, behind the output).
// Compiled only on macOS; not run here (no Mac: kernels-metal/README.md).
#include <dlfcn.h>

#include <filesystem>
#include <string>

#include "attention_step.h"
#include "attention_step_params.h"
#include "mlx/backend/metal/device.h"

namespace attn_kernels {

namespace {

// The folder of this extension module, where attn_kernels.metallib is installed.
std::string library_dir() {
  Dl_info info;
  dladdr(reinterpret_cast<void*>(&library_dir), &info);
  return std::filesystem::path(info.dli_fname).parent_path().string();
}

const char* dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

// decode_attention.metal's SIMD groups per threadgroup, as eval_gpu_metal.cpp picks them.
int attention_groups(const std::string& schedule, int head_dim) {
  int groups = schedule == "chapter-8" ? 8 : schedule == "chapter-16" ? 16 : 32;
  while (groups > 8 && (groups * (head_dim + 2) + groups + 1) * sizeof(float) > 32 * 1024) {
    groups /= 2;
  }
  return groups;
}

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

}  // namespace

void AttentionStep::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  const auto donated = donate_caches(inputs, outputs, owned_caches_);
  for (int c = 0; c < 2; ++c) {
    if (!donated[c]) {
      outputs[1 + c].set_data(mx::allocator::malloc(outputs[1 + c].nbytes()));
    }
  }
  // Geometry and strides only: the buffers are bound to the encoder below.
  const StepProblem s = make_step_problem(inputs, outputs, offset_, qk_norm_, kQNormInput, eps_,
                                          rope_base_, rope_freqs_, 0, 0, row_ranges_, position_,
                                          [](const mx::array&) -> void* { return nullptr; });
  const AttentionStepParams p = s;
  // The per-row starts and offsets (after the norm weights), or q as a never-read stand-in.
  int next = kQNormInput + (qk_norm_ ? 2 : 0);
  const mx::array& starts = row_ranges_ & kRowStarts ? inputs[next++] : inputs[0];
  const mx::array& offsets = row_ranges_ & kRowEnds ? inputs[next++] : inputs[0];

  // out's allocation: out | rotated queries (B, Hq, L, D) | heads-first output when L > 1.
  const size_t q_bytes = size_t(s.batch) * s.q_heads * s.length * s.head_dim * out.itemsize();
  const size_t q_at = align256(out.nbytes());
  const size_t heads_at = align256(q_at + q_bytes);
  out.set_data(mx::allocator::malloc(s.length > 1 ? heads_at + q_bytes : q_at + q_bytes));

  const std::string type = dtype_name(out.dtype());
  auto& d = mx::metal::device(stream().device);
  auto* library = d.get_library("attn_kernels", library_dir() + "/attn_kernels.metallib");
  auto& encoder = mx::metal::get_command_encoder(stream());

  auto copy = [&](const mx::array& src, int64_t src_at, mx::array& dst, const StridedCopyParams& c) {
    encoder.set_compute_pipeline_state(d.get_kernel("attention_step_copy_" + type, library));
    encoder.set_input_array(src, 0, src_at);
    encoder.set_output_array(dst, 1);
    encoder.set_bytes(c, 2);
    encoder.dispatch_threads(MTL::Size(c.size, 1, 1), MTL::Size(256, 1, 1));
  };
  for (int c = 0; c < 2; ++c) {
    if (!donated[c]) {
      const auto& in = inputs[kKCacheInput + c];
      StridedCopyParams params{};
      for (int a = 0; a < 4; ++a) {
        params.shape[a] = in.shape(a);
        params.strides[a] = in.strides()[a];
      }
      params.size = static_cast<attn_i64>(in.size());
      copy(in, 0, outputs[1 + c], params);
    }
  }

  encoder.set_compute_pipeline_state(d.get_kernel("attention_step_preprocess_" + type, library));
  for (int i = 0; i < 3; ++i) {
    encoder.set_input_array(inputs[i], i);
  }
  // The norm weights; without qk_norm the kernel does not read slots 3 and 4 (q fills them).
  encoder.set_input_array(inputs[qk_norm_ ? kQNormInput : 0], 3);
  encoder.set_input_array(inputs[qk_norm_ ? kKNormInput : 0], 4);
  encoder.set_output_array(out, 5, q_at);
  encoder.set_output_array(outputs[1], 6);
  encoder.set_output_array(outputs[2], 7);
  encoder.set_bytes(p, 8);
  encoder.set_input_array(starts, 9);
  encoder.set_input_array(offsets, 10);
  encoder.dispatch_threadgroups(
      MTL::Size(size_t(s.batch) * s.length * (s.q_heads + s.kv_heads), 1, 1), MTL::Size(32, 1, 1));

  const DecodeAttentionParams a = step_attention_params(p, scale_);
  const int groups = attention_groups(schedule_, s.head_dim);
  encoder.set_compute_pipeline_state(
      d.get_kernel("decode_attention_" + type + "_g" + std::to_string(groups), library));
  encoder.set_input_array(out, 0, q_at);
  encoder.set_input_array(outputs[1], 1);
  encoder.set_input_array(outputs[2], 2);
  encoder.set_input_array(outputs[1], 3);  // the mask slot, never read (mask_kind 0)
  encoder.set_output_array(out, 4, s.length > 1 ? heads_at : 0);
  encoder.set_bytes(a, 5);
  encoder.set_input_array(starts, 6);  // the rows' ends: their offsets (ends_add = L)
  encoder.set_input_array(offsets, 7);
  encoder.set_threadgroup_memory_length((groups * (s.head_dim + 2) + groups + 1) * sizeof(float), 0);
  encoder.dispatch_threadgroups(
      MTL::Size(size_t(a.rows) * a.query_len, 1, 1), MTL::Size(groups * 32, 1, 1));

  if (s.length > 1) {
    copy(out, heads_at, out, step_reorder_params(p));
  }
}

// No Metal kernel quantizes the step's new position yet: qwen3_model's guard keeps the unfused
// ops (mx.quantize, slice updates, decode_attention_quantized) on Metal.
void AttentionStepQuantized::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[attention_step_quantized] no Metal kernel yet: run it on the CPU or CUDA, or quantize "
      "with mx.quantize and attend with decode_attention_quantized");
}

}  // namespace attn_kernels
