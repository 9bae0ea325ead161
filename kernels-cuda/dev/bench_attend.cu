// Stand-alone timing of the library's CUDA kernels, without MLX (llm.c's dev/cuda style): the
// same plan() and kernels as eval_gpu, launched from a CUDA graph of 50 calls, checked against a
// float64 reference on the host, timed with events over K/V sets rotated so that the timed bytes
// come from HBM, not from L2. Build and run on the GPU machine:
//
//   nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda \
//        kernels-cuda/dev/bench_attend.cu -o /tmp/bench_attend -lcuda && /tmp/bench_attend
//
// Prints one row per (schedule, L, S): µs per call (median of replays), GB/s of K+V, the fraction
// of the copy-bandwidth floor measured in the same run, the relative error, and the host time of
// one plan() call.
//
// Environment: BENCH_S=512,4096 and BENCH_L=2,8 pick cases (BENCH_MAX_S caps S); BENCH_REPLAYS=1
// times one replay (e.g. under compute-sanitizer); BENCH_WARM=1 gives every call the same K/V
// (L2-resident, as in MLX's operator benchmarks); BENCH_INDEPENDENT=1 builds the graph without
// edges between calls, each with its own plan() and partials, as MLX's graph holds independent
// calls (they may run side by side: µs per call is then throughput, not latency).
// BENCH_SPLITS=0,8,16 (split-mma only) times each case at those split counts, rounded to whole
// block steps as plan() rounds them (0: plan()'s own), for the sweeps behind split_count();
// BENCH_CHECK_HEADS=4 checks only every eighth query head against float64 (faster sweeps).
// BENCH_HKV=32 BENCH_D=96: other geometries (32 query heads; Phi-3's no-GQA D 96 here).
#include <cuda.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../decode_attention.cu"
#include "bench_common.h"

using attn_kernels::AttentionGeometry;
using attn_kernels::DecodeProblem;
using attn_kernels::ElementType;
using attn_kernels::make_geometry;
namespace ak = attn_kernels::cuda;

namespace {

constexpr int kHq = 32, kCalls = 50, kReplays = 15;
// BENCH_HKV and BENCH_D (main): Qwen3-4B's 8 KV heads of D = 128 unless set.
int kv_heads = 8, head_dim = 128;

using bench::bf16_to_float;
using bench::copy_bandwidth;
using bench::env_list;
using bench::float_to_bf16;

struct Case {
  const char* schedule;
  int L;
  bool causal;
  int S;
};

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value && std::atoi(value) != 0;
}

struct Mode {
  bool warm, independent;
  std::vector<int> splits;  // split-mma split counts to time instead of plan()'s (empty: plan()'s)
  int checked_heads;        // query heads checked against float64
};

// Standard-normal bf16 values: 2^20 drawn from normal_distribution, then picked by a xorshift
// stream (drawing every element of a long context's K/V, ~10^9 of them, took ~20 s a case).
void fill_normal(std::vector<uint16_t>& values, std::mt19937& rng) {
  static std::vector<uint16_t> table;
  if (table.empty()) {
    std::normal_distribution<float> normal;
    table.resize(size_t{1} << 20);
    for (auto& x : table) x = float_to_bf16(normal(rng));
  }
  uint64_t state = (uint64_t{rng()} << 32) | rng() | 1;
  for (auto& x : values) x = table[bench::xorshift(state) >> 44];
}

