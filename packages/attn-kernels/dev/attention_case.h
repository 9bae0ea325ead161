// The dev drivers' problem: one decode call, contiguous K/V, by default Qwen3-4B's shapes (bf16,
// Hq=32, Hkv=8, D=128, L=1). Inputs are normal values near 1 (random bit patterns would include
// denormals, 3-5x slower).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_problem.h"

namespace attn_kernels::dev {

struct Shape {
  int hq = 32, hkv = 8, head_dim = 128;
  ElementType dtype = ElementType::bfloat16;  // float32 or bfloat16
  int query_len = 1;                          // causal when above 1
};

struct Case {
  size_t n;  // elements of K (and of V) in one set
  size_t element;  // bytes per element
  std::vector<uint8_t> q, kv, out;  // kv: `sets` of (K, V)
  DecodeProblem p{};

  Case(int S, int sets, Shape s = {})
      : n(size_t(s.hkv) * S * s.head_dim),
        element(s.dtype == ElementType::float32 ? 4 : 2),
        q(size_t(s.hq) * s.query_len * s.head_dim * element),
        kv(2 * n * sets * element),
        out(q.size()) {
    fill(q.data(), q.size() / element, 40503u, 8);
    fill(kv.data(), kv.size() / element, 2654435761u, 24);
    static_cast<AttentionGeometry&>(p) = make_geometry(1, s.hq, s.hkv, s.query_len, S, s.head_dim,
                                                       0.088f, s.query_len > 1, nullptr);
    p.queries = q.data();
    p.out = out.data();
    p.dtype = s.dtype;
    const int64_t ks[4] = {int64_t{s.hkv} * S * s.head_dim, int64_t{S} * s.head_dim, s.head_dim, 1};
    std::copy(ks, ks + 4, p.k_strides);
    std::copy(ks, ks + 4, p.v_strides);
    use_set(0);
  }

  // Values in [0.5, 2): a bfloat16 pattern from a multiplicative hash of the index (exact in
  // float32 too).
  void fill(uint8_t* dst, size_t count, uint32_t multiplier, int shift) const {
    for (size_t i = 0; i < count; ++i) {
      const uint32_t bits = (0x3f80u + (((uint32_t(i) * multiplier) >> shift) & 255u) - 128u) << 16;
      if (element == 4) {
        std::memcpy(dst + 4 * i, &bits, 4);
      } else {
        const uint16_t high = static_cast<uint16_t>(bits >> 16);
        std::memcpy(dst + 2 * i, &high, 2);
      }
    }
  }

  // Bytes of K and V in one set, without building a case.
  static double set_bytes(int S, Shape s = {}) {
    return 2.0 * s.hkv * S * s.head_dim * (s.dtype == ElementType::float32 ? 4 : 2);
  }

  void use_set(int s) {
    p.keys = kv.data() + 2 * n * s * element;
    p.values = kv.data() + (2 * n * s + n) * element;
  }
  double kv_bytes() const { return 2.0 * n * element; }
};

}  // namespace attn_kernels::dev
