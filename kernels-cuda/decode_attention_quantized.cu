// DecodeAttentionQuantized on NVIDIA GPUs: one pass over codes, scales and biases, dequantised in
// registers, float32 arithmetic, GQA sharing and flash-decoding's context split.
//
// One block per (key/value row, tile of up to kVectors query vectors of that row, context
// chunk). A row of D values is spread over LPR lanes ("lanes per row"), 8 values each: 8 code
// bytes at 8 bits, 4 at 4 bits, one group's scale and bias (a lane's 8 values never straddle a
// group: groups are 32, 64 or 128 values). Every K/V row leaves memory once per block and serves
// all of its query vectors. Scores use the group algebra
//     q . (scale * c + bias) = scale * (q . c) + bias * sum(q)
// (sum(q) over the lane's 8 dimensions, computed once), and values accumulate as
//     acc += (w * scale) * c,  bias_acc += w * bias,
// so codes are converted to float once (exactly: 2^23 + c as float bits, minus 2^23) and every
// multiply-add runs on them directly. Walkers (LPR-lane groups) take two positions per step with
// one rescale; warps, then blocks, then the chunks of a split (in the group's last block to
// finish, one launch per call) are combined with the online-softmax merge.
//
// That SIMT kernel is the fallback. The default is the tensor-core kernel with transposed scores
// fed by a cp.async pipeline ("mmat4": decode_attention_quantized_mmat.cuh + _stages.cuh), 4-6x
// faster at long contexts on the H200; plan_quantized() takes it where its layout requirements
// hold (variant() below names the A/B alternatives).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "decode_attention_quantized_cuda.h"
#include "decode_attention_quantized_kernel.cuh"
#include "decode_attention_quantized_mmat.cuh"

namespace attn_kernels::cuda {
namespace {

using namespace quantized;

struct Kernel {
  CUfunction function;
  int resident;   // blocks an SM holds at once
  unsigned smem;  // bytes of shared memory it was resolved with
};

// A kernel's driver handle (MLX's libmlx carries its own CUDA runtime) and how many of its
// blocks of kThreads threads an SM holds with `smem` bytes of dynamic shared memory (allowed on
// the handle itself, which is what MLX's graph launches, once the block's total passes 48 KB).
// The total counts the kernel's static shared memory (finish()'s flag): mmat4 at 4 bits, group
// 32 asks exactly 48 KB of dynamic memory, and without the opt-in it could not launch (H200,
// 8e285a6: "cuGraphAddKernelNode ... invalid argument").
Kernel resolve(const void* symbol, unsigned smem) {
  cudaFunction_t f;
  if (cudaGetFuncBySymbol(&f, symbol) != cudaSuccess) {
    throw std::runtime_error("[decode_attention_quantized] cudaGetFuncBySymbol failed");
  }
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, symbol) != cudaSuccess) {
    throw std::runtime_error("[decode_attention_quantized] cudaFuncGetAttributes failed");
  }
  if (smem + attributes.sharedSizeBytes > 48 * 1024 &&
      (cuFuncSetAttribute(reinterpret_cast<CUfunction>(f),
                          CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem)) !=
           CUDA_SUCCESS ||
       cudaFuncSetAttribute(symbol, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) !=
           cudaSuccess)) {
    throw std::runtime_error("[decode_attention_quantized] cannot allow " + std::to_string(smem) +
                             " bytes of shared memory");
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, symbol, kThreads, smem) !=
      cudaSuccess) {
    blocks = 1;
  }
  return Kernel{reinterpret_cast<CUfunction>(f), std::max(blocks, 1), smem};
}

template <typename T, int BITS, int LPR>
const Kernel& kernel_for(unsigned smem) {
  static const Kernel kernel = [smem] {
    return resolve(reinterpret_cast<const void*>(&attend_quantized<T, BITS, LPR>), smem);
  }();
  return kernel;
}

