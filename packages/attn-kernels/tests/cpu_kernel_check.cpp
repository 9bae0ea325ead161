// The CPU kernel without MLX or Python, against a float64 reference: every path this CPU runs
// (or those named on the command line), the CPU test grid (dtypes, L, GQA, contexts around the
// block and vector sizes, no/causal/explicit/boolean masks), odd head dims, strided K/V, a
// context long enough to be split over threads, and the non-finite cases (NaN or inf in q, k,
// v, scale or mask), with the pool's workers sleeping at once and polling between calls in
// turn, on a pool of 4 threads (ATTN_KERNELS_NUM_THREADS, unless set) whose calls take all, 3 or
// 2 of them with 1 to 8 units per thread in turn (the split's sweep knobs); and the scalar half
// conversions against _Float16. Exit status 0 when every case passes. This is how arm64 (NEON)
// is checked in CI: `make test-arm64` cross-compiles it and runs it under qemu-user (one seed:
// emulated, the float64 reference dominates). Usage: cpu_kernel_check [--seeds N] [PATH...].
// Natively:
//
//   make test-cpu-kernel (this machine) or make test-arm64 (NEON under qemu); the Makefile has the
//   compiler commands, each cpu_kernel_<path>.cpp with its target flags as in CMakeLists.txt.
//
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "cpu_check.h"
#include "cpu_kernel.h"

using namespace attn_kernels;
using namespace attn_kernels::check;

namespace {

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

enum class Mask { none, causal, additive, boolean };
enum class Poison { none, q_nan, k_nan, v_nan, q_inf, mask_nan, scale_nan, all_masked };

struct Case {
  ElementType dtype;
  int batch, hq, hkv, L, S, D;
  Mask mask;
  bool kv_seq_major = false;  // K/V stored (B, S, H, D): rows strided by H * D
  Poison poison = Poison::none;
  float scale = 0.0f;  // 0: 1/sqrt(D)
};

const char* dtype_name(ElementType t) {
  return t == ElementType::float32 ? "f32" : t == ElementType::float16 ? "f16" : "bf16";
}
const char* mask_name(Mask m) {
  const char* names[] = {"none", "causal", "additive", "bool"};
  return names[static_cast<int>(m)];
}
const char* poison_name(Poison p) {
  const char* names[] = {"",         "q-nan",     "k-nan",     "v-nan",
                         "q-inf",    "mask-nan",  "scale-nan", "all-masked"};
  return names[static_cast<int>(p)];
}

// float64 reference of case c's shape: scores, softmax (max-subtracted, NaN-propagating),
// weighted values; a row whose every key is masked is zeros. key(b, h, s, d) and value(...) give
// the cache's values; q and mask_values are (B, Hq, L, D) and (B, Hq, L, S).
template <typename Case, typename Keys, typename Values>
std::vector<double> reference(const Case& c, float scale, const std::vector<double>& q, Keys key,
                              Values value, const std::vector<double>& mask_values) {
  const int B = c.batch, Hq = c.hq, L = c.L, S = c.S, D = c.D, group = c.hq / c.hkv;
  std::vector<double> want(size_t(B) * Hq * L * D), scores(S), acc(D);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int kh = h / group;
      for (int i = 0; i < L; ++i) {
        const size_t row = (size_t(b) * Hq + h) * L + i;
        double top = -kInf;
        bool nan = false;
        for (int s = 0; s < S; ++s) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += q[row * D + d] * key(b, kh, s, d);
          double x = dot * double(scale) + mask_values[row * S + s];
          if (c.mask == Mask::causal && s > S - L + i) x = -kInf;
          scores[s] = x;
          nan |= std::isnan(x);
          top = std::max(top, x);
        }
        for (double& a : acc) a = 0;
        if (nan) {
          for (double& a : acc) a = kNaN;
        } else if (top != -kInf) {
          double sum = 0;
          for (int s = 0; s < S; ++s) {
            const double w = std::exp(scores[s] - top);  // inf - inf: NaN, as the readable path
            if (w == 0.0) continue;  // a masked key: its value is never read
            sum += w;
            for (int d = 0; d < D; ++d) acc[d] += w * value(b, kh, s, d);
          }
          for (double& a : acc) a /= sum;
        }
        for (int d = 0; d < D; ++d) want[row * D + d] = acc[d];
      }
    }
  }
  return want;
}

