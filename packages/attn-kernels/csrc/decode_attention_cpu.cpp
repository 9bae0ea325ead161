// The CPU kernel: per key/value head, all of its query rows walk the cache once with a running
// max, denominator and float32 accumulator (online softmax). K and V rows are converted to float
// once per position and shared by every query row of the group, so each byte is read once.
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ATTN_AVX512_BF16 1
#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw"), noinline))
#endif

// Wider vectors where the running CPU has them: GCC/Clang build one clone per target and pick
// at load time (ifunc), so the wheel still runs on any x86-64.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define MULTIVERSIONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTIVERSIONED
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace attn_kernels {
namespace {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

ALWAYS_INLINE float to_float(float x) {
  return x;
}
ALWAYS_INLINE float to_float(BFloat16 x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16);
}
ALWAYS_INLINE float to_float(Float16 x) {
#if defined(__FLT16_MANT_DIG__)
  return static_cast<float>(std::bit_cast<_Float16>(x.bits));
#else
  // IEEE half -> float by hand (no native _Float16 on this compiler).
  const uint32_t sign = (x.bits & 0x8000u) << 16, exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ff;
  if (exp == 0x1f) {
    return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  }
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

ALWAYS_INLINE void store(float* dst, float x) {
  *dst = x;
}
ALWAYS_INLINE void store(BFloat16* dst, float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) {
    dst->bits = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  dst->bits = static_cast<uint16_t>(u >> 16);
}
ALWAYS_INLINE void store(Float16* dst, float x) {
#if defined(__FLT16_MANT_DIG__)
  dst->bits = std::bit_cast<uint16_t>(static_cast<_Float16>(x));
#else
  // Round-to-nearest-even float -> half by hand.
  const uint32_t u = std::bit_cast<uint32_t>(x), sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    dst->bits = static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    return;
  }
  if (abs >= 0x477ff000u) {
    dst->bits = static_cast<uint16_t>(sign | 0x7c00u);
    return;
  }
  if (abs < 0x38800000u) {
    const float v = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24: subnormal units
    dst->bits = static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v)));
    return;
  }
  uint32_t h = abs - 0x38000000u;
  h += 0xfffu + ((h >> 13) & 1u);
  dst->bits = static_cast<uint16_t>(sign | (h >> 13));
#endif
}

template <typename T>
ALWAYS_INLINE void load_row(float* dst, const T* src, int n, int64_t stride) {
  if (stride == 1) {
    for (int i = 0; i < n; ++i) {
      dst[i] = to_float(src[i]);
    }
  } else {
    for (int i = 0; i < n; ++i) {
      dst[i] = to_float(src[i * stride]);
    }
  }
}

// Vectors are processed in groups of kLanes floats; rows are padded to a multiple of kLanes with
// zeros so every inner loop has a fixed trip count the compiler turns into vector code.
constexpr int kLanes = 16;
// Positions per online-softmax step: one block max, one rescale of the accumulators.
constexpr int kBlock = 16;

ALWAYS_INLINE int padded(int d) {
  return (d + kLanes - 1) / kLanes * kLanes;
}

// kLanes floats as one value: GCC/Clang lower it to a zmm register, two ymm or four xmm ones
// depending on the clone's target, and keep Tile of them in registers.
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
using UnalignedLanes = float __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

ALWAYS_INLINE Lanes load_lanes(const float* p) {
  return *reinterpret_cast<const UnalignedLanes*>(p);
}
ALWAYS_INLINE void store_lanes(float* p, Lanes v) {
  *reinterpret_cast<UnalignedLanes*>(p) = v;
}
ALWAYS_INLINE Lanes to_lanes(const float* src) {
  return load_lanes(src);
}
ALWAYS_INLINE Lanes to_lanes(const BFloat16* src) {
  using Bits16 = uint16_t __attribute__((vector_size(kLanes * 2), aligned(2)));
  using Bits32 = uint32_t __attribute__((vector_size(kLanes * 4)));
  const Bits32 wide = __builtin_convertvector(*reinterpret_cast<const Bits16*>(src), Bits32) << 16;
  return (Lanes)wide;  // same-size vector cast: the bits as floats
}
ALWAYS_INLINE Lanes to_lanes(const Float16* src) {
#if defined(__FLT16_MANT_DIG__)
  using Halves = _Float16 __attribute__((vector_size(kLanes * 2), aligned(2)));
  return __builtin_convertvector(*reinterpret_cast<const Halves*>(src), Lanes);
#else
  Lanes out;
  for (int l = 0; l < kLanes; ++l) {
    out[l] = to_float(src[l]);
  }
  return out;
#endif
}

