// Stand-alone timing of the library's CUDA kernels, without MLX (llm.c's dev/cuda style): the
// same plan() and kernels as eval_gpu, launched from a CUDA graph of 50 calls, checked against a
// float64 reference on the host, timed with events over K/V sets rotated so that the timed bytes
// come from HBM, not from L2. Build and run on the GPU machine:
//
//   nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 -I packages/attn-kernels/csrc -I kernels-cuda \
//        kernels-cuda/dev/bench_attend.cu -o /tmp/bench_attend -lcuda && /tmp/bench_attend
//
// Prints one row per (schedule, L, S): µs per call (median of replays), GB/s of K+V, the fraction
// of the copy-bandwidth floor measured in the same run, and the relative error.
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../decode_attention.cu"

using attn_kernels::DecodeProblem;
using attn_kernels::ElementType;
namespace ak = attn_kernels::cuda;

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kCalls = 50, kReplays = 15;

float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Copy rate (read + write bytes per second) of a 1 GiB device-to-device copy.
double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  std::vector<float> ms;
  for (int i = 0; i < 7; ++i) {
    cudaEventRecord(t0);
    CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float m;
    cudaEventElapsedTime(&m, t0, t1);
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);
}

struct Case {
  const char* schedule;
  int L;
  bool causal;
  int S;
};