// The kernel's output against the reference, within the dtype's tolerance (as
// tests/conftest.py's); prints the first mismatch.
bool matches(const Tensor& out, const std::vector<double>& want, ElementType dtype) {
  double atol = 2e-5, rtol = 2e-5;
  if (dtype == ElementType::float16) atol = 4e-3, rtol = 2e-3;
  if (dtype == ElementType::bfloat16) atol = 3e-2, rtol = 1.6e-2;
  for (size_t at = 0; at < want.size(); ++at) {
    const double got = out.get_output(at), w = want[at];
    const bool ok = std::isnan(w) ? std::isnan(got)
                    : std::isinf(w) ? got == w
                                    : std::fabs(got - w) <= atol + rtol * std::fabs(w);
    if (!ok) {
      std::printf("  FAIL out[%zu] = %g, want %g\n", at, got, w);
      return false;
    }
  }
  return true;
}

// Runs one case on every path; adds 1 to failed[n] when path n mismatches (printing the first).
void run_case(const Case& c, const std::vector<CpuPath>& paths, uint32_t seed,
              std::vector<int>& failed) {
  Random rng(seed);
  const int B = c.batch, Hq = c.hq, Hkv = c.hkv, L = c.L, S = c.S, D = c.D;
  const size_t nq = size_t(B) * Hq * L * D, nkv = size_t(B) * Hkv * S * D;
  const size_t nm = size_t(B) * Hq * L * S;
  Tensor q(c.dtype, nq), k(c.dtype, nkv), v(c.dtype, nkv), out(c.dtype, nq);
  for (size_t i = 0; i < nq; ++i) q.set(i, rng.normal());
  for (size_t i = 0; i < nkv; ++i) k.set(i, rng.normal());
  for (size_t i = 0; i < nkv; ++i) v.set(i, rng.normal());
  std::vector<float> additive;
  std::vector<uint8_t> keep;  // bool mask bytes
  std::vector<double> mask_values(nm, 0.0);
  if (c.mask == Mask::additive) {
    additive.resize(nm);
    for (size_t i = 0; i < nm; ++i) {
      additive[i] = rng() % 5 == 0 ? -INFINITY : float(rng.normal());
      mask_values[i] = additive[i];
    }
  } else if (c.mask == Mask::boolean) {
    keep.resize(nm);
    for (size_t i = 0; i < nm; ++i) {
      keep[i] = rng() % 4 != 0;
      mask_values[i] = keep[i] ? 0.0 : -kInf;
    }
  }
  // K/V element (b, h, s, d) at offset kv_at: (B, H, S, D) or (B, S, H, D).
  auto kv_at = [&](int b, int h, int s, int d) -> size_t {
    return c.kv_seq_major ? ((size_t(b) * S + s) * Hkv + h) * D + d
                          : ((size_t(b) * Hkv + h) * S + s) * D + d;
  };
  auto q_at = [&](int b, int h, int i, int d) { return ((size_t(b) * Hq + h) * L + i) * D + d; };
  auto m_at = [&](int b, int h, int i, int s) { return ((size_t(b) * Hq + h) * L + i) * S + s; };
  float scale = c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(float(D));
  switch (c.poison) {
    case Poison::q_nan: q.set(q_at(0, 1 % Hq, L - 1, D / 2), kNaN); break;
    case Poison::q_inf: q.set(q_at(0, 0, 0, 0), kInf); break;
    case Poison::k_nan: k.set(kv_at(0, 0, S / 2, 0), kNaN); break;
    case Poison::v_nan: v.set(kv_at(0, 0, S / 2, D - 1), kNaN); break;  // visible to every row
    case Poison::mask_nan:
      additive[m_at(0, 0, 0, S / 3)] = NAN;
      mask_values[m_at(0, 0, 0, S / 3)] = kNaN;
      break;
    case Poison::scale_nan: scale = NAN; break;
    case Poison::all_masked:
      for (int s = 0; s < S; ++s) {
        additive[m_at(0, Hq - 1, L - 1, s)] = -INFINITY;
        mask_values[m_at(0, Hq - 1, L - 1, s)] = -kInf;
      }
      break;
    case Poison::none: break;
  }

  DecodeProblem p{};
  static_cast<AttentionGeometry&>(p) =
      make_geometry(B, Hq, Hkv, L, S, D, scale, c.mask == Mask::causal, nullptr);
  p.queries = q.bytes.data();
  p.keys = k.bytes.data();
  p.values = v.bytes.data();
  p.out = out.bytes.data();
  p.dtype = c.dtype;
  if (c.kv_seq_major) {
    const int64_t s[4] = {int64_t(S) * Hkv * D, D, int64_t(Hkv) * D, 1};
    std::memcpy(p.k_strides, s, sizeof s);
  } else {
    const int64_t s[4] = {int64_t(Hkv) * S * D, int64_t(S) * D, D, 1};
    std::memcpy(p.k_strides, s, sizeof s);
  }
  std::memcpy(p.v_strides, p.k_strides, sizeof p.k_strides);
  if (c.mask == Mask::additive || c.mask == Mask::boolean) {
    p.mask = c.mask == Mask::additive ? static_cast<const void*>(additive.data()) : keep.data();
    p.mask_kind = c.mask == Mask::additive ? kMaskFloat32 : kMaskBool;
    const int64_t ms[4] = {int64_t(Hq) * L * S, int64_t(L) * S, S, 1};
    std::memcpy(p.m_strides, ms, sizeof ms);
  }
  std::vector<double> want = reference(
      c, scale, q.values, [&](int b, int h, int s, int d) { return k.values[kv_at(b, h, s, d)]; },
      [&](int b, int h, int s, int d) { return v.values[kv_at(b, h, s, d)]; }, mask_values);
  for (size_t n = 0; n < paths.size(); ++n) {
    std::fill(out.bytes.begin(), out.bytes.end(), 0xff);  // NaN: every output must be written
    decode_attention_cpu(p, paths[n]);
    if (!matches(out, want, c.dtype)) {
      std::printf("    in %s %s B=%d Hq=%d Hkv=%d L=%d S=%d D=%d mask=%s%s %s seed %u\n",
                  cpu_path_name(paths[n]), dtype_name(c.dtype), B, Hq, Hkv, L, S, D,
                  mask_name(c.mask), c.kv_seq_major ? " seq-major" : "", poison_name(c.poison),
                  seed);
      ++failed[n];
    }
  }
}