// The SIMT kernel whose LPR lanes per row (a power of two) cover D (a multiple of 32, at most
// 256) with 8 values each.
template <typename T>
const Kernel& kernel_for(int bits, int lpr, unsigned smem) {
  auto of_bits = [&]<int BITS>() -> const Kernel& {
    switch (lpr) {
      case 4: return kernel_for<T, BITS, 4>(smem);
      case 8: return kernel_for<T, BITS, 8>(smem);
      case 16: return kernel_for<T, BITS, 16>(smem);
      default: return kernel_for<T, BITS, 32>(smem);
    }
  };
  return bits == 8 ? of_bits.template operator()<8>() : of_bits.template operator()<4>();
}

// The kernel variant: "mmat4" (the default: the tensor-core kernel with transposed scores fed
// by a cp.async pipeline through shared memory, sized for 4 blocks per SM,
// decode_attention_quantized_mmat.cuh, where its layout requirements hold, else the SIMT kernel;
// H200, Qwen3-4B shapes, group 64, S = 131072: 76-81 µs at 8 bits and 50-55 µs at 4 bits against
// mx.fast's 128-139 on the bf16 K/V, docs/quantized-kv-cuda.md), or for A/B runs
// ATTN_QUANTIZED_VARIANT=mmat (the same kernel sized for 2 blocks per SM: more registers and
// stages) or 8x2 (the SIMT kernel everywhere). The variants that lost to these on the H200 left
// the code with their numbers in docs/quantized-kv-cuda.md.
const std::string& variant() {
  static const std::string chosen = [] {
    const char* env = std::getenv("ATTN_QUANTIZED_VARIANT");
    const std::string name = env ? env : "mmat4";
    // A typo must not time the default under another name.
    if (name != "mmat4" && name != "mmat" && name != "8x2") {
      throw std::invalid_argument("ATTN_QUANTIZED_VARIANT='" + name + "': use mmat4, mmat or 8x2");
    }
    return name;
  }();
  return chosen;
}

// Blocks per SM that a split mmat call fills: ATTN_QUANTIZED_SPLIT_BLOCKS for A/B runs, else 0
// (plan_mmat picks 1 or 2 by the chunk length, below).
int split_blocks_per_sm() {
  static const int blocks = [] {
    const char* env = std::getenv("ATTN_QUANTIZED_SPLIT_BLOCKS");
    if (!env) return 0;
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1 || n > 8) {
      throw std::invalid_argument(std::string("ATTN_QUANTIZED_SPLIT_BLOCKS='") + env +
                                  "': use a whole number from 1 to 8");
    }
    return static_cast<int>(n);
  }();
  return blocks;
}

template <typename T, int BITS, int D, int GS, int BLOCKS>
const Kernel& mmat_kernel_for() {
  constexpr int kStages = mmat_stages<BITS, D, GS, BLOCKS>();
  static const Kernel kernel = [] {
    const void* symbol =
        reinterpret_cast<const void*>(&attend_quantized_mmat<T, BITS, D, GS, kStages, BLOCKS>);
    return resolve(symbol, mmat_smem_bytes<BITS, D, GS, kStages>());
  }();
  return kernel;
}

template <typename T, int BITS, int D, int BLOCKS>
const Kernel& mmat_kernel_for(int group_size) {
  switch (group_size) {
    case 32: return mmat_kernel_for<T, BITS, D, 32, BLOCKS>();
    case 64: return mmat_kernel_for<T, BITS, D, 64, BLOCKS>();
    default:
      if constexpr (D >= 128) return mmat_kernel_for<T, BITS, D, 128, BLOCKS>();
      throw std::invalid_argument("[decode_attention_quantized] group_size larger than head_dim");
  }
}

template <typename T, int BITS, int BLOCKS>
const Kernel& mmat_kernel_for(const QuantizedProblem& p) {
  switch (p.head_dim) {
    case 64: return mmat_kernel_for<T, BITS, 64, BLOCKS>(p.group_size);
    case 128: return mmat_kernel_for<T, BITS, 128, BLOCKS>(p.group_size);
    default: return mmat_kernel_for<T, BITS, 256, BLOCKS>(p.group_size);
  }
}