// Output rows of the checked heads (every kHq / checked_heads-th) in float64.
std::vector<double> reference(const Case& c, const std::vector<uint16_t>& hq,
                              const std::vector<uint16_t>& hk, const std::vector<uint16_t>& hv,
                              float scale, int head_step) {
  const int group = kHq / kv_heads;
  std::vector<double> expected, w(c.S);
  for (int h = 0; h < kHq; h += head_step) {
    const int kvh = h / group;
    for (int i = 0; i < c.L; ++i) {
      const int visible = c.causal ? c.S - c.L + i + 1 : c.S;
      double mx = -INFINITY;
      for (int j = 0; j < visible; ++j) {
        double s = 0;
        for (int d = 0; d < head_dim; ++d) {
          s += double(bf16_to_float(hq[(size_t(h) * c.L + i) * head_dim + d])) *
               bf16_to_float(hk[(size_t(kvh) * c.S + j) * head_dim + d]);
        }
        w[j] = s * scale;
        mx = std::max(mx, w[j]);
      }
      double den = 0;
      for (int j = 0; j < visible; ++j) den += (w[j] = std::exp(w[j] - mx));
      for (int d = 0; d < head_dim; ++d) {
        double o = 0;
        for (int j = 0; j < visible; ++j) {
          o += w[j] * bf16_to_float(hv[(size_t(kvh) * c.S + j) * head_dim + d]);
        }
        expected.push_back(o / den);
      }
    }
  }
  return expected;
}

