// Stand-alone timing of DecodeLinear's CUDA kernels for one row of x (a single request's decode
// step), without MLX: the library's plan (plan_linear_quantized: the many-row kernel of
// linear_quantized.cuh) and the one-row candidates here (linear_gemv_simt.cuh at 2, 4 and 8
// rows a block; linear_gemv.cuh at several warp and stage counts), next to a plain read of the
// same bytes, over the linear layers of Phi-3-mini and Qwen3-4B. Each graph of calls rotates over
// weight copies that together pass L2 (50 MB), so the timed bytes come from HBM. Build and run
// on the GPU machine:
//
//   nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda \
//        kernels-cuda/dev/bench_linear.cu -o /tmp/bench_linear -lcuda && /tmp/bench_linear
//
// Prints one row per (layer, variant: plan, simt R rows a block, mma W warps S stages, plain
// read): µs per call (median of replays, and the spread), GB/s of the codes, scales and biases,
// the fraction of the copy rate measured in the same run, and the worst error against float64
// over 64 checked rows (relative to sum |x w|).
//
// Environment: BENCH_BITS=4,8 (default 4); BENCH_F16=1 (f16 instead of bf16); BENCH_ROUNDS=2
// (the variants in rotated order each round); BENCH_LAYER=phi3 (layers whose name holds it).
#include <cuda.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "linear_gemv.cuh"
#include "linear_gemv_simt.cuh"
#include "../linear_quantized.cu"
#include "bench_common.h"

namespace ak = attn_kernels::cuda;
using attn_kernels::ElementType;
using attn_kernels::LinearProblem;

namespace {

constexpr int kCalls = 40, kReplays = 15, kGroup = 64;

struct Layer {
  const char* name;
  int outputs, inputs;
};

const Layer kLayers[] = {
    {"phi3 qkv", 9216, 3072},    {"phi3 o", 3072, 3072},         {"phi3 gate_up", 16384, 3072},
    {"phi3 down", 3072, 8192},   {"phi3 lm_head", 32064, 3072},  {"qwen3-4b qkv", 6144, 2560},
    {"qwen3-4b o", 2560, 4096},  {"qwen3-4b gate_up", 19456, 2560},
    {"qwen3-4b down", 2560, 9728},
};

float half_to_float(uint16_t h) {  // host f16 -> float (normal and zero values)
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  if (exp == 0 && man == 0) return std::bit_cast<float>(sign);
  return std::bit_cast<float>(sign | (exp + 112) << 23 | man << 13);
}
uint16_t float_to_half(float f) {  // round to nearest, values in f16's normal range
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000, exp = (u >> 23) & 255;
  if (exp < 113) return uint16_t(sign);
  const uint32_t rounded = (u & 0x7fffffff) + 0xfff + ((u >> 13) & 1);
  return uint16_t(sign | ((rounded >> 13) - (112 << 10)));
}

struct Data {
  bool f16;
  float to_float(uint16_t b) const { return f16 ? half_to_float(b) : bench::bf16_to_float(b); }
  uint16_t from_float(float f) const { return f16 ? float_to_half(f) : bench::float_to_bf16(f); }
};

// A plain read of `pieces` 16-byte pieces: what any kernel reading them can reach at this size.
__global__ void read_all(const uint4* src, size_t pieces, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < pieces;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) *sink = x;  // keeps the loads
}

using Launch = void (*)(const LinearProblem&, cudaStream_t);

template <typename T, int BITS, int WARPS, int STAGES>
void launch_gemv(const LinearProblem& p, cudaStream_t stream) {
  const auto kernel = ak::linear::linear_gemv<T, BITS, STAGES>;
  const int chunks = p.inputs / ak::linear::kChunkInputs;
  const size_t smem = size_t(ak::linear::gemv_shared_floats(chunks, WARPS)) * sizeof(float);
  static bool opted = false;
  if (!opted) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    opted = true;
  }
  kernel<<<(p.outputs + 15) / 16, 32 * WARPS, smem, stream>>>(p);
}

