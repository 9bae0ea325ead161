// Runs kernels-cuda/linear_quantized.cuh on the CPU under cuda_emu.h.
//
//   run_linear_quantized DIR
//
// DIR holds config.txt ("M N K bits group_size dtype x_row_stride has_bias NT MT warps", dtype 0
// bf16, 1 f16), x.bin (M rows x_row_stride apart, 16-bit floats), w.bin (uint32 codes (N, K *
// bits / 32)), scales.bin and biases.bin ((N, K / group_size), 16-bit floats) and bias.bin ((N,),
// where has_bias); it receives out.bin ((M, N), 16-bit floats). NT, MT and warps pick the tile
// sizes and the block that plan_linear_quantized() would (any combination here).
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"
// The kernel source itself, unchanged.
#include "../linear_quantized.cuh"

namespace {

using emu::read_file;
using namespace attn_kernels;
using namespace attn_kernels::cuda::linear;

using Kernel = void (*)(LinearProblem);

template <typename T, int BITS>
Kernel kernel_for(int nt, int mt) {
  auto of_nt = [&]<int NT>() -> Kernel {
    return mt == 2 ? &linear_quantized<T, BITS, NT, 2> : &linear_quantized<T, BITS, NT, 1>;
  };
  if (nt == 1) return of_nt.template operator()<1>();
  if (nt == 2) return of_nt.template operator()<2>();
  return of_nt.template operator()<4>();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = emu::runner_folder(argc, argv);
  std::ifstream config(dir + "/config.txt");
  int M, N, K, bits, group_size, dtype, stride, has_bias, nt, mt, warps;
  config >> M >> N >> K >> bits >> group_size >> dtype >> stride >> has_bias >> nt >> mt >> warps;
  if (!config || (bits != 4 && bits != 8) || (nt != 1 && nt != 2 && nt != 4) ||
      (mt != 1 && mt != 2) || warps < 1 || warps > kMaxWarps) {
    std::fprintf(stderr, "bad config.txt\n");
    return 2;
  }
  const auto x = read_file<uint16_t>(dir + "/x.bin");
  const auto scales = read_file<uint16_t>(dir + "/scales.bin");
  const auto biases = read_file<uint16_t>(dir + "/biases.bin");
  const auto w = read_file<uint32_t>(dir + "/w.bin");
  const auto bias = has_bias ? read_file<uint16_t>(dir + "/bias.bin") : std::vector<uint16_t>{};
  std::vector<uint16_t> out(size_t(M) * N, 0xffff);  // NaN: an output never written shows

  LinearProblem p{};
  p.rows = M, p.outputs = N, p.inputs = K;
  p.dtype = dtype == 0 ? ElementType::bfloat16 : ElementType::float16;
  p.bits = bits, p.group_size = group_size;
  p.x = x.data(), p.x_row_stride = stride;
  p.weight = w.data(), p.scales = scales.data(), p.biases = biases.data();
  p.bias = has_bias ? bias.data() : nullptr;
  p.out = out.data();
  Kernel kernel = dtype == 0 ? (bits == 4 ? kernel_for<__nv_bfloat16, 4>(nt, mt)
                                          : kernel_for<__nv_bfloat16, 8>(nt, mt))
                             : (bits == 4 ? kernel_for<__half, 4>(nt, mt)
                                          : kernel_for<__half, 8>(nt, mt));
  const unsigned gx = (N + 16 * mt - 1) / (16 * mt), gy = (M + 8 * nt - 1) / (8 * nt);
  emu::launch(gx, gy, 32 * warps, size_t(warps) * 16 * mt * 8 * nt, [&] { kernel(p); });
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uint16_t));
  return 0;
}