// A row of n elements as floats, zero-padded to n_padded: whole vectors when the row is
// contiguous and a multiple of kLanes long (the usual head dims), element by element otherwise.
template <typename T>
ALWAYS_INLINE void load_padded(float* dst, const T* src, int n, int n_padded, int64_t stride) {
  if (stride == 1 && n == n_padded) {
    for (int i = 0; i < n; i += kLanes) {
      store_lanes(dst + i, to_lanes(src + i));
    }
    return;
  }
  load_row(dst, src, n, stride);
  for (int i = n; i < n_padded; ++i) {
    dst[i] = 0.0f;
  }
}

// exp(x) for x <= 0 without a libm call, so a block of weights vectorises: 2^(x log2 e) split
// into an integer power (exponent bits) and a degree-6 polynomial on [-ln2/2, ln2/2]
// (relative error ~2e-7). Returns exactly 0 below -87 and for -inf.
// NaN in, NaN out (the clamp keeps the integer conversion below defined).
ALWAYS_INLINE float exp_nonpositive(float x) {
  const float clamped = x > -87.0f ? x : -87.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (clamped * 1.44269504f + kRound) - kRound;
  const float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : (x == x ? poly * scale : x);
}

// Horizontal max and sum of a block's kBlock == kLanes scores as a log-depth tree: written as
// scalar loops they were chains of 16 dependent operations per vector and block (GCC does not
// reassociate them).
// Maxima that keep NaN (std::max and x > y ? x : y drop it when it is the second argument): a
// NaN score must reach the output, as it does in the readable path's softmax.
ALWAYS_INLINE Lanes lanes_max2(Lanes x, Lanes y) {
  return (x > y) | (x != x) ? x : y;
}
ALWAYS_INLINE float max_nan(float x, float y) {
  return x > y || x != x ? x : y;
}
ALWAYS_INLINE float lanes_max(Lanes x) {
  static_assert(kLanes == 16, "the shuffles are written for 16 lanes");
  x = lanes_max2(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = lanes_max2(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = lanes_max2(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = lanes_max2(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
ALWAYS_INLINE float lanes_sum(Lanes x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// Online-softmax state of one query vector: running max, denominator, then padded(D)
// accumulators.
constexpr int kStateHeader = 2;

ALWAYS_INLINE int state_floats(int d) {
  return padded(d) + kStateHeader;
}

// Floats of scratch attend_chunk needs for `vectors` query vectors of head dimension d.
size_t scratch_floats(int vectors, int d) {
  return static_cast<size_t>(vectors) * padded(d) * 2 + 2 * kBlock * padded(d) +
      2 * static_cast<size_t>(vectors) * kBlock + vectors + 1;
}

// Where block_scores and block_accumulate read K/V rows: floats converted into scratch, or the cache itself
// (contiguous rows whose length is a multiple of kLanes), converted in registers.
struct ConvertedRows {
  const float* data;
  int row_stride;
  ALWAYS_INLINE Lanes at(int j, int d0) const {
    return load_lanes(data + j * row_stride + d0);
  }
};
template <typename T>
struct CacheRows {
  const T* data;
  int64_t row_stride;
  ALWAYS_INLINE Lanes at(int j, int d0) const {
    return to_lanes(data + j * row_stride + d0);
  }
};

// Sixteen partial-sum vectors in, one vector of their sixteen totals out (lane j = sum of
// partial[j]): four levels of pairwise folds, 15 shuffles-and-adds instead of 16 horizontal sums.
// Each fold halves every group of lanes and packs two inputs' groups into one output, order kept.
ALWAYS_INLINE Lanes fold_16(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
      __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
ALWAYS_INLINE Lanes fold_8(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
      __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
ALWAYS_INLINE Lanes fold_4(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
      __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
ALWAYS_INLINE Lanes fold_2(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
      __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
ALWAYS_INLINE Lanes transpose_sum(const Lanes (&partial)[kBlock]) {
  static_assert(kBlock == kLanes && kLanes == 16, "the folds are written for 16 lanes");
  Lanes a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold_16(partial[2 * i], partial[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold_8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold_4(b[2 * i], b[2 * i + 1]);
  return fold_2(c[0], c[1]);
}

// scores[r][j] = q_r . k_j for a block of kBlock keys: per query vector, kBlock partial-sum
// vectors stay in registers over the head dimension, then one transpose-sum.
template <typename Rows>
ALWAYS_INLINE void block_scores(const float* q, const Rows& keys, float* scores, int vectors, int Dp) {
  for (int r = 0; r < vectors; ++r) {
    Lanes partial[kBlock] = {};
    for (int d0 = 0; d0 < Dp; d0 += kLanes) {
      const Lanes qv = load_lanes(q + r * Dp + d0);
      for (int j = 0; j < kBlock; ++j) {
        partial[j] += qv * keys.at(j, d0);
      }
    }
    store_lanes(scores + r * kBlock, transpose_sum(partial));
  }
}

// Up to kTile query vectors at a time share each loaded slice of V.
constexpr int kTile = 4;

#if defined(ATTN_AVX512_BF16)
// The AVX-512 bf16 path: K and V rows are read straight from the cache and widened to float32 in
// registers (an unpack against zero puts each bf16 in the high half of a float), then FMAs.
// Measured on this project's CPU (AVX512-BF16): vdpbf16ps issues at a quarter of the FMA rate
// (1.3 vs 5.3 G instructions/s), and widening + FMA ran ~20% faster than it did (2 threads,
// S = 1024..16384, interleaved runs; see the closing note of issue 2). The unpacks order each
// 32-value chunk as lanes {8l..8l+3} (lo) and {8l+4..8l+7} (hi); queries are widened in the same
// order, accumulators are permuted to it on load and back on store. D % 32 == 0.
//
// K and V rows two blocks ahead are prefetched into L2, spread over the block's work: four K rows
// per four positions scored, and with every V line loaded the same line two blocks on.
// Without prefetch a call streaming from DRAM took the compute time *plus* the read time (one
// thread: 6.5 GB/s against ~13 hot and ~13 read). Spread over the block, cold two-thread calls at
// S=16384 took 4.8-6.1 ms against 6.3-7.3 without and 5.4-6.3 with each block prefetched whole at
// the start of its use; 1, 4 or 8 blocks ahead did no better than 2 (dev/bench_cpu.cpp, cold;
// issue 2's closing note).
constexpr int kPrefetchRows = 2 * kBlock;

// GCC 12 deleted loops of _mm_prefetch as dead code (the kernel shipped without a single
// prefetch instruction until this was found); a volatile asm statement is never deleted.
ALWAYS_INLINE void prefetch_to_l2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

// Rows [first, end) of `rows` (null: nothing), one prefetch per 64-byte line.
inline void prefetch_rows(const BFloat16* rows, int64_t stride, int D, int first, int end) {
  if (rows == nullptr) return;
  for (int j = first; j < end; ++j) {
    for (int d0 = 0; d0 < D; d0 += 32) {  // 32 bf16: one 64-byte line
      prefetch_to_l2(rows + j * stride + d0);
    }
  }
}

// The query vector q (D bf16 values) widened in the lo/hi order.
ATTN_AVX512 void widen_query(const BFloat16* q, float* dst, int D) {
  const __m512i zero = _mm512_setzero_si512();
  for (int d0 = 0; d0 < D; d0 += 32) {
    const __m512i v = _mm512_loadu_si512(q + d0);
    _mm512_storeu_ps(dst + d0, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)));
    _mm512_storeu_ps(dst + d0 + 16, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)));
  }
}

// The helpers below are inlined into the two block functions (same target). Their vector counts
// are template parameters: with a run-time count GCC kept the accumulators on the stack and
// tested the count inside the position loop (scalar index arithmetic and branches per FMA pair);
// compiled for exactly four or one, everything stays in registers.
#define ATTN_AVX512_INLINE __attribute__((target("avx512f,avx512bw"), always_inline)) inline

// Scores of R query vectors (from q) against four positions (from keys), scaled, into
// scores[r * kBlock + jj]: R x 4 partial vectors, then one transpose-sum.
template <int R>
ATTN_AVX512_INLINE void scores_tile_bf16(const float* q, const BFloat16* keys, int64_t key_stride,
                                         float* scores, int D, float scale) {
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int jj = 0; jj < 4; ++jj) acc[r][jj] = _mm512_setzero_ps();
  }
  for (int d0 = 0; d0 < D; d0 += 32) {
    __m512 lo[4], hi[4];
    for (int jj = 0; jj < 4; ++jj) {
      const __m512i k = _mm512_loadu_si512(keys + jj * key_stride + d0);
      lo[jj] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, k));
      hi[jj] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, k));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 q_lo = _mm512_loadu_ps(q + r * D + d0);
      const __m512 q_hi = _mm512_loadu_ps(q + r * D + d0 + 16);
      for (int jj = 0; jj < 4; ++jj) {
        acc[r][jj] = _mm512_fmadd_ps(q_lo, lo[jj], acc[r][jj]);
        acc[r][jj] = _mm512_fmadd_ps(q_hi, hi[jj], acc[r][jj]);
      }
    }
  }
  Lanes partial[kBlock] = {};
  for (int r = 0; r < R; ++r) {
    for (int jj = 0; jj < 4; ++jj) partial[r * 4 + jj] = (Lanes)acc[r][jj];
  }
  float total[kBlock];  // lane r * 4 + jj: vector r, position jj
  store_lanes(total, transpose_sum(partial) * scale);
  for (int r = 0; r < R; ++r) std::memcpy(scores + r * kBlock, total + r * 4, 4 * sizeof(float));
}

// scores[r][j] = scale * q_r . k_j for a full block; four query vectors x four positions share
// each widened K slice.
ATTN_AVX512 void block_scores_bf16(const float* q, const BFloat16* keys, int64_t key_stride,
                                   const BFloat16* prefetch, float* scores, int vectors, int D,
                                   float scale) {
  for (int j0 = 0; j0 < kBlock; j0 += 4) {
    prefetch_rows(prefetch, key_stride, D, j0, j0 + 4);
    const BFloat16* k = keys + j0 * key_stride;
    int r = 0;
    for (; r + 4 <= vectors; r += 4) {
      scores_tile_bf16<4>(q + r * D, k, key_stride, scores + r * kBlock + j0, D, scale);
    }
    for (; r < vectors; ++r) {
      scores_tile_bf16<1>(q + r * D, k, key_stride, scores + r * kBlock + j0, D, scale);
    }
  }
}

// acc_t = acc_t * rescale_t + sum_j weight[t][j] * v_j for Tile query vectors and a full block
// of V rows, one 32-dimension slice at a time. (Two slices at a time, 16 independent FMA chains
// instead of 8, measured the same: the loop is at ~70% of the FMA ports' rate, not latency-bound.)
// `prefetch`: the block ahead; each line is prefetched when the same line of this block is read
// (before, rows in four parts per slice, with two integer divisions per slice: cold, two threads,
// S = 16384, three rotated runs, 5.3-6.3 -> 4.6-5.2 ms; hot 0-5% faster, dev/ab_cpu.cpp).
template <int Tile>
ATTN_AVX512_INLINE void accumulate_tile_bf16(const float* weights, const float* rescale,
                                             const BFloat16* values, int64_t value_stride,
                                             const BFloat16* prefetch, float* state, int D,
                                             int state_size) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i back_a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back_b = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int d0 = 0; d0 < D; d0 += 32) {
    __m512 lo[Tile], hi[Tile];
    for (int t = 0; t < Tile; ++t) {
      float* acc = state + t * state_size + kStateHeader + d0;
      const __m512 f = _mm512_set1_ps(rescale[t]);
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc), f);
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(acc + 16), f);
      lo[t] = _mm512_permutex2var_ps(a, to_lo, b);
      hi[t] = _mm512_permutex2var_ps(a, to_hi, b);
    }