// The SIMT candidate: a block per R rows, a 32-input piece a thread (up to 256 threads, more
// pieces a thread past K = 8192).
template <typename T, int BITS, int R>
void launch_simt(const LinearProblem& p, cudaStream_t stream) {
  const int pieces = p.inputs / ak::linear::kPieceInputs;
  const int steps = (pieces + ak::linear::kSimtMaxThreads - 1) / ak::linear::kSimtMaxThreads;
  const int threads = ((pieces + steps - 1) / steps + 31) / 32 * 32;
  ak::linear::linear_gemv_simt<T, BITS, R>
      <<<(p.outputs + R - 1) / R, threads, threads / 32 * R * sizeof(float), stream>>>(p);
}

void launch_plan(const LinearProblem& p, cudaStream_t stream) {
  const ak::LinearPlan plan = ak::plan_linear_quantized(p);
  LinearProblem arg = p;
  void* args[] = {&arg};
  if (cuLaunchKernel(plan.kernel, plan.grid[0], plan.grid[1], 1, plan.threads, 1, 1, plan.smem,
                     stream, args, nullptr) != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuLaunchKernel failed\n");
    std::exit(1);
  }
}

template <typename T, int BITS>
std::vector<std::pair<std::string, Launch>> variants() {
  return {{"plan", launch_plan},  // the many-row kernel at one row
          {"simt R2", launch_simt<T, BITS, 2>},
          {"simt R4", launch_simt<T, BITS, 4>},
          {"simt R8", launch_simt<T, BITS, 8>},
          {"mma W4 S4", launch_gemv<T, BITS, 4, 4>},
          {"mma W8 S4", launch_gemv<T, BITS, 8, 4>},
          {"mma W4 S8", launch_gemv<T, BITS, 4, 8>},
          {"mma W8 S8", launch_gemv<T, BITS, 8, 8>},
          {"mma W2 S8", launch_gemv<T, BITS, 2, 8>}};
}