// mmat4's build (4 blocks per SM) or, under ATTN_QUANTIZED_VARIANT=mmat, the 2-block one.
template <typename T>
const Kernel& mmat_kernel_for(const QuantizedProblem& p, const std::string& kind) {
  if (kind == "mmat4") {
    return p.bits == 8 ? mmat_kernel_for<T, 8, 4>(p) : mmat_kernel_for<T, 4, 4>(p);
  }
  return p.bits == 8 ? mmat_kernel_for<T, 8, 2>(p) : mmat_kernel_for<T, 4, 2>(p);
}

// The mmat kernel's requirements: f16/bf16, D 64/128/256, sm_80+, codes rows of whole aligned
// 16-byte pieces (last axis contiguous), scale and bias rows contiguous (each position's right
// after the last's) with the 16-byte runs that its copies take (16 positions' worth) aligned.
bool mmat_applies(const QuantizedProblem& p) {
  if (p.dtype == ElementType::float32) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  static const bool has_mma = [] {
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major >= 8;
  }();
  if (!has_mma) return false;
  auto aligned = [](const void* ptr, const int64_t* strides, int bytes, int elem_bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % bytes == 0 && strides[0] * elem_bytes % bytes == 0 &&
           strides[1] * elem_bytes % bytes == 0;
  };
  const int groups = p.head_dim / p.group_size;
  const int run = 16;  // scale bytes a copy takes
  for (const auto* strides : {&p.k_strides, &p.v_strides}) {
    const void* codes = strides == &p.k_strides ? p.k_codes : p.v_codes;
    const void* scales = strides == &p.k_strides ? p.k_scales : p.v_scales;
    const void* biases = strides == &p.k_strides ? p.k_biases : p.v_biases;
    const auto& c = (*strides)[0];
    if (c[3] != 1 || !aligned(codes, c, 16, 4) || c[2] * 4 % 16 != 0) return false;
    for (int a : {1, 2}) {
      const auto& s = (*strides)[a];
      if (s[3] != 1 || s[2] != groups || !aligned(a == 1 ? scales : biases, s, run, 2)) {
        return false;
      }
    }
  }
  return true;
}

// Fresh arrival counters for a split call, one per block group (both kernels share them).
unsigned arrival_slots(unsigned groups) {
  static std::atomic<unsigned> next_slot{0};
  return next_slot.fetch_add(groups, std::memory_order_relaxed);
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

namespace {

// The context in `splits` chunks of whole `step`s (no empty chunk), the grid of `blocks` x
// chunks, and the partial states and arrival counters a split call needs. finish()'s merge
// keeps two floats per vector (`vpb` of them) and chunk in the kernel's shared memory
// (plan.smem).
void split_context(QuantizedPlan& plan, const QuantizedProblem& p, int blocks, int splits,
                   int step, int vpb) {
  splits = std::clamp(splits, 1, max_merged_splits(int(plan.smem / sizeof(float)), vpb));
  plan.chunk = (p.context + splits - 1) / splits;
  plan.chunk = (plan.chunk + step - 1) / step * step;
  splits = (p.context + plan.chunk - 1) / plan.chunk;
  plan.splits = splits;
  plan.grid[0] = blocks;
  plan.grid[1] = splits;
  const int vectors = p.group * p.query_len;
  plan.partial_floats =
      splits > 1 ? size_t(p.kv_rows) * vectors * splits * partial_stride(p.head_dim) : 0;
  if (splits > 1) plan.arrival_slot = arrival_slots(plan.grid[0]);
}

// One launch of the mmat kernel: blocks of 8 query vectors, the context split so that every SM
// holds two blocks where each chunk still walks at least 8 block steps, else one (filling all
// four resident slots costs more in merged chunks than the extra warps bring), in chunks of at
// least two block steps; contexts of at most four block steps are not split (a merge costs more).
// H200, Qwen3-4B shapes (8 blocks a call), against mx.fast in the same process: one block per SM
// was 1.04-1.25x faster in chained calls from S = 4096 to 16384 (independent 1.09-1.17x); two
// were level or faster chained from 32768 (131072: 1.09x at 8 bits, 1.25x at 4), where a long
// walk needs the second block's warps to hide its latency, though independent calls there
// favour one by 1-10%: a decode step's calls are chained (docs/quantized-kv-cuda.md).
QuantizedPlan plan_mmat(const QuantizedProblem& p, const std::string& kind) {
  QuantizedPlan plan{};
  plan.threads = kThreads;
  const Kernel& kernel = p.dtype == ElementType::float16 ? mmat_kernel_for<__half>(p, kind)
                                                         : mmat_kernel_for<__nv_bfloat16>(p, kind);
  plan.smem = kernel.smem;
  plan.attend = kernel.function;
  const int step = kWarps * kMmaStep;
  const int vectors = p.group * p.query_len;
  const int tiles = (vectors + kMmaVectors - 1) / kMmaVectors;
  const int blocks = p.kv_rows * tiles;
  int splits = 1;
  if (p.context > 4 * step && blocks <= int(kArrivalSlots / 64)) {
    const int wanted = (p.context + 2 * step - 1) / (2 * step);
    const int chunk_at_two = p.context / std::max(2 * sm_count() / blocks, 1);
    int per_sm = split_blocks_per_sm();
    if (per_sm == 0) per_sm = chunk_at_two >= 8 * step ? 2 : 1;
    per_sm = std::min(kernel.resident, per_sm);
    splits = std::clamp(per_sm * sm_count() / blocks, 1, std::max(wanted, 1));
  }
  split_context(plan, p, blocks, splits, step, kMmaVectors);
  return plan;
}

// ATTN_QUANTIZED_LOG=1: the first plan of each kernel, to stderr, so that a device run shows
// which kernel a variant's timing ran (where mmat's layout requirements fail, 8x2 runs).
QuantizedPlan logged(const QuantizedPlan& plan, const std::string& kind,
                     const QuantizedProblem& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTN_QUANTIZED_LOG");
    return env && std::string(env) == "1";
  }();
  if (!enabled) return plan;
  static std::mutex mutex;
  static std::set<CUfunction> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(plan.attend).second) {
    std::fprintf(stderr,
                 "[decode_attention_quantized] kernel %s: bits %d, D %d, group %d, S %d, grid %u x "
                 "%u, %u threads, %u bytes of shared memory\n",
                 kind.c_str(), p.bits, p.head_dim, p.group_size, p.context, plan.grid[0],
                 plan.grid[1], plan.threads, plan.smem);
  }
  return plan;
}

}  // namespace