// A quantized cache (mx.quantize triples: value = scale * code + bias per group of the head
// dimension), random codes and per-group scales and biases in the queries' dtype; the reference
// reads the values they stand for.
struct QuantizedCase {
  ElementType dtype;
  int batch, hq, hkv, L, S, D, bits, group_size;
  Mask mask;
  Poison poison = Poison::none;  // none or q_nan
};

void run_quantized_case(const QuantizedCase& c, const std::vector<CpuPath>& paths, uint32_t seed,
                        std::vector<int>& failed) {
  Random rng(seed);
  const int B = c.batch, Hq = c.hq, Hkv = c.hkv, L = c.L, S = c.S, D = c.D;
  const int words = D * c.bits / 32, groups = D / c.group_size, top_code = (1 << c.bits) - 1;
  const size_t nq = size_t(B) * Hq * L * D, rows = size_t(B) * Hkv * S;
  Tensor q(c.dtype, nq), out(c.dtype, nq);
  for (size_t i = 0; i < nq; ++i) q.set(i, rng.normal());
  if (c.poison == Poison::q_nan) q.set(nq / 2, kNaN);
  struct Cache {
    std::vector<uint32_t> codes;
    Tensor scales, biases;
    std::vector<double> values;  // (B, Hkv, S, D)
  };
  auto make_cache = [&]() {
    Cache k{std::vector<uint32_t>(rows * words), Tensor(c.dtype, rows * groups),
            Tensor(c.dtype, rows * groups), std::vector<double>(rows * D)};
    for (size_t r = 0; r < rows; ++r) {
      for (int g = 0; g < groups; ++g) {  // values over about [-2, 2]
        k.scales.set(r * groups + g, (3.0 + rng.uniform()) / top_code);
        k.biases.set(r * groups + g, -2.0 + 0.5 * rng.normal());
      }
      for (int d = 0; d < D; ++d) {
        const uint32_t code = rng() % (top_code + 1);
        k.codes[r * words + d * c.bits / 32] |= code << (d * c.bits % 32);
        const size_t g = r * groups + d / c.group_size;
        k.values[r * D + d] = k.scales.values[g] * code + k.biases.values[g];
      }
    }
    return k;
  };
  const Cache k = make_cache(), v = make_cache();
  std::vector<float> additive;
  std::vector<double> mask_values(nq / D * S, 0.0);
  if (c.mask == Mask::additive) {
    additive.resize(mask_values.size());
    for (size_t i = 0; i < additive.size(); ++i) {
      additive[i] = rng() % 5 == 0 ? -INFINITY : float(rng.normal());
      mask_values[i] = additive[i];
    }
  }
  const float scale = 1.0f / std::sqrt(float(D));
  QuantizedProblem p{};
  static_cast<AttentionGeometry&>(p) =
      make_geometry(B, Hq, Hkv, L, S, D, scale, c.mask == Mask::causal, nullptr);
  p.queries = q.bytes.data();
  p.k_codes = k.codes.data();
  p.k_scales = k.scales.bytes.data();
  p.k_biases = k.biases.bytes.data();
  p.v_codes = v.codes.data();
  p.v_scales = v.scales.bytes.data();
  p.v_biases = v.biases.bytes.data();
  p.out = out.bytes.data();
  p.dtype = c.dtype;
  p.bits = c.bits;
  p.group_size = c.group_size;
  const int64_t code_strides[4] = {int64_t(Hkv) * S * words, int64_t(S) * words, words, 1};
  const int64_t group_strides[4] = {int64_t(Hkv) * S * groups, int64_t(S) * groups, groups, 1};
  for (auto* strides : {&p.k_strides, &p.v_strides}) {
    std::memcpy((*strides)[0], code_strides, sizeof code_strides);
    std::memcpy((*strides)[1], group_strides, sizeof group_strides);
    std::memcpy((*strides)[2], group_strides, sizeof group_strides);
  }
  if (c.mask == Mask::additive) {
    p.mask = additive.data();
    p.mask_kind = kMaskFloat32;
    const int64_t ms[4] = {int64_t(Hq) * L * S, int64_t(L) * S, S, 1};
    std::memcpy(p.m_strides, ms, sizeof ms);
  }
  auto at = [&](int b, int h, int s, int d) { return ((size_t(b) * Hkv + h) * S + s) * D + d; };
  const std::vector<double> want = reference(
      c, scale, q.values, [&](int b, int h, int s, int d) { return k.values[at(b, h, s, d)]; },
      [&](int b, int h, int s, int d) { return v.values[at(b, h, s, d)]; }, mask_values);
  for (size_t n = 0; n < paths.size(); ++n) {
    std::fill(out.bytes.begin(), out.bytes.end(), 0xff);  // NaN: every output must be written
    decode_attention_quantized_cpu(p, paths[n]);
    if (!matches(out, want, c.dtype)) {
      std::printf("    in %s quantized %s %d-bit group %d B=%d Hq=%d Hkv=%d L=%d S=%d D=%d "
                  "mask=%s %s seed %u\n",
                  cpu_path_name(paths[n]), dtype_name(c.dtype), c.bits, c.group_size, B, Hq,
                  Hkv, L, S, D, mask_name(c.mask), poison_name(c.poison), seed);
      ++failed[n];
    }
  }
}