#pragma GCC unroll 16
    for (int j = 0; j < kBlock; ++j) {
      if (prefetch) prefetch_to_l2(prefetch + j * value_stride + d0);  // the same line, ahead
      const __m512i v = _mm512_loadu_si512(values + j * value_stride + d0);
      const __m512 v_lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
      const __m512 v_hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
      for (int t = 0; t < Tile; ++t) {
        const __m512 w = _mm512_set1_ps(weights[t * kBlock + j]);
        lo[t] = _mm512_fmadd_ps(w, v_lo, lo[t]);
        hi[t] = _mm512_fmadd_ps(w, v_hi, hi[t]);
      }
    }
    for (int t = 0; t < Tile; ++t) {
      float* acc = state + t * state_size + kStateHeader + d0;
      _mm512_storeu_ps(acc, _mm512_permutex2var_ps(lo[t], back_a, hi[t]));
      _mm512_storeu_ps(acc + 16, _mm512_permutex2var_ps(lo[t], back_b, hi[t]));
    }
  }
}

// The same for every query vector: tiles of kTile share each widened V slice.
ATTN_AVX512 void block_accumulate_bf16(const float* weights, const float* rescale,
                                       const BFloat16* values, int64_t value_stride,
                                       const BFloat16* prefetch, float* state, int vectors, int D,
                                       int state_size) {
  int r = 0;
  for (; r + kTile <= vectors; r += kTile) {  // the first tile prefetches
    accumulate_tile_bf16<kTile>(weights + r * kBlock, rescale + r, values, value_stride,
                                r == 0 ? prefetch : nullptr, state + r * state_size, D, state_size);
  }
  for (; r < vectors; ++r) {
    accumulate_tile_bf16<1>(weights + r * kBlock, rescale + r, values, value_stride,
                            r == 0 ? prefetch : nullptr, state + r * state_size, D, state_size);
  }
}

