// Stand-alone timing of the quantized-KV kernels without MLX (as bench_attend.cu for the bf16
// ones): the same plan_quantized() and kernels as eval_gpu, Qwen3-4B shapes (Hq 32, Hkv 8, D 128,
// L 1, bf16 queries, scales and biases), checked against float64 attention over the dequantised
// cache, timed as CUDA graphs of 50 calls, and one call traced block by block. Build and run on
// the GPU machine:
//
//   nvcc -std=c++20 -arch=sm_90 --use_fast_math -O3 --split-compile=0 -DATTN_QUANTIZED_TRACE \
//        -I packages/attn-kernels/csrc -I kernels-cuda kernels-cuda/dev/bench_quantized.cu \
//        -o /tmp/bench_quantized -lcuda && /tmp/bench_quantized
//
// Per (bits, S), one row per kind of graph, µs per call (median of 15 replays, [min..max]), GB/s
// of the quantized K/V and the fraction of the copy-bandwidth floor measured in the same run:
//   chained      each call waits on the one before (a decode step's calls: latency);
//   independent  no edges (MLX's graph of unrelated calls, its operator benchmarks: the calls may
//                overlap, so µs per call is throughput);
//   floor        an empty kernel on the same grid, chained: what launching costs between calls.
// "cold" rows rotate K/V sets so that the graph reads more than L2 holds; "warm" rows reuse one
// set, as MLX's operator benchmarks do (L2-resident below ~50 MB).
// Then the trace of one chained call (ATTN_QUANTIZED_TRACE: %globaltimer stamps at the points
// decode_attention_common.cuh's TraceSlot names, in the mmat kernel and finish()), in µs from the
// first block's entry: when blocks start and end, how long the prologue, the walk and the merge
// take, how unequal the walks are, and how many blocks are resident over the call.
//
// Environment: BENCH_BITS=4,8 and BENCH_S=4096,131072 pick cases; BENCH_CHECK_HEADS=32 checks
// every query head against float64 (default 8); ATTN_QUANTIZED_SPLIT_BLOCKS and the library's
// other variables apply as under MLX.
#include <cuda.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#ifndef ATTN_QUANTIZED_TRACE
#error "build with -DATTN_QUANTIZED_TRACE (the kernels' stamps)"
#endif
#include "../decode_attention_quantized.cu"
#include "bench_common.h"

using attn_kernels::ElementType;
using attn_kernels::QuantizedProblem;
namespace ak = attn_kernels::cuda;

