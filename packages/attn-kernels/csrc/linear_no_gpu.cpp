// DecodeLinear::eval_gpu for MLX builds without a GPU backend this package has a linear kernel
// for (the CPU build, Metal).
#include <stdexcept>

#include "linear.h"

namespace attn_kernels {

void DecodeLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[decode_linear] this attn_kernels build has no GPU kernel for it: attn_kernels.linear calls "
      "MLX's own matmuls on this GPU. Run on the CPU stream (stream=mx.cpu), or reinstall "
      "attn-kernels against MLX's CUDA build.");
}

}  // namespace attn_kernels