void run(const Layer& layer, int bits, const Data& d, double bandwidth, int rounds,
         std::mt19937& rng) {
  const int N = layer.outputs, K = layer.inputs;
  const size_t words = size_t(N) * K * bits / 32, groups = size_t(N) * K / kGroup;
  const double bytes = words * 4.0 + groups * 4.0;
  const int copies = std::clamp(int(std::ceil(256e6 / bytes)), 2, kCalls);
  std::vector<uint32_t> hw(words);
  std::vector<uint16_t> hs(groups), hb(groups), hx(K);
  uint64_t state = (uint64_t{rng()} << 32) | rng() | 1;
  for (auto& w : hw) w = uint32_t(bench::xorshift(state));
  std::uniform_real_distribution<float> scale(0.005f, 0.02f);
  std::normal_distribution<float> normal;
  const float top = float((1 << bits) - 1);
  for (size_t g = 0; g < groups; ++g) {
    const float s = scale(rng);
    hs[g] = d.from_float(s);
    hb[g] = d.from_float(-s * top / 2);
  }
  for (auto& v : hx) v = d.from_float(normal(rng));

  uint32_t *w, *sink;
  uint16_t *s, *b, *x, *out;
  CHECK(cudaMalloc(&w, words * 4 * copies + groups * 4));  // + the plain read's overrun
  CHECK(cudaMalloc(&s, groups * 2 * copies));
  CHECK(cudaMalloc(&b, groups * 2 * copies));
  CHECK(cudaMalloc(&x, K * 2));
  CHECK(cudaMalloc(&out, N * 2));
  CHECK(cudaMalloc(&sink, 4));
  for (int c = 0; c < copies; ++c) {
    CHECK(cudaMemcpy(w + c * words, hw.data(), words * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(s + c * groups, hs.data(), groups * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b + c * groups, hb.data(), groups * 2, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemcpy(x, hx.data(), K * 2, cudaMemcpyHostToDevice));
  LinearProblem p{};
  p.rows = 1, p.outputs = N, p.inputs = K;
  p.dtype = d.f16 ? ElementType::float16 : ElementType::bfloat16;
  p.bits = bits, p.group_size = kGroup;
  p.x = x, p.x_row_stride = K, p.out = out;

  // Rows checked against float64: 64 spread over N, the last included.
  std::vector<int> checked;
  for (int i = 0; i < 64; ++i) checked.push_back(int(int64_t(i) * (N - 1) / 63));
  std::vector<double> expected, magnitude;
  for (int n : checked) {
    double e = 0, m = 0;
    for (int k = 0; k < K; ++k) {
      const uint32_t word = hw[size_t(n) * K * bits / 32 + k * bits / 32];
      const int code = (word >> (bits * (k % (32 / bits)))) & ((1 << bits) - 1);
      const size_t g = size_t(n) * (K / kGroup) + k / kGroup;
      const double wv = double(d.to_float(hs[g])) * code + d.to_float(hb[g]);
      e += wv * d.to_float(hx[k]);
      m += std::abs(wv * d.to_float(hx[k]));
    }
    expected.push_back(e);
    magnitude.push_back(m);
  }

  auto list = d.f16 ? (bits == 4 ? variants<__half, 4>() : variants<__half, 8>())
                    : (bits == 4 ? variants<__nv_bfloat16, 4>() : variants<__nv_bfloat16, 8>());
  const int nv = int(list.size()) + 1;  // + the plain read
  std::vector<std::vector<double>> samples(nv);
  std::vector<double> error(nv, 0.0);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < nv; ++i) {
      const int v = (i + round) % nv;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      for (int call = 0; call < kCalls; ++call) {
        const int c = call % copies;
        if (v == nv - 1) {
          const size_t pieces = size_t(bytes) / 16;
          read_all<<<132 * 8, 256, 0, stream>>>(reinterpret_cast<const uint4*>(w + c * words),
                                                 pieces, sink);
        } else {
          LinearProblem q = p;
          q.weight = w + c * words, q.scales = s + c * groups, q.biases = b + c * groups;
          list[v].second(q, stream);
        }
      }
      CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      auto us = bench::replay_us(exec, stream, 3, kReplays, kCalls);
      samples[v].insert(samples[v].end(), us.begin(), us.end());
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
      if (v < nv - 1) {
        std::vector<uint16_t> got(N);
        CHECK(cudaMemcpy(got.data(), out, N * 2, cudaMemcpyDeviceToHost));
        for (size_t i2 = 0; i2 < checked.size(); ++i2) {
          const double e = std::abs(d.to_float(got[checked[i2]]) - expected[i2]) / magnitude[i2];
          error[v] = std::max(error[v], e);
        }
      }
    }
  }
  for (int v = 0; v < nv; ++v) {
    auto& us = samples[v];
    std::sort(us.begin(), us.end());
    const double median = us[us.size() / 2];
    const double gbs = bytes / (median * 1e-6) / 1e9;
    const char* name = v == nv - 1 ? "plain read" : list[v].first.c_str();
    std::printf("%-18s %5d x %5d  %-10s %8.2f us (%7.2f-%7.2f)  %7.1f GB/s  %5.1f%% of copy",
                layer.name, N, K, name, median, us.front(), us.back(), gbs,
                100 * gbs * 1e9 / bandwidth);
    if (v < nv - 1) std::printf("  err %.2e", error[v]);
    std::printf("\n");
  }
  std::fflush(stdout);
  cudaFree(w), cudaFree(s), cudaFree(b), cudaFree(x), cudaFree(out), cudaFree(sink);
  cudaStreamDestroy(stream);
}

}  // namespace

int main() {
  std::vector<int> bits_list = bench::env_list("BENCH_BITS");
  if (bits_list.empty()) bits_list = {4};
  const Data d{std::getenv("BENCH_F16") && std::atoi(std::getenv("BENCH_F16")) != 0};
  const auto rounds_env = bench::env_list("BENCH_ROUNDS");
  const int rounds = rounds_env.empty() ? 2 : rounds_env[0];
  cudaFree(nullptr);
  const double bandwidth = bench::copy_bandwidth();
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, copy rate %.0f GB/s, %s, %d rounds\n", prop.name, bandwidth / 1e9,
              d.f16 ? "f16" : "bf16", rounds);
  std::mt19937 rng(7);
  for (int bits : bits_list) {
    for (const Layer& layer : kLayers) {
      const char* only = std::getenv("BENCH_LAYER");
      if (!only || std::strstr(layer.name, only)) run(layer, bits, d, bandwidth, rounds, rng);
    }
  }
  return 0;
}