#define CHECK_DRIVER(x)                                                    \
  do {                                                                     \
    if ((x) != CUDA_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d %s failed\n", __FILE__, __LINE__, #x); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kGroupSize = 64, kCalls = 50, kReplays = 15;

__global__ void empty_kernel() {}

using bench::bf16_to_float;
using bench::copy_bandwidth;
using bench::float_to_bf16;

// BENCH_* list `name`, or `fallback` when it is unset.
std::vector<int> env_list(const char* name, std::vector<int> fallback) {
  std::vector<int> values = bench::env_list(name);
  return values.empty() ? fallback : values;
}

// One K or V array set on the host: codes, scales and biases as mx.quantize lays them out.
struct HostTriple {
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;  // bf16
};

HostTriple random_triple(int S, int bits, std::mt19937& rng) {
  HostTriple t;
  t.codes.resize(size_t{kHkv} * S * kD * bits / 32);
  t.scales.resize(size_t{kHkv} * S * kD / kGroupSize);
  t.biases.resize(t.scales.size());
  for (auto& w : t.codes) w = rng();
  // As mx.quantize makes them for standard-normal K/V: scale = range / (2^bits - 1), bias =
  // -range / 2.
  std::uniform_real_distribution<float> range(4.0f, 7.0f);
  for (size_t i = 0; i < t.scales.size(); ++i) {
    const float r = range(rng);
    t.scales[i] = float_to_bf16(r / float((1 << bits) - 1));
    t.biases[i] = float_to_bf16(-r / 2);
  }
  return t;
}

double dequantised(const HostTriple& t, int bits, int kv_head, int S, int j, int d) {
  const size_t row = size_t(kv_head) * S + j;
  const int per_word = 32 / bits;
  const uint32_t word = t.codes[row * (kD / per_word) + d / per_word];
  const uint32_t code = (word >> (bits * (d % per_word))) & ((1u << bits) - 1);
  const size_t group = row * (kD / kGroupSize) + d / kGroupSize;
  return double(bf16_to_float(t.scales[group])) * code + bf16_to_float(t.biases[group]);
}

// Output rows of every head_step-th query head in float64 over the dequantised cache.
std::vector<double> reference(const std::vector<uint16_t>& hq, const HostTriple& k,
                              const HostTriple& v, int bits, int S, double scale, int head_step) {
  std::vector<double> expected, w(S), kv_row(kD);
  for (int h = 0; h < kHq; h += head_step) {
    const int kvh = h / (kHq / kHkv);
    double mx = -INFINITY;
    for (int j = 0; j < S; ++j) {
      double s = 0;
      for (int d = 0; d < kD; ++d) {
        s += double(bf16_to_float(hq[size_t(h) * kD + d])) * dequantised(k, bits, kvh, S, j, d);
      }
      w[j] = s * scale;
      mx = std::max(mx, w[j]);
    }
    double den = 0;
    for (int j = 0; j < S; ++j) den += (w[j] = std::exp(w[j] - mx));
    std::fill(kv_row.begin(), kv_row.end(), 0.0);
    for (int j = 0; j < S; ++j) {
      for (int d = 0; d < kD; ++d) kv_row[d] += w[j] * dequantised(v, bits, kvh, S, j, d);
    }
    for (int d = 0; d < kD; ++d) expected.push_back(kv_row[d] / den);
  }
  return expected;
}

// A device copy of a triple: pointers into one allocation.
struct DeviceTriple {
  uint32_t* codes;
  uint16_t* scales;
  uint16_t* biases;
};

DeviceTriple upload(const HostTriple& t) {
  DeviceTriple d;
  CHECK(cudaMalloc(&d.codes, t.codes.size() * 4));
  CHECK(cudaMalloc(&d.scales, t.scales.size() * 2));
  CHECK(cudaMalloc(&d.biases, t.biases.size() * 2));
  CHECK(cudaMemcpy(d.codes, t.codes.data(), t.codes.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.scales, t.scales.data(), t.scales.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.biases, t.biases.data(), t.biases.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

void release(const DeviceTriple& d) {
  cudaFree(d.codes);
  cudaFree(d.scales);
  cudaFree(d.biases);
}

QuantizedProblem problem_for(const void* q, void* out, const DeviceTriple& k,
                             const DeviceTriple& v, int bits, int S) {
  QuantizedProblem p{};
  static_cast<AttentionGeometry&>(p) =
      make_geometry(1, kHq, kHkv, 1, S, kD, 1.0f / std::sqrt(float(kD)), false, nullptr);
  p.queries = q;
  p.out = out;
  p.k_codes = k.codes;
  p.k_scales = k.scales;
  p.k_biases = k.biases;
  p.v_codes = v.codes;
  p.v_scales = v.scales;
  p.v_biases = v.biases;
  p.dtype = ElementType::bfloat16;
  p.bits = bits;
  p.group_size = kGroupSize;
  const int64_t words = kD * bits / 32, groups = kD / kGroupSize;
  for (auto* strides : {&p.k_strides, &p.v_strides}) {
    const int64_t codes[4] = {kHkv * S * words, S * words, words, 1};
    const int64_t scales[4] = {kHkv * S * groups, S * groups, groups, 1};
    std::copy(codes, codes + 4, (*strides)[0]);
    std::copy(scales, scales + 4, (*strides)[1]);
    std::copy(scales, scales + 4, (*strides)[2]);
  }
  return p;
}

struct Timing {
  double median, low, high;
};

// µs per call of a graph of kCalls launches of `func`, chained or independent.
Timing time_graph(CUfunction func, const ak::QuantizedPlan& plan,
                  std::vector<std::array<void*, 4>>& args, bool chained, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaGraphCreate(&graph, 0));
  CUgraphNode previous = nullptr;
  for (int i = 0; i < kCalls; ++i) {
    CUDA_KERNEL_NODE_PARAMS node{};
    node.func = func;
    node.gridDimX = plan.grid[0];
    node.gridDimY = plan.grid[1];
    node.gridDimZ = 1;
    node.blockDimX = plan.threads;
    node.blockDimY = node.blockDimZ = 1;
    node.sharedMemBytes = func == plan.attend ? plan.smem : 0;
    node.kernelParams = func == plan.attend ? args[i].data() : nullptr;
    const bool after = chained && previous;
    CUgraphNode added;
    CHECK_DRIVER(cuGraphAddKernelNode(&added, graph, after ? &previous : nullptr, after ? 1 : 0,
                                      &node));
    previous = added;
  }
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<double> us = bench::replay_us(exec, stream, 3, kReplays, kCalls);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return {us[us.size() / 2], us.front(), us.back()};
}

double percentile(std::vector<double> x, double q) {
  std::sort(x.begin(), x.end());
  return x[std::min(x.size() - 1, size_t(q * (x.size() - 1) + 0.5))];
}

// The stamps of one call: where its time goes, in µs from the first block's entry.
void print_trace(const std::vector<unsigned long long>& t, const ak::QuantizedPlan& plan) {
  using namespace ak;  // the TraceSlot names
  const int blocks = plan.grid[0] * plan.grid[1];
  auto at = [&](int b, int slot) { return t[size_t(b) * kTraceSlots + slot]; };
  auto span = [&](int b, int from, int to) { return (at(b, to) - at(b, from)) * 1e-3; };
  unsigned long long origin = ~0ull, last_exit = 0;
  for (int b = 0; b < blocks; ++b) {
    origin = std::min(origin, at(b, kTraceEntry));
    last_exit = std::max(last_exit, at(b, kTraceExit));
  }
  auto us = [&](unsigned long long x) { return (x - origin) * 1e-3; };
  std::vector<double> entry, issued, loaded, queries, to_walk, walk, warp_spread, walk_end, exit;
  for (int b = 0; b < blocks; ++b) {
    entry.push_back(us(at(b, kTraceEntry)));
    issued.push_back(span(b, kTraceEntry, kTraceCopiesIssued));
    loaded.push_back(span(b, kTraceCopiesIssued, kTraceQueriesLoaded));
    queries.push_back(span(b, kTraceQueriesLoaded, kTraceQueries));
    to_walk.push_back(span(b, kTraceQueries, kTraceWalk));
    unsigned long long first = ~0ull, latest = 0;
    for (int w = 0; w < 4; ++w) {
      walk.push_back(span(b, kTraceWalk, kTraceWalkEnd + w));
      first = std::min(first, at(b, kTraceWalkEnd + w));
      latest = std::max(latest, at(b, kTraceWalkEnd + w));
    }
    warp_spread.push_back((latest - first) * 1e-3);
    walk_end.push_back(us(latest));
    exit.push_back(us(at(b, kTraceExit)));
  }
  // The merging block of a row: the last of its column of chunks to exit.
  std::vector<double> combine, to_states, to_factors, to_exit;
  std::vector<bool> merger(blocks, false);
  if (plan.grid[1] > 1) {
    for (unsigned x = 0; x < plan.grid[0]; ++x) {
      int last = x;
      for (unsigned y = 0; y < plan.grid[1]; ++y) {
        const int b = y * plan.grid[0] + x;
        if (at(b, kTraceExit) > at(last, kTraceExit)) last = b;
      }
      merger[last] = true;
      to_states.push_back(span(last, kTraceArrived, kTraceMergeStates));
      to_factors.push_back(span(last, kTraceMergeStates, kTraceMergeFactors));
      to_exit.push_back(span(last, kTraceMergeFactors, kTraceExit));
    }
  }
  std::vector<double> finish_others, finish_mergers;
  for (int b = 0; b < blocks; ++b) {
    if (plan.grid[1] > 1) {
      combine.push_back(span(b, kTraceFinish, kTraceArrived));
      (merger[b] ? finish_mergers : finish_others).push_back(span(b, kTraceFinish, kTraceExit));
    } else {
      finish_others.push_back(span(b, kTraceFinish, kTraceExit));
    }
  }
  auto row = [](const char* name, const std::vector<double>& x) {
    std::printf("    %-36s min %6.2f  p10 %6.2f  median %6.2f  p90 %6.2f  max %6.2f\n", name,
                percentile(x, 0), percentile(x, 0.1), percentile(x, 0.5), percentile(x, 0.9),
                percentile(x, 1));
  };
  std::printf("  trace of one chained call (%d blocks, grid %u x %u), µs; span %.2f\n", blocks,
              plan.grid[0], plan.grid[1], us(last_exit));
  row("entry (from the first)", entry);
  row("prologue: entry to copies issued", issued);
  row("  to the first query load back", loaded);
  row("  to the queries as f16 operands", queries);
  row("  to the walk (sums, columns)", to_walk);
  row("walk, per warp", walk);
  row("walk ends, last warp - first", warp_spread);
  row("walk end of the block", walk_end);
  row("finish(), the others", finish_others);
  if (!finish_mergers.empty()) {
    row("  combine, store, arrive (all)", combine);
    row("finish(), the merging blocks", finish_mergers);
    row("  arrived to chunk states loaded", to_states);
    row("  to rescale factors", to_factors);
    row("  to exit (sums, output)", to_exit);
  }
  row("exit", exit);
  // Resident blocks over the call, in twentieths of its span.
  std::printf("    resident blocks per 1/20 of the span:");
  for (int i = 0; i < 20; ++i) {
    const double when = us(last_exit) * (i + 0.5) / 20;
    int n = 0;
    for (int b = 0; b < blocks; ++b) n += entry[b] <= when && exit[b] > when;
    std::printf(" %d", n);
  }
  std::printf("\n");
  std::vector<int> per_sm(1024, 0);
  int sms = 0, most = 0;
  for (int b = 0; b < blocks; ++b) {
    const int sm = int(at(b, kTraceSm)) % 1024;
    sms += per_sm[sm]++ == 0;
    most = std::max(most, per_sm[sm]);
  }
  std::printf("    SMs used %d, most blocks on one SM %d\n", sms, most);
}

void run(int bits, int S, double bandwidth, std::mt19937& rng, int head_step) {
  const size_t q_elems = size_t{kHq} * kD;
  HostTriple hk = random_triple(S, bits, rng), hv = random_triple(S, bits, rng);
  const double kv_bytes =
      2.0 * (hk.codes.size() * 4 + hk.scales.size() * 2 + hk.biases.size() * 2);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> hq(q_elems);
  for (auto& x : hq) x = float_to_bf16(normal(rng));
  // Enough K/V sets that a graph's calls read more than L2 (~50 MB) holds.
  const int sets = std::clamp(static_cast<int>(std::ceil(256e6 / kv_bytes)), 1, kCalls);
  std::vector<DeviceTriple> ks, vs;
  for (int s = 0; s < sets; ++s) {
    ks.push_back(upload(hk));
    vs.push_back(upload(hv));
  }
  uint16_t *q, *out;
  CHECK(cudaMalloc(&q, q_elems * 2));
  CHECK(cudaMalloc(&out, kCalls * q_elems * 2));
  CHECK(cudaMemcpy(q, hq.data(), q_elems * 2, cudaMemcpyHostToDevice));

  const QuantizedProblem base = problem_for(q, out, ks[0], vs[0], bits, S);
  std::vector<ak::QuantizedPlan> plans(kCalls);
  for (auto& each : plans) each = ak::plan_quantized(base);  // fresh arrival slots, as eval_gpu
  const ak::QuantizedPlan& plan = plans[0];
  float* partial_base = nullptr;
  if (plan.partial_floats) {
    CHECK(cudaMalloc(&partial_base, kCalls * plan.partial_floats * sizeof(float)));
  }
  // Every launch stamps its blocks (a few stores each); the last one's stamps are printed.
  unsigned long long* trace;
  const size_t stamps = size_t(plan.grid[0]) * plan.grid[1] * ak::kTraceSlots;
  CHECK(cudaMalloc(&trace, stamps * 8));
  CHECK(cudaMemcpyToSymbol(ak::quantized_trace, &trace, sizeof(trace)));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::printf("bits %d  S %d  grid %u x %u  chunk %d  %.1f MB of K/V\n", bits, S, plan.grid[0],
              plan.grid[1], plan.chunk, kv_bytes / 1e6);
  for (const bool warm : {false, true}) {
    std::vector<QuantizedProblem> problems(kCalls, base);
    std::vector<float*> partials(kCalls);
    std::vector<int> chunks(kCalls);
    std::vector<unsigned> slots(kCalls);
    std::vector<std::array<void*, 4>> args(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      const int s = warm ? 0 : i % sets;
      problems[i] = problem_for(q, out + i * q_elems, ks[s], vs[s], bits, S);
      partials[i] = partial_base ? partial_base + i * plan.partial_floats : nullptr;
      chunks[i] = plans[i].chunk;
      slots[i] = plans[i].arrival_slot;
      args[i] = {&problems[i], &partials[i], &chunks[i], &slots[i]};
    }
    for (const bool chained : {true, false}) {
      const Timing t = time_graph(plan.attend, plan, args, chained, stream);
      const double gbs = kv_bytes / (t.median * 1e-6) / 1e9;
      std::printf("  %-4s %-11s %8.2f us [%6.2f..%6.2f] %6.0f GB/s %5.1f%% floor\n",
                  warm ? "warm" : "cold", chained ? "chained" : "independent", t.median, t.low,
                  t.high, gbs, 100.0 * gbs * 1e9 / bandwidth);
    }
  }
  CUfunction empty;
  CHECK(cudaGetFuncBySymbol(reinterpret_cast<cudaFunction_t*>(&empty),
                            reinterpret_cast<const void*>(&empty_kernel)));
  std::vector<std::array<void*, 4>> no_args(kCalls);
  const Timing floor = time_graph(empty, plan, no_args, true, stream);
  std::printf("  floor (empty kernel, same grid, chained) %.2f us [%.2f..%.2f]\n", floor.median,
              floor.low, floor.high);

  // One call on the first set, traced and checked (NaN poison: every output must be written).
  QuantizedProblem p = problem_for(q, out, ks[0], vs[0], bits, S);
  float* part = partial_base;
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  void* args[] = {&p, &part, &chunk, &slot};
  CHECK(cudaMemset(out, 0xff, q_elems * 2));
  for (int i = 0; i < 2; ++i) {  // the second call, after one that warmed the instruction caches
    CHECK_DRIVER(cuLaunchKernel(plan.attend, plan.grid[0], plan.grid[1], 1, plan.threads, 1, 1,
                                plan.smem, stream, args, nullptr));
  }
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGetLastError());
  std::vector<unsigned long long> stamped(stamps);
  CHECK(cudaMemcpy(stamped.data(), trace, stamps * 8, cudaMemcpyDeviceToHost));
  print_trace(stamped, plan);
  std::vector<uint16_t> hout(q_elems);
  CHECK(cudaMemcpy(hout.data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
  const std::vector<double> expected = reference(hq, hk, hv, bits, S, p.scale, head_step);
  double err = 0, norm = 0;
  size_t at = 0;
  for (int h = 0; h < kHq; h += head_step) {
    for (int d = 0; d < kD; ++d, ++at) {
      const double got = bf16_to_float(hout[size_t(h) * kD + d]), o = expected[at];
      err += (got - o) * (got - o);
      norm += o * o;
    }
  }
  const double rel = std::isfinite(err) ? std::sqrt(err / norm) : INFINITY;
  std::printf("  relative RMS error against float64 (%d heads): %.1e%s\n", kHq / head_step, rel,
              rel < 1e-2 ? "" : "  WRONG");
  cudaFree(trace);
  cudaStreamDestroy(stream);
  if (partial_base) cudaFree(partial_base);
  for (int s = 0; s < sets; ++s) {
    release(ks[s]);
    release(vs[s]);
  }
  cudaFree(q);
  cudaFree(out);
}

}  // namespace

int main() {
  CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bandwidth = copy_bandwidth();
  std::printf("%s, %d SMs; copy bandwidth %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, bandwidth / 1e9);
  std::mt19937 rng(7);
  const int checked = std::clamp(env_list("BENCH_CHECK_HEADS", {8})[0], 1, kHq);
  for (const int bits : env_list("BENCH_BITS", {4, 8})) {
    for (const int S : env_list("BENCH_S", {4096, 32768, 131072})) {
      run(bits, S, bandwidth, rng, kHq / checked);
    }
  }
  return 0;
}
