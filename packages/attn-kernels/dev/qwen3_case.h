// The dev drivers' problem: Qwen3-4B decode shapes (bf16, Hq=32, Hkv=8, D=128, L=1), contiguous
// K/V. Inputs are normal bf16 values near 1 (random bit patterns would include denormals, 3-5x
// slower).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decode_problem.h"

namespace attn_kernels::dev {

constexpr int kHq = 32, kHkv = 8, kD = 128;

struct Qwen3Case {
  size_t n;  // elements of K (and of V) in one set
  std::vector<uint16_t> q, kv, out;  // kv: `sets` of (K, V)
  DecodeProblem p{};

  Qwen3Case(int S, int sets) : n(size_t{kHkv} * S * kD), q(kHq * kD), kv(2 * n * sets), out(kHq * kD) {
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0x3f80 + ((uint32_t(i) * 40503u) >> 8) % 256 - 128;
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = 0x3f80 + ((uint32_t(i) * 2654435761u) >> 24) - 128;
    static_cast<AttentionGeometry&>(p) =
        make_geometry(1, kHq, kHkv, 1, S, kD, 0.088f, false, nullptr);
    p.queries = q.data();
    p.out = out.data();
    p.dtype = ElementType::bfloat16;
    const int64_t ks[4] = {int64_t{kHkv} * S * kD, int64_t{S} * kD, kD, 1};
    std::copy(ks, ks + 4, p.k_strides);
    std::copy(ks, ks + 4, p.v_strides);
    use_set(0);
  }

  void use_set(int s) {
    p.keys = kv.data() + 2 * n * s;
    p.values = kv.data() + 2 * n * s + n;
  }
  double kv_bytes() const { return 4.0 * n; }
};

}  // namespace attn_kernels::dev