// ATTN_KERNELS_PORTABLE=1 takes the portable path (tests cover both on one machine).
bool cpu_has_avx512_bf16_path() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      !std::getenv("ATTN_KERNELS_PORTABLE");
  return has;
}
#else
bool cpu_has_avx512_bf16_path() {
  return false;
}
#endif

// acc_t = acc_t * rescale_t + sum_j weight[t][j] * v_j, one kLanes slice at a time.
template <int Tile, typename Rows>
ALWAYS_INLINE void block_accumulate_tile(
    const float* weights, const float* rescale, const Rows& values, float* state, int n, int Dp,
    int state_size) {
  for (int d0 = 0; d0 < Dp; d0 += kLanes) {
    Lanes slice[Tile];
    for (int t = 0; t < Tile; ++t) {
      slice[t] = load_lanes(state + t * state_size + kStateHeader + d0) * rescale[t];
    }
    for (int j = 0; j < n; ++j) {
      const Lanes v = values.at(j, d0);
      for (int t = 0; t < Tile; ++t) {
        slice[t] += weights[t * kBlock + j] * v;
      }
    }
    for (int t = 0; t < Tile; ++t) {
      store_lanes(state + t * state_size + kStateHeader + d0, slice[t]);
    }
  }
}

template <typename Rows>
ALWAYS_INLINE void block_accumulate(
    const float* weights, const float* rescale, const Rows& values, float* state, int vectors,
    int n, int Dp, int state_size) {
  int r = 0;
  for (; r + kTile <= vectors; r += kTile) {
    block_accumulate_tile<kTile>(
        weights + r * kBlock, rescale + r, values, state + r * state_size, n, Dp, state_size);
  }
  for (; r < vectors; ++r) {
    block_accumulate_tile<1>(
        weights + r * kBlock, rescale + r, values, state + r * state_size, n, Dp, state_size);
  }
}

