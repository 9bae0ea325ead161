// Runs kernels-cuda/linear_gemv.cuh (one row of x) on the CPU under cuda_emu.h.
//
//   run_linear_gemv DIR
//
// DIR holds config.txt ("N K bits group_size dtype has_bias warps", dtype 0 bf16, 1 f16), x.bin
// (K 16-bit floats), w.bin (uint32 codes (N, K * bits / 32)), scales.bin and biases.bin ((N,
// K / group_size), 16-bit floats) and bias.bin ((N,), where has_bias); it receives out.bin (N
// 16-bit floats). warps: the block's warps that split K (any count up to kGemvMaxWarps here).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cuda_emu.h"
// The kernel source itself, unchanged.
#include "../linear_gemv.cuh"

using namespace attn_kernels;
using namespace attn_kernels::cuda::linear;

int main(int argc, char** argv) {
  const std::string dir = emu::runner_folder(argc, argv);
  std::ifstream config(dir + "/config.txt");
  int N, K, bits, group_size, dtype, has_bias, warps;
  config >> N >> K >> bits >> group_size >> dtype >> has_bias >> warps;
  if (!config || (bits != 4 && bits != 8) || warps < 1 || warps > kGemvMaxWarps) {
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
  void (*kernel)(LinearProblem) =
      dtype == 0 ? (bits == 4 ? &linear_gemv<__nv_bfloat16, 4> : &linear_gemv<__nv_bfloat16, 8>)
                 : (bits == 4 ? &linear_gemv<__half, 4> : &linear_gemv<__half, 8>);
  const size_t shared = gemv_shared_floats(K / kChunkInputs, warps);
  emu::launch((N + 15) / 16, 1, 32 * warps, shared, [&] { kernel(p); });
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uint16_t));
  return 0;
}