// cpu_scalar.h's half conversions (by hand in this file's generic x86-64 build, F16C's in the
// kernels') against the compiler's _Float16, which rounds in libgcc: every half, and every 251st
// float bit pattern (NaN: any NaN of the same sign). 0 when they agree.
int check_half_conversions() {
#if defined(__FLT16_MANT_DIG__) && !defined(__aarch64__)
  int bad = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float ours = cpu::to_float(cpu::Float16{static_cast<uint16_t>(bits)});
    const float ref = static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(bits)));
    if (ref == ref ? std::memcmp(&ours, &ref, 4) != 0 : ours == ours) ++bad;
  }
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 251) {
    const float x = __builtin_bit_cast(float, static_cast<uint32_t>(i));
    cpu::Float16 ours;
    cpu::store(&ours, x);
    const uint16_t ref = __builtin_bit_cast(uint16_t, static_cast<_Float16>(x));
    const bool nan = (ours.bits & 0x7c00) == 0x7c00 && (ours.bits & 0x3ff) != 0;
    if (x == x ? ours.bits != ref : !nan || (ours.bits ^ ref) & 0x8000) ++bad;
  }
  if (bad > 0) std::printf("half conversions: %d mismatches against _Float16\n", bad);
  return bad;
#else
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) return 2;
  const std::vector<CpuPath>& paths = options.paths;
  const uint32_t seeds = options.seeds;

  std::vector<Case> cases;
  const ElementType dtypes[] = {ElementType::float32, ElementType::float16, ElementType::bfloat16};
  const int heads[][2] = {{4, 4}, {8, 2}, {32, 8}};
  // The Python test grid (tests/test_decode_attention.py GRID), D = 128.
  for (ElementType t : dtypes) {
    for (int L : {1, 8}) {
      for (const auto& hh : heads) {
        for (int S : {1, 31, 32, 127, 128, 129, 255, 256}) {
          for (Mask m : {Mask::none, Mask::causal, Mask::additive}) {
            if (S >= L) cases.push_back({t, hh[0] == 4 ? 2 : 1, hh[0], hh[1], L, S, 128, m});
          }
        }
      }
    }
    // Odd head dims (scratch path; a half-full last pair read in place: 16 and 80 on AVX-512,
    // 40, 72 and 200 on AVX2, 20 on NEON), boolean masks, strided rows, split contexts.
    for (int D : {1, 16, 20, 40, 72, 200, 256}) {
      cases.push_back({t, 1, 6, 3, 3, 77, D, Mask::causal});
    }
    // The coverage sweep's other head dims (bench-coverage), without GQA and with groups of 8.
    for (int D : {80, 96}) {
      cases.push_back({t, 1, 4, 4, 1, 333, D, Mask::none});
      cases.push_back({t, 1, 16, 2, 8, 333, D, Mask::causal});
    }
    cases.push_back({t, 1, 8, 2, 2, 300, 64, Mask::boolean});
    cases.push_back({t, 2, 8, 2, 2, 45, 48, Mask::causal, true});
    cases.push_back({t, 1, 8, 2, 2, 300, 128, Mask::additive, true});
    cases.push_back({t, 1, 32, 8, 1, 2100, 128, Mask::none});  // split in context chunks
    cases.push_back({t, 1, 32, 8, 8, 600, 128, Mask::causal});
    cases.push_back({t, 1, 10, 2, 3, 1500, 64, Mask::additive});  // 15 vectors: partial tiles
  }
  // Non-finite inputs, on a split context and a short one.
  for (ElementType t : dtypes) {
    for (Poison poison : {Poison::q_nan, Poison::k_nan, Poison::v_nan, Poison::q_inf,
                          Poison::mask_nan, Poison::scale_nan, Poison::all_masked}) {
      const bool masked = poison == Poison::mask_nan || poison == Poison::all_masked;
      const Mask m = masked ? Mask::additive : Mask::causal;
      cases.push_back({t, 1, 8, 2, 2, 100, 64, m, false, poison});
      cases.push_back({t, 1, 32, 8, 1, 2100, 128, masked ? m : Mask::none, false, poison});
    }
  }

  // Quantized caches: every dtype, bit width and group size, GQA and none, L 1 and 8, partial
  // blocks, a context split over threads, head dims 64-256, a NaN query.
  std::vector<QuantizedCase> quantized;
  for (ElementType t : dtypes) {
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) {
        quantized.push_back({t, 2, 8, 2, 1, 77, 128, bits, group, Mask::none});
        quantized.push_back({t, 1, 4, 4, 8, 45, 128, bits, group, Mask::causal});
      }
      quantized.push_back({t, 1, 32, 8, 1, 2100, 128, bits, 64, Mask::none});
      quantized.push_back({t, 1, 16, 2, 8, 300, 64, bits, 32, Mask::causal});
      quantized.push_back({t, 1, 8, 4, 2, 130, 256, bits, 64, Mask::additive});
      quantized.push_back({t, 1, 6, 3, 3, 50, 96, bits, 32, Mask::causal, Poison::q_nan});
    }
  }

  std::vector<int> failed(paths.size());
  for (size_t n = 0; n < cases.size() + quantized.size(); ++n) {
    // The pool's workers sleep at once after one case and poll for the next after another, so
    // split contexts run through both hand-offs (woken from the futex, and found polling).
    setenv("ATTN_KERNELS_POOL_SPIN_US", n % 2 == 0 ? "0" : "200", 1);
    // All, 3 or 2 of the pool's threads per call, and 8 (the default), 1 or 3 units per thread.
    const char* threads[] = {"", "3", "2"};
    const char* units[] = {"", "1", "3"};
    setenv("ATTN_KERNELS_CALL_THREADS", threads[n % 3], 1);
    setenv("ATTN_KERNELS_CPU_UNITS_PER_THREAD", units[n / 3 % 3], 1);
    cpu_path_from_env();  // applies these, as an op's evaluation does
    for (uint32_t seed = 1; seed <= seeds; ++seed) {
      if (n < cases.size()) {
        run_case(cases[n], paths, seed + 7 * uint32_t(n), failed);
      } else {
        run_quantized_case(quantized[n - cases.size()], paths, seed + 7 * uint32_t(n), failed);
      }
    }
  }
  const int half_mismatches = check_half_conversions();
  const int status = report(options, failed, (cases.size() + quantized.size()) * seeds, "");
  return half_mismatches > 0 ? 1 : status;
}
