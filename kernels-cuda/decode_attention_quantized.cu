// DecodeAttentionQuantized on NVIDIA GPUs: one pass over codes, scales and biases, dequantised in
// registers, float32 arithmetic, GQA sharing and flash-decoding's context split.
//
// One block per (key/value row, tile of up to kVectors query vectors of that row, context
// chunk). A row of D values is spread over LPR lanes ("lanes per row"), 16 values each: 16 code
// bytes at 8 bits, 8 at 4 bits, one group's scale and bias (a lane's 16 values never straddle a
// group: groups are 32, 64 or 128 values). Every K/V row leaves memory once per block and serves
// all of its query vectors. Scores use the group algebra
//     q . (scale * c + bias) = scale * (q . c) + bias * sum(q)
// (sum(q) over the lane's 16 dimensions, computed once), and values accumulate as
//     acc += (w * scale) * c,  bias_acc += w * bias,
// so codes are converted to float once (exactly: 2^23 + c as float bits, minus 2^23) and every
// multiply-add runs on them directly. Walkers (LPR-lane groups) take two positions per step with
// one rescale; warps, then blocks, then the chunks of a split (in the group's last block to
// finish, one launch per call) are combined with the online-softmax merge.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "decode_attention_quantized_cuda.h"
#include "decode_attention_quantized_kernel.cuh"

namespace attn_kernels::cuda {
namespace {

using namespace quantized;

struct Kernel {
  CUfunction function;
  int resident;  // blocks an SM holds at once
};

template <typename T, int BITS, int LPR, int VALUES, int POSITIONS>
const Kernel& kernel_for(unsigned smem) {
  static const Kernel kernel = [smem] {
    const void* symbol =
        reinterpret_cast<const void*>(&attend_quantized<T, BITS, LPR, VALUES, POSITIONS>);
    cudaFunction_t f;
    if (cudaGetFuncBySymbol(&f, symbol) != cudaSuccess) {
      throw std::runtime_error("[decode_attention_quantized] cudaGetFuncBySymbol failed");
    }
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, symbol, kThreads, smem) !=
        cudaSuccess) {
      blocks = 1;
    }
    return Kernel{reinterpret_cast<CUfunction>(f), std::max(blocks, 1)};
  }();
  return kernel;
}

// Lanes per row cover D (a multiple of 32, at most 256) with VALUES values each.
template <typename T, int BITS, int VALUES, int POSITIONS = 2>
const Kernel& kernel_for(int lpr, unsigned smem) {
  constexpr int kFewest = 32 / VALUES;
  switch (lpr) {
    case kFewest: return kernel_for<T, BITS, kFewest, VALUES, POSITIONS>(smem);
    case 2 * kFewest: return kernel_for<T, BITS, 2 * kFewest, VALUES, POSITIONS>(smem);
    case 4 * kFewest: return kernel_for<T, BITS, 4 * kFewest, VALUES, POSITIONS>(smem);
    default: return kernel_for<T, BITS, 8 * kFewest, VALUES, POSITIONS>(smem);
  }
}

// The kernel variant: "8x2" (8 values per lane, 2 positions per step; the default), or for A/B
// runs on bf16 only, ATTN_QUANTIZED_VARIANT=16x2 or 8x4.
const std::string& variant(ElementType dtype) {
  static const std::string chosen = [] {
    const char* env = std::getenv("ATTN_QUANTIZED_VARIANT");
    return std::string(env ? env : "8x2");
  }();
  static const std::string plain = "8x2";
  return dtype == ElementType::bfloat16 ? chosen : plain;
}

template <typename T>
const Kernel& kernel_for(int bits, int lpr, const std::string& variant, unsigned smem) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (variant == "16x2") {
      return bits == 8 ? kernel_for<T, 8, 16>(lpr, smem) : kernel_for<T, 4, 16>(lpr, smem);
    }
    if (variant == "8x4") {
      return bits == 8 ? kernel_for<T, 8, 8, 4>(lpr, smem) : kernel_for<T, 4, 8, 4>(lpr, smem);
    }
  }
  return bits == 8 ? kernel_for<T, 8, 8>(lpr, smem) : kernel_for<T, 4, 8>(lpr, smem);
}

int sm_count() {
  static const int count = [] {
    int device = 0, value = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
    return std::max(value, 1);
  }();
  return count;
}

}  // namespace

QuantizedPlan plan_quantized(const QuantizedProblem& p) {
  if (p.head_dim % 32 != 0 || p.head_dim > 256) {
    throw std::invalid_argument(
        "[decode_attention_quantized] the CUDA kernel takes head_dim a multiple of 32 up to 256, "
        "got " + std::to_string(p.head_dim));
  }
  QuantizedPlan plan{};
  const std::string& kind = variant(p.dtype);
  const int values = kind == "16x2" ? 16 : 8, positions = kind == "8x4" ? 4 : 2;
  int lpr = 32 / values;  // lanes per row: a power of two covering D with `values` values per lane
  while (lpr * values < p.head_dim) lpr *= 2;
  plan.threads = kThreads;
  plan.smem = kWarps * kVectors * partial_stride(p.head_dim) * sizeof(float);
  const Kernel& kernel = p.dtype == ElementType::float32 ? kernel_for<float>(p.bits, lpr, kind, plan.smem)
                         : p.dtype == ElementType::float16
                             ? kernel_for<__half>(p.bits, lpr, kind, plan.smem)
                             : kernel_for<__nv_bfloat16>(p.bits, lpr, kind, plan.smem);
  plan.attend = kernel.function;
  const int vectors = p.group * p.query_len;
  const int tiles = (vectors + kVectors - 1) / kVectors;
  const int blocks = p.kv_rows * tiles;
  // Split the context so that every SM holds as many blocks as it can run at once, in chunks of
  // at least two steps per walker (each step is a round trip to memory).
  const int step = positions * (kThreads / lpr);
  const int wanted = (p.context + 2 * step - 1) / (2 * step);
  int splits = std::clamp(kernel.resident * sm_count() / std::max(blocks, 1), 1, std::max(wanted, 1));
  if (blocks > int(kArrivalSlots / 64)) splits = 1;
  plan.chunk = (p.context + splits - 1) / splits;
  plan.chunk = (plan.chunk + step - 1) / step * step;
  splits = (p.context + plan.chunk - 1) / plan.chunk;  // no empty chunks
  plan.splits = splits;
  plan.grid[0] = blocks;
  plan.grid[1] = splits;
  plan.partial_floats =
      splits > 1 ? size_t(p.kv_rows) * vectors * splits * partial_stride(p.head_dim) : 0;
  if (splits > 1) {  // fresh arrival counters for this call, one per block group
    static std::atomic<unsigned> next_slot{0};
    plan.arrival_slot = next_slot.fetch_add(plan.grid[0], std::memory_order_relaxed);
  }
  return plan;
}

}  // namespace attn_kernels::cuda
