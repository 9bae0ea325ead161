// Runs the one-row candidates of kernels-cuda/dev/ (linear_gemv.cuh, linear_gemv_simt.cuh) on
// the CPU under cuda_emu.h.
//
//   run_linear_gemv DIR
//
// DIR holds config.txt ("N K bits group_size dtype has_bias warps simt_rows", dtype 0 bf16, 1
// f16; simt_rows 0: the tensor-core kernel, 1-8: the SIMT kernel with that many rows a block),
// x.bin (K 16-bit floats), w.bin (uint32 codes (N, K * bits / 32)), scales.bin and biases.bin ((N,
// K / group_size), 16-bit floats) and bias.bin ((N,), where has_bias); it receives out.bin (N
// 16-bit floats). warps: the block's warps that split K (any count up to the kernel's limit).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cuda_emu.h"
// The kernel source itself, unchanged.
#include "../dev/linear_gemv.cuh"
#include "../dev/linear_gemv_simt.cuh"

using namespace attn_kernels;
using namespace attn_kernels::cuda::linear;

namespace {

using Kernel = void (*)(LinearProblem);

// The candidate config.txt names: the tensor-core kernel (simt_rows 0) or the SIMT one.
template <typename T, int BITS>
Kernel kernel_for(int simt_rows) {
  switch (simt_rows) {
    case 0: return &linear_gemv<T, BITS>;
    case 1: return &linear_gemv_simt<T, BITS, 1>;
    case 2: return &linear_gemv_simt<T, BITS, 2>;
    case 4: return &linear_gemv_simt<T, BITS, 4>;
    default: return &linear_gemv_simt<T, BITS, 8>;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = emu::runner_folder(argc, argv);
  std::ifstream config(dir + "/config.txt");
  int N, K, bits, group_size, dtype, has_bias, warps, simt_rows;
  config >> N >> K >> bits >> group_size >> dtype >> has_bias >> warps >> simt_rows;
  const int max_warps = simt_rows ? kSimtMaxThreads / 32 : kGemvMaxWarps;
  if (!config || (bits != 4 && bits != 8) || warps < 1 || warps > max_warps ||
      (simt_rows != 0 && simt_rows != 1 && simt_rows != 2 && simt_rows != 4 && simt_rows != 8)) {
    std::fprintf(stderr, "bad config.txt\n");
    return 2;
  }
  const auto x = emu::read_file<uint16_t>(dir + "/x.bin");
  const auto scales = emu::read_file<uint16_t>(dir + "/scales.bin");
  const auto biases = emu::read_file<uint16_t>(dir + "/biases.bin");
  const auto w = emu::read_file<uint32_t>(dir + "/w.bin");
  const auto bias =
      has_bias ? emu::read_file<uint16_t>(dir + "/bias.bin") : std::vector<uint16_t>{};
  std::vector<uint16_t> out(N, 0xffff);  // NaN: an output never written shows

  LinearProblem p{};
  p.rows = 1, p.outputs = N, p.inputs = K;
  p.dtype = dtype == 0 ? ElementType::bfloat16 : ElementType::float16;
  p.bits = bits, p.group_size = group_size;
  p.x = x.data(), p.x_row_stride = K;
  p.weight = w.data(), p.scales = scales.data(), p.biases = biases.data();
  p.bias = has_bias ? bias.data() : nullptr;
  p.out = out.data();
  const Kernel kernel = dtype == 0 ? (bits == 4 ? kernel_for<__nv_bfloat16, 4>(simt_rows)
                                                : kernel_for<__nv_bfloat16, 8>(simt_rows))
                                   : (bits == 4 ? kernel_for<__half, 4>(simt_rows)
                                                : kernel_for<__half, 8>(simt_rows));
  if (simt_rows) {
    emu::launch((N + simt_rows - 1) / simt_rows, 1, 32 * warps, size_t(warps) * simt_rows,
                [&] { kernel(p); });
  } else {
    const size_t shared = gemv_shared_floats(K / kChunkInputs, warps);
    emu::launch((N + 15) / 16, 1, 32 * warps, shared, [&] { kernel(p); });
  }
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uint16_t));
  return 0;
}
