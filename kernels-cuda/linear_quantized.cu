// plan_linear_quantized(): which of DecodeLinear's quantized kernels a call runs (one row:
// linear_gemv.cuh; more: linear_quantized.cuh), its launch shape and the driver handle.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "linear_gemv.cuh"
#include "linear_gemv_simt.cuh"
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

// Which kernel a one-row call runs: ATTN_LINEAR_ONE_ROW (mma, simt or tiles) for A/B runs, else
// simt (linear_gemv_simt.cuh: on an H100 faster than the tensor-core form, linear_gemv.cuh, on
// every Phi-3 layer alone and in the whole model, docs/serving-cuda.md "One row").
std::string one_row_kernel_from_env() {
  static const std::string kernel = [] {
    const char* env = std::getenv("ATTN_LINEAR_ONE_ROW");
    const std::string v = env ? env : "simt";
    if (v != "mma" && v != "simt" && v != "tiles") {
      throw std::invalid_argument("ATTN_LINEAR_ONE_ROW='" + v + "': use mma, simt or tiles");
    }
    return v;
  }();
  return kernel;
}

// Kernel `f` (of `symbol`) allowed `smem` bytes of dynamic shared memory: past 48 KB a kernel
// must opt in, on the handle MLX's graph launches (decode_attention_quantized.cu says more).
CUfunction with_shared_memory(const void* symbol, CUfunction f, unsigned smem, unsigned& allowed) {
  if (smem > allowed) {
    if (cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem)) !=
            CUDA_SUCCESS ||
        cudaFuncSetAttribute(symbol, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) !=
            cudaSuccess) {
      throw std::runtime_error("[decode_linear] cannot allow " + std::to_string(smem) +
                               " bytes of shared memory");
    }
    allowed = smem;
  }
  return f;
}

template <typename T, int BITS>
CUfunction gemv_for(unsigned smem) {
  static const void* symbol = reinterpret_cast<const void*>(&linear_gemv<T, BITS>);
  static const CUfunction f = resolve(symbol);
  static unsigned allowed = 48 * 1024;
  return with_shared_memory(symbol, f, smem, allowed);
}

template <typename T, int BITS>
CUfunction simt_for() {
  static const CUfunction f =
      resolve(reinterpret_cast<const void*>(&linear_gemv_simt<T, BITS, kSimtRows>));
  return f;
}

// The one-row kernel takes 64-input chunks of one group, x's fragments and the row terms in
// shared memory (K = 32768 at 8 warps: 139 KB of the H100's 227).
bool one_row_kernel(const LinearProblem& p) {
  return p.rows == 1 && p.inputs % kChunkInputs == 0 && p.inputs <= 32768 &&
         (p.group_size == 64 || p.group_size == 128) && one_row_kernel_from_env() != "tiles";
}

LinearPlan plan_gemv(const LinearProblem& p) {
  LinearPlan plan{};
  auto pick = [&]<typename T>() {
    if (one_row_kernel_from_env() == "simt") {
      return p.bits == 4 ? simt_for<T, 4>() : simt_for<T, 8>();
    }
    return p.bits == 4 ? gemv_for<T, 4>(plan.smem) : gemv_for<T, 8>(plan.smem);
  };
  if (one_row_kernel_from_env() == "simt") {
    // A 32-input piece a thread, up to 256 threads (more pieces a thread past K = 8192).
    const int pieces = p.inputs / kPieceInputs;
    const int steps = (pieces + kSimtMaxThreads - 1) / kSimtMaxThreads;
    plan.threads = unsigned(((pieces + steps - 1) / steps + 31) / 32 * 32);
    plan.smem = unsigned(plan.threads / 32 * kSimtRows * sizeof(float));
    plan.grid[0] = unsigned((p.outputs + kSimtRows - 1) / kSimtRows);
  } else {
    // Warps a block split K: 8 keep a few-tile call (N < 8192: under four blocks an SM)
    // reading, 4 suit the many-tile ones (bench_linear.cu on an H100, docs/serving-cuda.md).
    const int warps = p.outputs < 8192 ? 8 : 4;
    plan.threads = unsigned(32 * warps);
    plan.smem = unsigned(gemv_shared_floats(p.inputs / kChunkInputs, warps) * sizeof(float));
    plan.grid[0] = unsigned((p.outputs + 15) / 16);
  }
  plan.grid[1] = 1;
  plan.kernel = p.dtype == ElementType::bfloat16 ? pick.template operator()<__nv_bfloat16>()
                                                 : pick.template operator()<__half>();
  return plan;
}

// The many-row kernel (linear_quantized.cuh): x's rows in tiles of 8 against 16 or 32 W rows.
LinearPlan plan_tiles(const LinearProblem& p) {
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
  return one_row_kernel(p) ? plan_gemv(p) : plan_tiles(p);
}

}  // namespace attn_kernels::cuda