// One key/value row, positions [begin, end), every query vector of its group (group * L of
// them, sharing each K/V load). `state` holds one (max, denominator, accumulator) per vector.
//
// The recurrence of the chapter, taken kBlock positions at a time: new_max = max(m, block
// scores); the rescale factor exp(m - new_max) is computed once per block and applied to the
// denominator and every accumulator dimension; weights are exp(s - new_max).
template <typename T>
ALWAYS_INLINE void attend_chunk(
    const DecodeProblem& p, int kv_row, int begin, int end, float* state, float* scratch) {
  const int D = p.head_dim, Dp = padded(D), L = p.query_len, S = p.context;
  const int vectors = p.group * L;
  const int state_size = state_floats(D);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* queries = scratch;  // vectors x Dp, scaled
  float* keys_block = queries + vectors * Dp;  // kBlock x Dp
  float* values_block = keys_block + kBlock * Dp;
  float* scores = values_block + kBlock * Dp;  // vectors x kBlock, then weights in place
  float* rescale = scores + vectors * kBlock;  // vectors
  // Unscaled queries widened for the AVX-512 bf16 score path.
  float* queries_wide = rescale + vectors + 1;
  bool avx512_bf16 = false;
  if constexpr (std::is_same_v<T, BFloat16>) {
    avx512_bf16 = D % 32 == 0 && p.k_strides[3] == 1 && p.q_strides[3] == 1 &&
        cpu_has_avx512_bf16_path();
  }

  for (int r = 0; r < vectors; ++r) {
    const int row = kv_row * p.group + r / L, i = r % L;
    const T* q = static_cast<const T*>(p.queries) + p.q_offset(row, i);
    float* qr = queries + r * Dp;
    load_padded(qr, q, D, Dp, p.q_strides[3]);
#if defined(ATTN_AVX512_BF16)
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (avx512_bf16) widen_query(q, queries_wide + r * D, D);
    }
#endif
    for (int d = 0; d < Dp; ++d) {
      qr[d] *= p.scale;
    }
    float* st = state + r * state_size;
    st[0] = neg_inf;
    st[1] = 0.0f;
    std::fill(st + kStateHeader, st + state_size, 0.0f);
  }

  const T* keys = static_cast<const T*>(p.keys) + p.kv_offset(p.k_strides, kv_row);
  const T* values = static_cast<const T*>(p.values) + p.kv_offset(p.v_strides, kv_row);
  for (int j0 = begin; j0 < end; j0 += kBlock) {
    const int n = std::min(kBlock, end - j0);
    bool scored = false;
#if defined(ATTN_AVX512_BF16)
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (avx512_bf16 && n == kBlock) {
        const BFloat16* ahead =
            j0 + kPrefetchRows + kBlock <= end ? keys + (j0 + kPrefetchRows) * p.k_strides[2] : nullptr;
        block_scores_bf16(queries_wide, keys + j0 * p.k_strides[2], p.k_strides[2], ahead, scores,
                          vectors, D, p.scale);
        scored = true;
      }
    }
