// plan_linear_quantized(): the tile sizes of DecodeLinear's quantized kernel
// (linear_quantized.cuh) for a call's rows and shape, and the kernel's driver handle.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "linear_quantized.cuh"
#include "linear_quantized_cuda.h"

namespace attn_kernels::cuda {
namespace {

using namespace linear;

CUfunction resolve(const void* symbol) {
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, symbol) != cudaSuccess) {
    throw std::runtime_error("[decode_linear] cudaGetFuncBySymbol failed");
  }
  return reinterpret_cast<CUfunction>(f);
}

template <typename T, int BITS, int NT, int MT>
CUfunction kernel_for() {
  static const CUfunction f =
      resolve(reinterpret_cast<const void*>(&linear_quantized<T, BITS, NT, MT>));
  return f;
}

template <typename T, int BITS>
CUfunction kernel_for(int nt, int mt) {
  auto of_nt = [&]<int NT>() {
    return mt == 2 ? kernel_for<T, BITS, NT, 2>() : kernel_for<T, BITS, NT, 1>();
  };
  if (nt == 1) return of_nt.template operator()<1>();
  if (nt == 2) return of_nt.template operator()<2>();
  return of_nt.template operator()<4>();
}

// W's rows a warp covers in tiles of 16: ATTN_LINEAR_ROW_TILES (1 or 2) for A/B runs, else 0
// (the plan's choice below).
int row_tiles_from_env() {
  static const int tiles = [] {
    const char* env = std::getenv("ATTN_LINEAR_ROW_TILES");
    if (!env) return 0;
    const std::string v = env;
    if (v != "1" && v != "2") {
      throw std::invalid_argument("ATTN_LINEAR_ROW_TILES='" + v + "': use 1 or 2");
    }
    return v == "1" ? 1 : 2;
  }();
  return tiles;
}

}  // namespace

LinearPlan plan_linear_quantized(const LinearProblem& p) {
  if (p.bits != 4 && p.bits != 8) {
    throw std::invalid_argument("[decode_linear] the GPU kernel takes 4- or 8-bit codes, got bits=" +
                                std::to_string(p.bits));
  }
  if (p.dtype != ElementType::bfloat16 && p.dtype != ElementType::float16) {
    throw std::invalid_argument("[decode_linear] the GPU kernel takes bfloat16 or float16 x");
  }
  if (p.inputs % kLaneInputs != 0 || p.group_size % kLaneInputs != 0) {
    throw std::invalid_argument("[decode_linear] the GPU kernel needs K and group_size to be "
                                "multiples of 32");
  }
  if (reinterpret_cast<uintptr_t>(p.weight) % 16 != 0) {
    throw std::invalid_argument("[decode_linear] the codes must start on a 16-byte boundary");
  }
  // x's rows per pass in tiles of 8 (a pass reads W once); more rows than 32 take more passes.
  const int nt = p.rows <= 8 ? 1 : p.rows <= 16 ? 2 : 4;
  // Two row tiles a warp from 17 rows on: each x fragment then serves 32 W rows, which halves
  // the loads of x (4 B of them per 4-bit weight at 32 rows with one tile).
  const int mt = row_tiles_from_env() ? row_tiles_from_env() : nt == 4 ? 2 : 1;
  const int iterations = (p.inputs + kWarpInputs - 1) / kWarpInputs;
  // Warps split K: two iterations each at least (one in flight while the other multiplies).
  const int warps = std::clamp((iterations + 1) / 2, 1, kMaxWarps);
  LinearPlan plan{};
  auto pick = [&]<typename T>() {
    return p.bits == 4 ? kernel_for<T, 4>(nt, mt) : kernel_for<T, 8>(nt, mt);
  };
  plan.kernel = p.dtype == ElementType::bfloat16 ? pick.template operator()<__nv_bfloat16>()
                                                 : pick.template operator()<__half>();
  plan.grid[0] = static_cast<unsigned>((p.outputs + 16 * mt - 1) / (16 * mt));
  plan.grid[1] = static_cast<unsigned>((p.rows + 8 * nt - 1) / (8 * nt));
  plan.threads = 32 * warps;
  plan.smem = static_cast<unsigned>(warps * 16 * mt * 8 * nt * sizeof(float));
  return plan;
}

}  // namespace attn_kernels::cuda