void run(const Case& c, double bandwidth, std::mt19937& rng, const Mode& mode) {
  const bool independent = mode.independent;
  const size_t q_elems = size_t{kHq} * c.L * head_dim;
  const size_t kv_elems = static_cast<size_t>(kv_heads) * c.S * head_dim;
  const double kv_bytes = 2.0 * kv_elems * 2;
  // Enough K/V sets that one graph's calls read more than L2 (50 MB) holds.
  const int sets =
      mode.warm ? 1 : std::clamp(static_cast<int>(std::ceil(256e6 / kv_bytes)), 1, kCalls);
  std::vector<uint16_t> hq(q_elems), hk(kv_elems), hv(kv_elems);
  fill_normal(hq, rng);
  fill_normal(hk, rng);
  fill_normal(hv, rng);
  uint16_t *q, *kv, *out;
  CHECK(cudaMalloc(&q, q_elems * 2));
  CHECK(cudaMalloc(&kv, 2 * kv_elems * 2 * sets));
  const int outs = independent ? kCalls : 1;  // concurrent calls write outputs of their own
  CHECK(cudaMalloc(&out, outs * q_elems * 2));
  CHECK(cudaMemcpy(q, hq.data(), q_elems * 2, cudaMemcpyHostToDevice));
  for (int s = 0; s < sets; ++s) {
    CHECK(cudaMemcpy(kv + 2 * s * kv_elems, hk.data(), kv_elems * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(kv + (2 * s + 1) * kv_elems, hv.data(), kv_elems * 2, cudaMemcpyHostToDevice));
  }

  DecodeProblem p{};
  static_cast<AttentionGeometry&>(p) = make_geometry(
      1, kHq, kv_heads, c.L, c.S, head_dim, 1.0f / std::sqrt(float(head_dim)), c.causal, nullptr);
  p.queries = q;
  p.out = out;
  p.dtype = ElementType::bfloat16;
  const int64_t ks[4] = {int64_t{kv_heads} * c.S * head_dim, int64_t{c.S} * head_dim, head_dim,
                         1};
  std::copy(ks, ks + 4, p.k_strides);
  std::copy(ks, ks + 4, p.v_strides);
  const int head_step = kHq / std::clamp(mode.checked_heads, 1, kHq);
  const std::vector<double> expected = reference(c, hq, hk, hv, p.scale, head_step);

  const ak::Schedule schedule = ak::parse_schedule(c.schedule);
  // Host time of plan() itself (it runs on every eval_gpu call).
  constexpr int kPlanRuns = 20000;
  const auto plan_start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPlanRuns; ++i) ak::plan(p, schedule);
  const double plan_ns = std::chrono::duration<double, std::nano>(
                             std::chrono::steady_clock::now() - plan_start).count() / kPlanRuns;

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const std::vector<int> split_counts = mode.splits.empty() ? std::vector<int>{0} : mode.splits;
  for (const int forced : split_counts) {
    // One plan per call, as eval_gpu makes them: concurrent calls need their own arrival slots.
    std::vector<ak::Plan> plans(kCalls);
    for (auto& each : plans) {
      each = ak::plan(p, schedule);
      if (forced) {
        if (schedule != ak::Schedule::split_mma || !ak::mma_applies(p)) {
          std::fprintf(stderr, "BENCH_SPLITS needs split-mma\n");
          std::exit(1);
        }
        const int tiles = (p.group * p.query_len + ak::kMmaVectors - 1) / ak::kMmaVectors;
        ak::finish_plan(each, p, std::min(forced, c.S), tiles, ak::kMmaWarps * ak::kMmaStep);
      }
    }
    const ak::Plan& plan = plans[0];
    const int partial_sets = independent ? kCalls : 1;
    float* partial_base = nullptr;
    if (plan.partial_floats) {
      CHECK(cudaMalloc(&partial_base, partial_sets * plan.partial_floats * sizeof(float)));
    }
    std::vector<DecodeProblem> problems(kCalls, p);
    std::vector<float*> partials(kCalls, partial_base);
    std::vector<int> chunks(kCalls);
    std::vector<unsigned> slots(kCalls);
    std::vector<std::array<void*, 4>> args(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      const int s = i % sets;
      problems[i].keys = kv + 2 * s * kv_elems;
      problems[i].values = kv + (2 * s + 1) * kv_elems;
      if (independent) {
        problems[i].out = out + i * q_elems;
        if (partial_base) partials[i] = partial_base + i * plan.partial_floats;
      }
      chunks[i] = plans[i].chunk;
      slots[i] = plans[i].arrival_slot;
      args[i] = {&problems[i], &partials[i], &chunks[i], &slots[i]};
    }
    // The calls as graph nodes: in sequence each waits on the one before (a decode step's
    // layers); independent calls have no edges (MLX's graph of unrelated calls).
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaGraphCreate(&graph, 0));
    CUgraphNode previous = nullptr;
    for (int i = 0; i < kCalls; ++i) {
      CUDA_KERNEL_NODE_PARAMS node{};
      node.func = plan.attend;
      node.gridDimX = plan.attend_grid[0];
      node.gridDimY = plan.attend_grid[1];
      node.gridDimZ = 1;
      node.blockDimX = plan.attend_threads;
      node.blockDimY = node.blockDimZ = 1;
      node.sharedMemBytes = plan.attend_smem;
      node.kernelParams = args[i].data();
      const bool after = !independent && previous;
      CUgraphNode added;
      if (cuGraphAddKernelNode(&added, graph, after ? &previous : nullptr, after ? 1 : 0, &node) !=
          CUDA_SUCCESS) {
        std::fprintf(stderr, "cuGraphAddKernelNode failed\n");
        std::exit(1);
      }
      previous = added;
    }
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    // BENCH_REPLAYS=1: one timed replay (e.g. under compute-sanitizer, which serialises all).
    const char* replays_env = std::getenv("BENCH_REPLAYS");
    const int replays = replays_env ? std::max(1, std::atoi(replays_env)) : kReplays;
    const std::vector<double> us = bench::replay_us(exec, stream, 2, replays, kCalls);
    // Correctness of the first set against float64, after the timed replays: split calls reuse
    // their arrival counters, so a counter left non-zero would show here.
    CHECK(cudaMemset(out, 0xff, q_elems * 2));  // NaN poison: every element must be written
    if (cuLaunchKernel(plan.attend, plan.attend_grid[0], plan.attend_grid[1], 1,
                       plan.attend_threads, 1, 1, plan.attend_smem, stream, args[0].data(),
                       nullptr) != CUDA_SUCCESS) {
      std::fprintf(stderr, "attend launch failed\n");
      std::exit(1);
    }
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaGetLastError());
    std::vector<uint16_t> hout(q_elems);
    CHECK(cudaMemcpy(hout.data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    size_t at = 0;
    for (int h = 0; h < kHq; h += head_step) {
      for (size_t e = 0; e < size_t(c.L) * head_dim; ++e, ++at) {
        const double got = bf16_to_float(hout[size_t(h) * c.L * head_dim + e]), o = expected[at];
        err += (got - o) * (got - o);
        norm += o * o;
      }
    }
    const double rel = std::isfinite(err) ? std::sqrt(err / norm) : INFINITY;
    const double median = us[us.size() / 2];
    const double gbs = kv_bytes / (median * 1e-6) / 1e9;
    std::printf("%-13s L=%d %-6s S=%-7d splits=%-4d %8.2f us [%7.2f..%7.2f] %7.0f GB/s %5.1f%% "
                "floor  err %.1e  plan %.0f ns%s\n",
                c.schedule, c.L, c.causal ? "causal" : "none", c.S, plan.splits, median,
                us.front(), us.back(), gbs, 100.0 * gbs * 1e9 / bandwidth, rel, plan_ns,
                rel < 1e-2 ? "" : "  WRONG");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    if (partial_base) cudaFree(partial_base);
  }
  cudaStreamDestroy(stream);
  cudaFree(q);
  cudaFree(kv);
  cudaFree(out);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(7);
  if (const char* hkv = std::getenv("BENCH_HKV")) kv_heads = std::atoi(hkv);
  if (const char* d = std::getenv("BENCH_D")) head_dim = std::atoi(d);
  if (kv_heads < 1 || kHq % kv_heads != 0 || head_dim < 16 || head_dim > 256 || head_dim % 16) {
    std::fprintf(stderr, "BENCH_HKV must divide %d, BENCH_D be a multiple of 16 to 256\n", kHq);
    return 1;
  }
  const double bandwidth = copy_bandwidth();
  std::printf("copy bandwidth %.0f GB/s (read + write); Hq %d, Hkv %d, D %d\n",
              bandwidth / 1e9, kHq, kv_heads, head_dim);
  std::vector<const char*> schedules = {"split-mma", "split-gqa", "chapter-32"};
  if (argc > 1) schedules.assign(argv + 1, argv + argc);
  const char* max_env = std::getenv("BENCH_MAX_S");
  const int max_s = max_env ? std::atoi(max_env) : 1 << 30;
  const std::vector<int> only_l = env_list("BENCH_L"), only_s = env_list("BENCH_S");
  auto listed = [](const std::vector<int>& list, int x) {
    return list.empty() || std::find(list.begin(), list.end(), x) != list.end();
  };
  auto wanted = [&](int L, int S) { return S <= max_s && listed(only_l, L) && listed(only_s, S); };
  Mode mode{env_flag("BENCH_WARM"), env_flag("BENCH_INDEPENDENT"), env_list("BENCH_SPLITS"), kHq};
  if (const char* heads = std::getenv("BENCH_CHECK_HEADS")) mode.checked_heads = std::atoi(heads);
  std::printf("K/V %s, calls %s\n", mode.warm ? "warm (one set)" : "from HBM (rotated sets)",
              mode.independent ? "independent (no graph edges)" : "in sequence");
  auto run_case = [&](const Case& c) {
    if (wanted(c.L, c.S)) run(c, bandwidth, rng, mode);
  };
  const std::vector<int> contexts =
      only_s.empty() ? std::vector<int>{1, 32, 64, 128, 192, 256, 512, 1024, 2048, 4096, 16384,
                                        32768, 131072}
                     : only_s;
  const std::vector<int> causal_contexts =
      only_s.empty() ? std::vector<int>{32, 256, 512, 1024, 4096} : only_s;
  for (const char* schedule : schedules) {
    for (int S : contexts) run_case({schedule, 1, false, S});
    for (int L : {2, 4, 8}) {
      for (int S : causal_contexts) run_case({schedule, L, true, S});
    }
  }
}