#endif
    if (!scored) {
      // K rows are converted once and reused by every query vector (V rows are used once each).
      for (int j = 0; j < n; ++j) {
        load_padded(keys_block + j * Dp, keys + (j0 + j) * p.k_strides[2], D, Dp, p.k_strides[3]);
      }
      block_scores(queries, ConvertedRows{keys_block, Dp}, scores, vectors, Dp);
    }
    bool any = false;
    // Vector r is query row i = r % L of head row = kv_row * group + r / L, stepped without
    // dividing (in-process A/B, K/V hot: 0-2% faster than two divisions per vector and block).
    for (int r = 0, row = kv_row * p.group, i = 0; r < vectors;
         ++r, i = i + 1 == L ? 0 : i + 1, row += i == 0) {
      float* s = scores + r * kBlock;
      const int visible = p.causal ? std::clamp(S - L + i + 1 - j0, 0, n) : n;
      for (int j = visible; j < kBlock; ++j) {
        s[j] = neg_inf;
      }
      if (p.mask) {
        const int64_t base = p.mask_offset(row, i);
        for (int j = 0; j < visible; ++j) {
          const int64_t at = base + (j0 + j) * p.m_strides[3];
          switch (p.mask_dtype) {
            case ElementType::float32: s[j] += static_cast<const float*>(p.mask)[at]; break;
            case ElementType::float16: s[j] += to_float(static_cast<const Float16*>(p.mask)[at]); break;
            case ElementType::bfloat16: s[j] += to_float(static_cast<const BFloat16*>(p.mask)[at]); break;
            case ElementType::boolean:  // removes the key whatever its score (NaN included)
              if (!static_cast<const bool*>(p.mask)[at]) s[j] = neg_inf;
              break;
          }
        }
      }
      float* st = state + r * state_size;
      const float block_max = lanes_max(load_lanes(s));
      if (block_max == neg_inf) {
        rescale[r] = 1.0f;
        std::fill(s, s + kBlock, 0.0f);  // every key of this block is hidden from this vector
        continue;
      }
      const float new_max = max_nan(st[0], block_max);
      rescale[r] = exp_nonpositive(st[0] - new_max);
      for (int j = 0; j < kBlock; ++j) {
        s[j] = exp_nonpositive(s[j] - new_max);
      }
      const float sum = lanes_sum(load_lanes(s));
      st[0] = new_max;
      st[1] = st[1] * rescale[r] + sum;
      any = true;
    }
    if (!any) {
      continue;
    }
