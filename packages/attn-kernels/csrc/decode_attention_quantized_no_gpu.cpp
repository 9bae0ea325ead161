// eval_gpu for MLX builds without a GPU backend this package has kernels for.
#include <stdexcept>

#include "decode_attention_quantized.h"

namespace attn_kernels {

void DecodeAttentionQuantized::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[decode_attention_quantized] this attn_kernels build has no GPU kernel for it. Run on the "
      "CPU stream (stream=mx.cpu), or reinstall attn-kernels against MLX's CUDA build.");
}

}  // namespace attn_kernels