QuantizedPlan plan_quantized(const QuantizedProblem& p) {
  if (p.head_dim % 32 != 0 || p.head_dim > 256) {
    throw std::invalid_argument(
        "[decode_attention_quantized] the CUDA kernel takes head_dim a multiple of 32 up to 256, "
        "got " + std::to_string(p.head_dim));
  }
  const std::string& kind = variant();
  if (kind != "8x2" && mmat_applies(p)) return logged(plan_mmat(p, kind), kind, p);
  QuantizedPlan plan{};
  int lpr = 4;  // lanes per row: a power of two covering D with 8 values per lane
  while (lpr * 8 < p.head_dim) lpr *= 2;
  plan.threads = kThreads;
  plan.smem = states_smem_bytes(kVectors, p.head_dim);
  const Kernel& kernel = p.dtype == ElementType::float32
                             ? kernel_for<float>(p.bits, lpr, plan.smem)
                         : p.dtype == ElementType::float16
                             ? kernel_for<__half>(p.bits, lpr, plan.smem)
                             : kernel_for<__nv_bfloat16>(p.bits, lpr, plan.smem);
  plan.attend = kernel.function;
  const int vectors = p.group * p.query_len;
  const int tiles = (vectors + kVectors - 1) / kVectors;
  const int blocks = p.kv_rows * tiles;
  // Split the context so that every SM holds as many blocks as it can run at once, in chunks of
  // at least two steps per walker (each step is a round trip to memory).
  const int step = 2 * (kThreads / lpr);  // 2 positions per walker and step
  const int wanted = (p.context + 2 * step - 1) / (2 * step);
  int splits = std::clamp(kernel.resident * sm_count() / std::max(blocks, 1), 1, std::max(wanted, 1));
  if (blocks > int(kArrivalSlots / 64)) splits = 1;
  split_context(plan, p, blocks, splits, step, kVectors);
  return logged(plan, "8x2", p);
}

}  // namespace attn_kernels::cuda