#if defined(ATTN_AVX512_BF16)
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (avx512_bf16 && n == kBlock && p.v_strides[3] == 1) {
        const BFloat16* ahead = j0 + kPrefetchRows + kBlock <= end
                                    ? values + (j0 + kPrefetchRows) * p.v_strides[2]
                                    : nullptr;
        block_accumulate_bf16(scores, rescale, values + j0 * p.v_strides[2], p.v_strides[2], ahead,
                              state, vectors, D, state_size);
        continue;
      }
    }
#endif
    if (p.v_strides[3] == 1 && D == Dp) {
      const CacheRows<T> rows{values + j0 * p.v_strides[2], p.v_strides[2]};
      block_accumulate(scores, rescale, rows, state, vectors, n, Dp, state_size);
    } else {
      for (int j = 0; j < n; ++j) {
        load_padded(values_block + j * Dp, values + (j0 + j) * p.v_strides[2], D, Dp, p.v_strides[3]);
      }
      block_accumulate(scores, rescale, ConvertedRows{values_block, Dp}, state, vectors, n, Dp, state_size);
    }
  }
}

MULTIVERSIONED void attend_chunk_f32(
    const DecodeProblem& p, int kv_row, int begin, int end, float* state, float* scratch) {
  attend_chunk<float>(p, kv_row, begin, end, state, scratch);
}
MULTIVERSIONED void attend_chunk_f16(
    const DecodeProblem& p, int kv_row, int begin, int end, float* state, float* scratch) {
  attend_chunk<Float16>(p, kv_row, begin, end, state, scratch);
}
MULTIVERSIONED void attend_chunk_bf16(
    const DecodeProblem& p, int kv_row, int begin, int end, float* state, float* scratch) {
  attend_chunk<BFloat16>(p, kv_row, begin, end, state, scratch);
}

// Combines the chunk states of one query vector and writes its normalised output row.
// A vector that saw no key (every key masked) gets zeros.
template <typename T>
void finish(const float* states, int chunks, int chunk_stride, int D, T* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int c = 0; c < chunks; ++c) {
    max = max_nan(max, states[c * chunk_stride]);
  }
  float denominator = 0.0f;
  float acc[kMaxHeadDim] = {};
  if (max != -std::numeric_limits<float>::infinity()) {
    for (int c = 0; c < chunks; ++c) {
      const float* st = states + c * chunk_stride;
      const float f = std::exp(st[0] - max);
      denominator += st[1] * f;
      for (int d = 0; d < D; ++d) {
        acc[d] += st[kStateHeader + d] * f;
      }
    }
  }
  const float inv = denominator == 0.0f ? 0.0f : 1.0f / denominator;  // NaN stays NaN
  for (int d = 0; d < D; ++d) {
    store(out + d, acc[d] * inv);
  }
}

