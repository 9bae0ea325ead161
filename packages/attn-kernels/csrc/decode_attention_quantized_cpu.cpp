// The CPU kernel over a quantized cache: per key/value head and context chunk, every query vector
// of the group walks the positions once with a running max, denominator and float32 accumulator
// (online softmax), as the bf16 kernel does. Each block of kBlock positions is dequantised once
// (scale * code + bias, into an L1-resident float block) and shared by all of the group's query
// vectors, so each code byte is read once per call.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_scalar.h"
#include "decode_attention.h"
#include "decode_attention_quantized.h"
#include "cpu_split.h"

// One clone per x86-64 level, picked at load time (as decode_attention_cpu.cpp does).
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define QUANTIZED_MULTIVERSIONED \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QUANTIZED_MULTIVERSIONED
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace attn_kernels {
namespace {

static_assert(std::endian::native == std::endian::little,
              "mx.quantize's uint32 words are read as bytes: code i of a row is byte i (8-bit) or "
              "nibble i (4-bit, low nibble first)");

// The element types and their scalar conversions: the bf16 kernel's.
using cpu::BFloat16;
using cpu::exp_nonpositive;
using cpu::exp_nonpositive_lanes;
using cpu::Float16;
using cpu::nan_max;
using cpu::store;
using cpu::to_float;

constexpr int kLanes = 16;  // floats per vector value
constexpr int kBlock = 16;  // positions per online-softmax step (one rescale each)
constexpr int kTile = 4;    // query vectors sharing each loaded slice of V
constexpr int kMaxGroups = kMaxHeadDim / 32;

using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
using UnalignedLanes = float __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
using Bytes = uint8_t __attribute__((vector_size(kLanes), aligned(1)));
using Shorts = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
using Ints = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

ALWAYS_INLINE Lanes load_lanes(const float* p) {
  return *reinterpret_cast<const UnalignedLanes*>(p);
}
ALWAYS_INLINE void store_lanes(float* p, Lanes v) {
  *reinterpret_cast<UnalignedLanes*>(p) = v;
}
// Sixteen codes as floats, widened step by step (u8 -> u16 -> i32 -> float): GCC 12 turns a
// direct u8 -> float conversion, and u8 -> i32 from memory, into a byte extract and a scalar
// conversion per lane (~50-60 instructions at x86-64-v4 instead of ~12); that was ~3/4 of this
// kernel's time (perf, 2-vCPU Xeon, S = 16384).
ALWAYS_INLINE Lanes code_lanes(Bytes b) {
  return __builtin_convertvector(
      __builtin_convertvector(__builtin_convertvector(b, Shorts), Ints), Lanes);
}

// One row of D values (D % 32 == 0) as floats: value = scale[g] * code + bias[g]. 8-bit: code i
// is byte i. 4-bit: code i is the low (even i) or high (odd i) nibble of byte i / 2; sixteen bytes
// give two vectors of nibbles, interleaved back into dimension order.
template <int Bits>
ALWAYS_INLINE void dequantize_row(float* dst, const uint8_t* codes, const float* scales,
                                  const float* biases, int D, int group_shift) {
  if constexpr (Bits == 8) {
    for (int d0 = 0; d0 < D; d0 += kLanes) {
      const Bytes b = *reinterpret_cast<const Bytes*>(codes + d0);
      const int g = d0 >> group_shift;
      store_lanes(dst + d0, code_lanes(b) * scales[g] + biases[g]);
    }
  } else {
    for (int d0 = 0; d0 < D; d0 += 2 * kLanes) {
      const Bytes b = *reinterpret_cast<const Bytes*>(codes + d0 / 2);
      const Lanes lo = code_lanes(b & 15);
      const Lanes hi = code_lanes(b >> 4);
      const int g = d0 >> group_shift;
      const Lanes first = __builtin_shufflevector(
          lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const Lanes second = __builtin_shufflevector(
          lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      store_lanes(dst + d0, first * scales[g] + biases[g]);
      store_lanes(dst + d0 + kLanes, second * scales[g] + biases[g]);
    }
  }
}

// One of keys or values for one key/value row: codes, scales and biases with their strides.
template <typename T>
struct QuantizedRows {
  const uint32_t* codes;
  const T* scales;
  const T* biases;
  const int64_t* strides;  // [codes, scales, biases][4]
  int words, groups;

  // Position j's dequantised row into dst. Codes whose last axis is not contiguous are gathered
  // into `gather` first.
  template <int Bits>
  ALWAYS_INLINE void load(int j, float* dst, int D, int group_shift, uint32_t* gather) const {
    const int64_t* cs = strides;
    const int64_t* ss = strides + 4;
    const int64_t* bs = strides + 8;
    const uint32_t* w = codes + j * cs[2];
    if (cs[3] != 1) {
      for (int i = 0; i < words; ++i) gather[i] = w[i * cs[3]];
      w = gather;
    }
    float scale[kMaxGroups], bias[kMaxGroups];
    const T* s = scales + j * ss[2];
    const T* b = biases + j * bs[2];
    for (int g = 0; g < groups; ++g) {
      scale[g] = to_float(s[g * ss[3]]);
      bias[g] = to_float(b[g * bs[3]]);
    }
    dequantize_row<Bits>(dst, reinterpret_cast<const uint8_t*>(w), scale, bias, D, group_shift);
  }
};

// Sixteen partial-sum vectors in, one vector of their sixteen totals out (lane j = sum of the
// lanes of partial[j]): four levels of pairwise folds.
ALWAYS_INLINE Lanes fold(Lanes x, Lanes y, int width) {
  // width 16, 8, 4, 2: add the two halves of every `width`-lane group of x and y, packing x's
  // groups then y's (so the order of the partials is kept).
  switch (width) {
    case 16:
      return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    case 8:
      return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    case 4:
      return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    default:
      return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
             __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}
ALWAYS_INLINE Lanes transpose_sum(const Lanes (&partial)[kBlock]) {
  static_assert(kBlock == 16 && kLanes == 16, "the folds are written for 16 lanes");
  Lanes a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold(partial[2 * i], partial[2 * i + 1], 16);
  for (int i = 0; i < 4; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], 8);
  for (int i = 0; i < 2; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], 4);
  return fold(c[0], c[1], 2);
}

// The largest lane; NaN if any lane is NaN (std::max would drop it: a NaN query must give a NaN
// row, as in the float kernel).
ALWAYS_INLINE float lanes_max(Lanes x) {
  float m = x[0];
  for (int l = 1; l < kLanes; ++l) m = nan_max(m, x[l]);
  return m;
}

// Online-softmax state per query vector: max, denominator, D accumulators (cpu_split.h's).
constexpr int kHeader = cpu::kStateHeader;

struct Scratch {
  std::vector<float> floats;
  float *queries, *keys, *values, *scores, *rescale;
  uint32_t gather[kMaxHeadDim * 8 / 32];

  void reserve(int vectors, int D) {
    const size_t need = size_t(vectors) * D + 2 * size_t(kBlock) * D + size_t(vectors) * kBlock +
                        vectors;
    if (floats.size() < need) floats.assign(need, 0.0f);
    queries = floats.data();
    keys = queries + size_t(vectors) * D;
    values = keys + kBlock * D;
    scores = values + kBlock * D;
    rescale = scores + size_t(vectors) * kBlock;
  }
};

// Key/value row `kv_row`, positions [begin, end), all group * L query vectors of the row.
template <typename T, int Bits>
ALWAYS_INLINE void attend_chunk(const QuantizedProblem& p, int kv_row, int begin, int end,
                                float* state, Scratch& scratch) {
  const int D = p.head_dim, L = p.query_len, vectors = p.group * L;
  const int state_size = D + kHeader;
  const int group_shift = std::countr_zero(static_cast<unsigned>(p.group_size));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* queries = scratch.queries;
  float* scores = scratch.scores;
  float* rescale = scratch.rescale;

  for (int r = 0; r < vectors; ++r) {
    const int row = kv_row * p.group + r / L, i = r % L;
    const T* q = static_cast<const T*>(p.queries) + p.q_offset(row, i);
    for (int d = 0; d < D; ++d) queries[r * D + d] = to_float(q[d * p.q_strides[3]]) * p.scale;
    float* st = state + r * state_size;
    st[0] = neg_inf;
    st[1] = 0.0f;
    std::fill(st + kHeader, st + state_size, 0.0f);
  }
  const int words = D * Bits / 32, groups = D / p.group_size;
  auto rows = [&](const uint32_t* codes, const void* scales, const void* biases,
                  const int64_t (&strides)[3][4]) {
    return QuantizedRows<T>{codes + p.kv_offset(strides[0], kv_row),
                            static_cast<const T*>(scales) + p.kv_offset(strides[1], kv_row),
                            static_cast<const T*>(biases) + p.kv_offset(strides[2], kv_row),
                            &strides[0][0], words, groups};
  };
  const QuantizedRows<T> keys = rows(p.k_codes, p.k_scales, p.k_biases, p.k_strides);
  const QuantizedRows<T> values = rows(p.v_codes, p.v_scales, p.v_biases, p.v_strides);
  // Only the positions of the batch row's range (the whole context without per-row ranges).
  const CacheRange range = p.range(kv_row / p.kv_heads);
  begin = std::max(begin, range.start);
  end = std::min(end, range.end);

  for (int j0 = begin; j0 < end; j0 += kBlock) {
    const int n = std::min(kBlock, end - j0);
    for (int j = 0; j < n; ++j) {
      keys.template load<Bits>(j0 + j, scratch.keys + j * D, D, group_shift, scratch.gather);
    }
    // scores[r][j] = q_r . k_j: kBlock partial-sum vectors per query vector, one transpose-sum.
    for (int r = 0; r < vectors; ++r) {
      Lanes partial[kBlock] = {};
      for (int d0 = 0; d0 < D; d0 += kLanes) {
        const Lanes qv = load_lanes(queries + r * D + d0);
        for (int j = 0; j < kBlock; ++j) partial[j] += qv * load_lanes(scratch.keys + j * D + d0);
      }
      store_lanes(scores + r * kBlock, transpose_sum(partial));
    }
    bool any = false;
    for (int r = 0; r < vectors; ++r) {
      const int row = kv_row * p.group + r / L, i = r % L;
      float* s = scores + r * kBlock;
      const int visible = std::clamp(visible_keys(range, L, i, p.causal).last + 1 - j0, 0, n);
      for (int j = visible; j < kBlock; ++j) s[j] = neg_inf;
      if (p.mask) {
        const int64_t base = p.mask_offset(row, i);
        for (int j = 0; j < visible; ++j) {
          const int64_t at = base + int64_t{j0 + j} * p.m_strides[3];
          switch (p.mask_kind) {
            case kMaskFloat32: s[j] += static_cast<const float*>(p.mask)[at]; break;
            case kMaskFloat16: s[j] += to_float(static_cast<const Float16*>(p.mask)[at]); break;
            case kMaskBFloat16: s[j] += to_float(static_cast<const BFloat16*>(p.mask)[at]); break;
            case kMaskBool:
              // False removes the key whatever its score (a NaN key included), as the contract
              // says.
              if (!static_cast<const bool*>(p.mask)[at]) s[j] = neg_inf;
              break;
          }
        }
      }
      float* st = state + r * state_size;
      const float block_max = lanes_max(load_lanes(s));
      if (block_max == neg_inf) {  // every key of this block is hidden from this vector
        rescale[r] = 1.0f;
        std::fill(s, s + kBlock, 0.0f);
        continue;
      }
      const float new_max = nan_max(block_max, st[0]);
      rescale[r] = exp_nonpositive(st[0] - new_max);
      // One vector exp for the block (libm's scalar exp was about half of a block's time).
      const Lanes weights = exp_nonpositive_lanes(load_lanes(s) - new_max);
      store_lanes(s, weights);
      float sum = 0.0f;
      for (int j = 0; j < kBlock; ++j) sum += weights[j];
      st[0] = new_max;
      st[1] = st[1] * rescale[r] + sum;
      any = true;
    }
    if (!any) continue;
    for (int j = 0; j < n; ++j) {
      values.template load<Bits>(j0 + j, scratch.values + j * D, D, group_shift, scratch.gather);
    }
    // acc_r = acc_r * rescale_r + sum_j weight[r][j] * v_j, kTile vectors per loaded V slice.
    for (int r0 = 0; r0 < vectors; r0 += kTile) {
      const int tile = std::min(kTile, vectors - r0);
      for (int d0 = 0; d0 < D; d0 += kLanes) {
        Lanes acc[kTile];
        for (int t = 0; t < kTile; ++t) {
          acc[t] = t < tile ? load_lanes(state + (r0 + t) * state_size + kHeader + d0) * rescale[r0 + t]
                            : Lanes{};
        }
        for (int j = 0; j < n; ++j) {
          const Lanes v = load_lanes(scratch.values + j * D + d0);
          for (int t = 0; t < kTile; ++t) {
            const float w = t < tile ? scores[(r0 + t) * kBlock + j] : 0.0f;
            acc[t] += w * v;
          }
        }
        for (int t = 0; t < tile; ++t) store_lanes(state + (r0 + t) * state_size + kHeader + d0, acc[t]);
      }
    }
  }
}

using Chunk = void (*)(const QuantizedProblem&, int, int, int, float*, Scratch&);

#define QUANTIZED_CHUNK(NAME, T, BITS)                                                      \
  QUANTIZED_MULTIVERSIONED void NAME(const QuantizedProblem& p, int kv_row, int begin,     \
                                     int end, float* state, Scratch& scratch) {             \
    attend_chunk<T, BITS>(p, kv_row, begin, end, state, scratch);                           \
  }
QUANTIZED_CHUNK(attend_f32_8, float, 8)
QUANTIZED_CHUNK(attend_f32_4, float, 4)
QUANTIZED_CHUNK(attend_f16_8, Float16, 8)
QUANTIZED_CHUNK(attend_f16_4, Float16, 4)
QUANTIZED_CHUNK(attend_bf16_8, BFloat16, 8)
QUANTIZED_CHUNK(attend_bf16_4, BFloat16, 4)
#undef QUANTIZED_CHUNK

// The float kernel's split (cpu_split.h): the same threads, chunks and merge.
template <typename T>
void run(const QuantizedProblem& p, Chunk attend) {
  const cpu::SplitLayout layout{p.head_dim, 0, false, kLanes};
  cpu::run_split<T>(p, p.out, layout,
                    [&](int kv_row, int begin, int end, float* state, float*) {
                      thread_local Scratch scratch;
                      scratch.reserve(p.group * p.query_len, p.head_dim);
                      attend(p, kv_row, begin, end, state, scratch);
                    });
}

}  // namespace

void decode_attention_quantized_cpu(const QuantizedProblem& p) {
  const bool eight = p.bits == 8;
  switch (p.dtype) {
    case ElementType::float32: run<float>(p, eight ? attend_f32_8 : attend_f32_4); break;
    case ElementType::float16: run<Float16>(p, eight ? attend_f16_8 : attend_f16_4); break;
    case ElementType::bfloat16: run<BFloat16>(p, eight ? attend_bf16_8 : attend_bf16_4); break;
    case ElementType::boolean: break;  // rejected by the op
  }
}

}  // namespace attn_kernels
