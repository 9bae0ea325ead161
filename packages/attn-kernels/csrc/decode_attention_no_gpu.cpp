// eval_gpu for MLX builds without a GPU backend this package has kernels for.
#include "decode_attention.h"

namespace attn_kernels {

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[decode_attention] this attn_kernels build has no GPU kernel: it was built against an MLX "
      "without CUDA or Metal. Run on the CPU stream (stream=mx.cpu), or reinstall attn-kernels "
      "against MLX's CUDA build (mlx[cuda13]) or on macOS.");
}

}  // namespace attn_kernels

#include "attention_step.h"

namespace attn_kernels {

void AttentionStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[attention_step] this attn_kernels build has no GPU kernel: it was built against an MLX "
      "without CUDA or Metal. Run on the CPU stream (stream=mx.cpu).");
}

void AttentionStepQuantized::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[attention_step_quantized] this attn_kernels build has no GPU kernel: it was built against "
      "an MLX without CUDA or Metal. Run on the CPU stream (stream=mx.cpu).");
}

}  // namespace attn_kernels