int pool_threads() {
  if (const char* env = std::getenv("ATTN_KERNELS_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) {
      return n;
    }
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& pool() {
  static ThreadPool instance(pool_threads());
  return instance;
}

// Below this many multiply-adds waking the pool costs more than it saves: a sleeping worker takes
// ~110 µs to wake on this project's VM (a no-op parallel_for), and between decode calls it always
// sleeps. Through MLX, Qwen3-4B shapes: one thread was faster up to S = 512 (200 vs 216-270 µs
// at 128, 373-428 vs 415-445 at 512), two from 1024 on (687-741 vs 812-1146); 2^22 = S 1024 there.
// Spinning workers won back-to-back but lost once other ops ran between calls (vCPUs that spun
// woke even later), so the pool sleeps.
constexpr int64_t kMinParallelWork = int64_t{1} << 22;
// Context chunks are at least this long, so merging stays negligible.
constexpr int kMinChunk = 256;

template <typename T>
void run(const DecodeProblem& p) {
  using Chunk = void (*)(const DecodeProblem&, int, int, int, float*, float*);
  Chunk attend = std::is_same_v<T, float> ? attend_chunk_f32
                 : std::is_same_v<T, Float16> ? attend_chunk_f16
                                              : attend_chunk_bf16;
  const int D = p.head_dim, S = p.context;
  const int vectors = p.group * p.query_len;
  const int state_size = state_floats(D);
  const int64_t work = int64_t{p.kv_rows} * S * vectors * D;
  const int threads = work < kMinParallelWork ? 1 : pool().size();

  // Few heads and a long cache: split the context too, into at least 8 units per thread. The pool
  // hands units out as threads ask, so a worker that starts late (~40 µs after the caller in a
  // trace of two-thread calls) and the last unit leave a short tail. In-process A/B, Qwen3-4B shapes, hot, two runs, 8 vs 4 units per
  // thread: 0.95/0.89 of the time at S = 1024, 0.97/0.98 at 4096; 16 per thread: 1.05/1.03 at 1024.
  int chunks = 1;
  if (threads > 1 && p.kv_rows < 8 * threads) {
    const int wanted = (8 * threads + p.kv_rows - 1) / p.kv_rows;
    chunks = std::max(1, std::min(wanted, S / kMinChunk));
  }
  const int chunk_len = (S + chunks - 1) / chunks;
  const int units = p.kv_rows * chunks;
  // states[kv_row][vector][chunk]: one (max, denominator, accumulator) per chunk.
  std::vector<float> states(static_cast<size_t>(units) * vectors * state_size);
  const size_t scratch_size = scratch_floats(vectors, D);

  auto attend_unit = [&](int unit) {
    thread_local std::vector<float> scratch;
    scratch.resize(std::max(scratch.size(), scratch_size));
    const int kv_row = unit / chunks, c = unit % chunks;
    const int begin = c * chunk_len, end = std::min(S, begin + chunk_len);
    float* st = states.data() + static_cast<size_t>(unit) * vectors * state_size;
    attend(p, kv_row, begin, end, st, scratch.data());
  };
  auto finish_row = [&](int kv_row) {
    for (int r = 0; r < vectors; ++r) {
      const int row = kv_row * p.group + r / p.query_len, i = r % p.query_len;
      T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.query_len + i) * D;
      const float* first =
          states.data() + (static_cast<size_t>(kv_row) * chunks * vectors + r) * state_size;
      finish(first, chunks, vectors * state_size, D, out);
    }
  };
  if (threads == 1) {
    for (int u = 0; u < units; ++u) {
      attend_unit(u);
    }
  } else {
    pool().parallel_for(units, attend_unit);
  }
  // Normalising the rows is a few thousand multiply-adds: waking the pool for them cost 65-90 µs
  // more per call than doing them here (interleaved A/B through MLX, S = 256..4096).
  for (int h = 0; h < p.kv_rows; ++h) {
    finish_row(h);
  }
}

// Sums 64-bit words in independent lanes: a pure streaming read the compiler vectorises.
MULTIVERSIONED uint64_t sum_words(const uint64_t* data, size_t n) {
  uint64_t lanes[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      lanes[l] += data[i + l];
    }
  }
  uint64_t total = 0;
  for (uint64_t x : lanes) {
    total += x;
  }
  return total;
}

}  // namespace

double measure_read_bandwidth(size_t bytes, int repeats) {
  const size_t words = bytes / sizeof(uint64_t);
  std::vector<uint64_t> buffer(words, 1);
  const int threads = pool().size();
  const size_t per_thread = (words / threads) / 8 * 8;
  std::vector<uint64_t> sums(threads);
  double best = 0.0;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    pool().parallel_for(threads, [&](int t) {
      sums[t] = sum_words(buffer.data() + t * per_thread, per_thread);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(per_thread * threads * sizeof(uint64_t)) / seconds);
  }
  if (sums[0] != per_thread) {  // keeps the reads observable
    throw std::logic_error("measure_read_bandwidth: unexpected sum");
  }
  return best;
}

void decode_attention_cpu(const DecodeProblem& p) {
  switch (p.dtype) {
    case ElementType::float32: run<float>(p); break;
    case ElementType::float16: run<Float16>(p); break;
    case ElementType::bfloat16: run<BFloat16>(p); break;
    case ElementType::boolean: break;  // rejected by the op
  }
}

}  // namespace attn_kernels
