// The CPU linear kernel without MLX or Python, against a float64 reference: every path this CPU
// runs (or those named on the command line), dense weights in every float dtype and mx.quantize's
// affine codes (4 and 8 bits, groups of 32, 64 and 128), 1 to 11 rows of x (the 1/2/4/8 loops,
// their zero-padded rows, and a second chunk of rows), widths that are and are not multiples of
// the vector steps, strided rows of x, with and without a bias, on a pool of 4 threads whose calls
// take all or 2 of them, and with a SwiGLU gate (the input silu(gate) * x). Exit status 0 when
// every case passes. `make test-cpu-kernel` runs it natively, `make test-arm64` cross-compiled
// under qemu-user (NEON). Usage: cpu_linear_check [--seeds N] [PATH...].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu_check.h"
#include "cpu_linear.h"

using namespace attn_kernels;
using namespace attn_kernels::check;

namespace {

struct Case {
  ElementType dtype;
  int rows, outputs, inputs;
  int bits = 0;  // 0: dense
  int group_size = 64;
  bool bias = true;
  int x_stride_extra = 0;  // x rows this many elements longer than inputs
  bool gated = false;      // a gate beside x (its rows as long): the input is silu(gate) * x
  bool nan_last_row = false;  // NaN scales and biases in W's last row: only its outputs are NaN
};

const char* dtype_name(ElementType t) {
  return t == ElementType::float32 ? "f32" : t == ElementType::float16 ? "f16" : "bf16";
}

// Runs one case on every path; adds 1 to failed[n] when path n mismatches (printing the first).
void run_case(const Case& c, const std::vector<CpuPath>& paths, uint32_t seed,
              std::vector<int>& failed) {
  Random rng(seed);
  const int M = c.rows, N = c.outputs, K = c.inputs, stride = K + c.x_stride_extra;
  Tensor x(c.dtype, size_t(M) * stride), bias(c.dtype, N), out(c.dtype, size_t(M) * N);
  for (size_t i = 0; i < x.values.size(); ++i) x.set(i, rng.normal());
  Tensor gate(c.dtype, c.gated ? x.values.size() : 0);
  for (size_t i = 0; i < gate.values.size(); ++i) gate.set(i, 3 * rng.normal());
  // The layer's input as the reference sees it: x, or silu(gate) * x rounded to the dtype (the
  // kernel rounds its float32 SwiGLU, relative error ~1e-6, once). Where that rounding is within
  // 1e-5 of a midpoint (`near_tie`) the kernel may hold the other neighbour.
  std::vector<double> input = x.values;
  std::vector<bool> near_tie(input.size(), false);
  Tensor hidden(c.dtype, gate.values.size()), below(hidden), above(hidden);
  for (size_t i = 0; i < gate.values.size(); ++i) {
    const double h = gate.values[i] / (1.0 + std::exp(-gate.values[i])) * x.values[i];
    hidden.set(i, h);
    below.set(i, h * (1 - 1e-5));
    above.set(i, h * (1 + 1e-5));
    input[i] = hidden.values[i];
    near_tie[i] = c.dtype != ElementType::float32 && below.values[i] != above.values[i];
  }
  for (int n = 0; n < N; ++n) bias.set(n, rng.normal());
  // The weights as the reference sees them, and their storage.
  std::vector<double> w(size_t(N) * K);
  // scale * code: what the int8 path multiplies the rounded x by (the biases meet x unrounded).
  std::vector<double> scaled_codes(c.bits ? w.size() : 0);
  Tensor dense(c.dtype, c.bits ? 0 : size_t(N) * K);
  const int groups = c.bits ? K / c.group_size : 0;
  Tensor scales(c.dtype, size_t(N) * groups), biases(c.dtype, size_t(N) * groups);
  std::vector<uint32_t> codes(c.bits ? size_t(N) * K * c.bits / 32 : 0);
  if (c.bits == 0) {
    for (size_t i = 0; i < w.size(); ++i) dense.set(i, rng.normal() / std::sqrt(double(K)));
    w = dense.values;
  } else {
    const uint32_t top = (1u << c.bits) - 1, per_word = 32 / c.bits;
    for (int n = 0; n < N; ++n) {
      for (int g = 0; g < groups; ++g) {
        const size_t at = size_t(n) * groups + g;
        scales.set(at, (0.5 + rng.uniform()) / (top * std::sqrt(double(K))));
        biases.set(at, -0.5 * top * scales.values[at] + 0.1 * rng.normal() / std::sqrt(double(K)));
        if (c.nan_last_row && n == N - 1) {
          scales.set(at, std::nan(""));
          biases.set(at, std::nan(""));
        }
        for (int k = g * c.group_size; k < (g + 1) * c.group_size; ++k) {
          const uint32_t code = static_cast<uint32_t>(rng() % (top + 1));
          codes[(size_t(n) * K + k) / per_word] |= code << (c.bits * (k % per_word));
          w[size_t(n) * K + k] = scales.values[at] * code + biases.values[at];
          scaled_codes[size_t(n) * K + k] = scales.values[at] * code;
        }
      }
    }
  }
  LinearProblem p{};
  p.rows = M;
  p.outputs = N;
  p.inputs = K;
  p.dtype = c.dtype;
  p.bits = c.bits;
  p.group_size = c.group_size;
  p.x = x.bytes.data();
  p.x_row_stride = stride;
  p.gate = c.gated ? gate.bytes.data() : nullptr;
  p.gate_row_stride = stride;
  p.weight = c.bits ? static_cast<const void*>(codes.data()) : dense.bytes.data();
  p.scales = scales.bytes.data();
  p.biases = biases.bytes.data();
  p.bias = c.bias ? bias.bytes.data() : nullptr;
  p.out = out.bytes.data();
  // The output is rounded to the dtype once: allow that rounding plus float32 accumulation.
  const double rounding = c.dtype == ElementType::float32 ? 0x1p-23
                          : c.dtype == ElementType::float16 ? 0x1p-10
                                                            : 0x1p-7;
  for (size_t n = 0; n < paths.size(); ++n) {
    // x86's vector paths take 4-bit codes against x rounded to int8 for half-precision x: a
    // scale (max |x| / 127, in float) per group or per 64 values where a group is longer, over
    // the part of K their blocks cover (one vector of words: 8 codes a lane). The reference
    // rounds x the same way for those codes.
    const bool int8_x = c.bits == 4 && c.dtype != ElementType::float32 &&
                        (paths[n] == CpuPath::avx2 || paths[n] == CpuPath::avx512);
    const int block = 8 * (paths[n] == CpuPath::avx512 ? 16 : 8);
    const int rounded = int8_x ? K / block * block : 0;
    std::fill(out.bytes.begin(), out.bytes.end(), uint8_t{0xff});  // NaN in every dtype
    linear_cpu(p, paths[n]);
    bool ok = true;
    for (int m = 0; m < M && ok; ++m) {
      const double* xm = &input[size_t(m) * stride];
      std::vector<double> xr(xm, xm + K);  // x as the kernel multiplies the codes by
      // Near an int8 rounding's midpoint, or near a tie of the dtype's rounding, a gated input
      // may round to either int8 neighbour.
      std::vector<double> either(K, 0.0);
      const int unit = std::min(c.group_size, 64);
      for (int k = 0; k < rounded; k += unit) {
        float top = 0.0f;
        for (int i = k; i < k + unit; ++i) top = std::max(top, std::abs(float(xm[i])));
        const float d = top > 0.0f ? top / 127.0f : 1.0f;
        for (int i = k; i < k + unit; ++i) {
          const double q = xm[i] / d;
          xr[i] = double(std::rint(float(xm[i]) / d)) * d;
          const bool tie = near_tie[size_t(m) * stride + i];
          if (c.gated && (tie || std::abs(std::abs(q - std::floor(q)) - 0.5) < 1e-4)) either[i] = d;
        }
      }
      for (int o = 0; o < N && ok; ++o) {
        double ref = c.bias ? bias.values[o] : 0.0, magnitude = std::abs(ref), slack = 0.0;
        for (int k = 0; k < K; ++k) {
          // w x, plus (for rounded x) the codes' share of the rounding: the biases meet the
          // group sums of x unrounded.
          double term = xm[k] * w[size_t(o) * K + k];
          if (k < rounded) term += (xr[k] - xm[k]) * scaled_codes[size_t(o) * K + k];
          ref += term;
          magnitude += std::abs(term);
          if (k < rounded) slack += either[k] * std::abs(scaled_codes[size_t(o) * K + k]);
        }
        const double got = out.get_output(size_t(m) * N + o);
        // A gated input's near ties: one unit in its last place either way.
        const double stored = c.gated ? rounding * magnitude : 0.0;
        const double tol = rounding * std::abs(ref) + 1e-5 * magnitude + slack + stored + 1e-30;
        if (std::isnan(ref) ? !std::isnan(got) : !(std::abs(got - ref) <= tol)) {
          if (failed[n] == 0) {
            std::printf("FAIL %s %s M=%d N=%d K=%d bits=%d group=%d bias=%d stride+%d gated=%d "
                        "seed=%u: out[%d][%d] = %.8g, expected %.8g (tolerance %.3g)\n",
                        cpu_path_name(paths[n]), dtype_name(c.dtype), M, N, K, c.bits,
                        c.group_size, int(c.bias), c.x_stride_extra, int(c.gated), seed, m, o,
                        got, ref, tol);
          }
          ok = false;
        }
      }
    }
    failed[n] += ok ? 0 : 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) return 2;
  const std::vector<CpuPath>& paths = options.paths;
  const uint32_t seeds = options.seeds;

  std::vector<Case> cases;
  const ElementType dtypes[] = {ElementType::float32, ElementType::float16, ElementType::bfloat16};
  for (ElementType t : dtypes) {
    // Dense: K around the vector steps (8 to 32 values), N around the row tiles, every row loop.
    for (int M : {1, 2, 3, 4, 5, 8, 11}) {
      for (int K : {1, 31, 32, 33, 100, 256}) cases.push_back({t, M, 13, K});
    }
    cases.push_back({t, 2, 37, 64, 0, 64, false, 5});      // no bias, strided rows of x
    cases.push_back({t, 1, 1024, 2048, 0, 64, true});      // split over the pool's threads
    cases.push_back({t, 3, 2051, 1000, 0, 64, true, 3});  // an odd split, strided
    cases.push_back({t, 8, 37, 1024});  // prepared rows padded off a multiple of 4 KB
    for (int M : {1, 3, 8}) cases.push_back({t, M, 13, 100, 0, 64, true, 0, true});  // SwiGLU
    // Quantized: every bit width and group size, K a few groups (blocks of 16 to 128 values whole
    // and cut), N around the tiles.
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) {
        for (int M : {1, 2, 3, 5, 9}) {
          for (int groups : {1, 3, 4}) cases.push_back({t, M, 7, groups * group, bits, group});
        }
        cases.push_back({t, 2, 33, 4 * group, bits, group, false, 7});
      }
      cases.push_back({t, 1, 1024, 2560, bits, 64});  // Qwen3-4B's width, split over threads
      cases.push_back({t, 4, 515, 1024, bits, 32});
      cases.push_back({t, 5, 21, 384, bits, 128, true, 9, true});  // SwiGLU, strided
      // A row's last groups short of a vector of scales are read with the next row's first and
      // masked: a NaN there must stay out of the rows before it.
      for (int groups : {3, 9, 20}) {
        Case poisoned{t, 2, 6, groups * 128, bits, 128};
        poisoned.nan_last_row = true;
        cases.push_back(poisoned);
      }
    }
  }

  std::vector<int> failed(paths.size());
  for (size_t n = 0; n < cases.size(); ++n) {
    setenv("ATTN_KERNELS_CALL_THREADS", n % 2 == 0 ? "" : "2", 1);  // all threads, or 2
    cpu_path_from_env();  // applies it, as an op's evaluation does
    for (uint32_t seed = 1; seed <= seeds; ++seed) {
      run_case(cases[n], paths, seed + 7 * uint32_t(n), failed);
    }
  }
  return report(options, failed, cases.size() * seeds, "linear cases ");
}