void run(const Case& c, double bandwidth, std::mt19937& rng) {
  const size_t q_elems = size_t{kHq} * c.L * kD, kv_elems = size_t{kHkv} * c.S * kD;
  const double kv_bytes = 2.0 * kv_elems * 2;
  // Enough K/V sets that one graph's calls read more than L2 (50 MB) holds.
  const int sets = std::clamp(static_cast<int>(std::ceil(256e6 / kv_bytes)), 1, kCalls);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> hq(q_elems), hk(kv_elems), hv(kv_elems);
  for (auto& x : hq) x = float_to_bf16(normal(rng));
  for (auto& x : hk) x = float_to_bf16(normal(rng));
  for (auto& x : hv) x = float_to_bf16(normal(rng));
  uint16_t *q, *kv, *out;
  CHECK(cudaMalloc(&q, q_elems * 2));
  CHECK(cudaMalloc(&kv, 2 * kv_elems * 2 * sets));
  CHECK(cudaMalloc(&out, q_elems * 2));
  CHECK(cudaMemcpy(q, hq.data(), q_elems * 2, cudaMemcpyHostToDevice));
  for (int s = 0; s < sets; ++s) {
    CHECK(cudaMemcpy(kv + 2 * s * kv_elems, hk.data(), kv_elems * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(kv + (2 * s + 1) * kv_elems, hv.data(), kv_elems * 2, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemset(out, 0xff, q_elems * 2));  // NaN poison: every element must be written

  DecodeProblem p{};
  p.queries = q;
  p.out = out;
  p.dtype = ElementType::bfloat16;
  p.mask_dtype = ElementType::float32;
  p.rows = kHq;
  p.kv_rows = kHkv;
  p.group = kHq / kHkv;
  p.query_len = c.L;
  p.context = c.S;
  p.head_dim = kD;
  p.q_heads = kHq;
  p.kv_heads = kHkv;
  p.scale = 1.0f / std::sqrt(float(kD));
  p.causal = c.causal;
  const int64_t qs[4] = {int64_t{kHq} * c.L * kD, int64_t{c.L} * kD, kD, 1};
  const int64_t ks[4] = {int64_t{kHkv} * c.S * kD, int64_t{c.S} * kD, kD, 1};
  std::copy(qs, qs + 4, p.q_strides);
  std::copy(ks, ks + 4, p.k_strides);
  std::copy(ks, ks + 4, p.v_strides);

  const ak::Plan plan = ak::plan(p, ak::parse_schedule(c.schedule));
  float* partials = nullptr;
  if (plan.partial_floats) CHECK(cudaMalloc(&partials, plan.partial_floats * sizeof(float)));

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::vector<DecodeProblem> problems(kCalls, p);
  auto launch = [&](DecodeProblem& pr) {
    int chunk = plan.chunk;
    unsigned slot = plan.arrival_slot;
    void* args[] = {&pr, &partials, &chunk, &slot};
    if (cuLaunchKernel(plan.attend, plan.attend_grid[0], plan.attend_grid[1], 1,
                       plan.attend_threads, 1, 1, plan.attend_smem, stream, args,
                       nullptr) != CUDA_SUCCESS) {
      std::fprintf(stderr, "attend launch failed\n");
      std::exit(1);
    }
  };
  for (int i = 0; i < kCalls; ++i) {
    const int s = i % sets;
    problems[i].keys = kv + 2 * s * kv_elems;
    problems[i].values = kv + (2 * s + 1) * kv_elems;
  }

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kCalls; ++i) launch(problems[i]);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  std::vector<float> us;
  // BENCH_REPLAYS=1: one timed replay (e.g. under compute-sanitizer, which serialises everything).
  const char* replays_env = std::getenv("BENCH_REPLAYS");
  const int replays = replays_env ? std::max(1, std::atoi(replays_env)) : kReplays;
  for (int r = 0; r < replays + 2; ++r) {
    cudaEventRecord(t0, stream);
    CHECK(cudaGraphLaunch(exec, stream));
    cudaEventRecord(t1, stream);
    CHECK(cudaEventSynchronize(t1));
    float ms;
    cudaEventElapsedTime(&ms, t0, t1);
    if (r >= 2) us.push_back(ms * 1e3f / kCalls);
  }
  CHECK(cudaGetLastError());
  // Correctness of the first set against float64, after the timed replays: split calls reuse
  // their arrival counters, so a counter left non-zero would show here.
  CHECK(cudaMemset(out, 0xff, q_elems * 2));
  launch(problems[0]);
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGetLastError());
  std::vector<uint16_t> hout(q_elems);
  CHECK(cudaMemcpy(hout.data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
  double err = 0, norm = 0;
  const int group = kHq / kHkv;
  std::vector<double> w(c.S);
  for (int h = 0; h < kHq; ++h) {
    const int kvh = h / group;
    for (int i = 0; i < c.L; ++i) {
      const int visible = c.causal ? c.S - c.L + i + 1 : c.S;
      double mx = -INFINITY;
      for (int j = 0; j < visible; ++j) {
        double s = 0;
        for (int d = 0; d < kD; ++d) {
          s += double(bf16_to_float(hq[(size_t(h) * c.L + i) * kD + d])) *
               bf16_to_float(hk[(size_t(kvh) * c.S + j) * kD + d]);
        }
        w[j] = s * p.scale;
        mx = std::max(mx, w[j]);
      }
      double den = 0;
      for (int j = 0; j < visible; ++j) den += (w[j] = std::exp(w[j] - mx));
      for (int d = 0; d < kD; ++d) {
        double o = 0;
        for (int j = 0; j < visible; ++j) o += w[j] * bf16_to_float(hv[(size_t(kvh) * c.S + j) * kD + d]);
        o /= den;
        const double got = bf16_to_float(hout[(size_t(h) * c.L + i) * kD + d]);
        err += (got - o) * (got - o);
        norm += o * o;
      }
    }
  }
  const double rel = std::isfinite(err) ? std::sqrt(err / norm) : INFINITY;
  std::sort(us.begin(), us.end());
  const double median = us[us.size() / 2];
  const double gbs = kv_bytes / (median * 1e-6) / 1e9;
  std::printf("%-13s L=%d %-6s S=%-7d splits=%-4d %8.2f us [%7.2f..%7.2f] %7.0f GB/s %5.1f%% floor  err %.1e%s\n",
              c.schedule, c.L, c.causal ? "causal" : "none", c.S, plan.splits, median, us.front(),
              us.back(), gbs, 100.0 * gbs * 1e9 / bandwidth, rel, rel < 1e-2 ? "" : "  WRONG");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(q);
  cudaFree(kv);
  cudaFree(out);
  if (partials) cudaFree(partials);
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(7);
  const double bandwidth = copy_bandwidth();
  std::printf("copy bandwidth %.0f GB/s (read + write)\n", bandwidth / 1e9);
  std::vector<const char*> schedules = {"split-mma", "split-gqa", "chapter-32"};
  if (argc > 1) schedules.assign(argv + 1, argv + argc);
  // BENCH_MAX_S=1024: only the short contexts (e.g. under compute-sanitizer).
  const char* max_env = std::getenv("BENCH_MAX_S");
  const int max_s = max_env ? std::atoi(max_env) : 1 << 30;
  // BENCH_L=8: only that query length (e.g. to profile one case with ncu -c 1).
  const char* l_env = std::getenv("BENCH_L");
  const int only_l = l_env ? std::atoi(l_env) : 0;
  auto wanted = [&](int L, int S) { return S <= max_s && (only_l == 0 || L == only_l); };
  const int contexts[] = {1, 32, 64, 128, 192, 256, 512, 1024, 2048, 4096, 16384, 32768, 131072};
  for (const char* schedule : schedules) {
    for (int S : contexts) {
      if (wanted(1, S)) run({schedule, 1, false, S}, bandwidth, rng);
    }
    for (int L : {2, 4, 8}) {
      for (int S : {32, 256, 512, 1024, 4096}) {
        if (wanted(L, S)) run({schedule, L, true, S}, bandwidth, rng);
      }
    }
  }
}
