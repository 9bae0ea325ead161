// The CPU linear body: out = x @ W^T (+ bias) for up to kLinearRows rows of x, written once in
// GCC/Clang vector extensions and compiled once per instruction set beside the attention body
// (cpu_kernel_<path>.cpp defines ATTN_CPU_PATH, ATTN_CPU_WIDTH and ATTN_CPU_REGISTERS, the
// vector registers the path has).
//
// A decode step reads every weight once and does 1-8 multiply-adds with it, so the kernel is a
// stream over W: each weight row is read once and widened in registers (bf16: a shift and a mask,
// f16: the hardware conversion; codes: a mask or a shift per code position, no shuffles) against
// rows of x that were converted to float once per call in the order the widening produces
// (prepare). R weight rows are walked together so that R x M accumulators hide the FMA latency.
//
// Quantized W (mx.quantize's affine layout): w = scale * code + bias per group, so
//   out = sum_g scale_g * (codes_g . x_g) + sum_g bias_g * (sum of x_g).
// The group sums of x are prepared once; a block of W words (32 / bits codes each) gives one
// vector of codes per code position j. Masking code j in place (no shift) leaves code * 2^(bits j),
// exact in a float, so x is prepared already scaled by 2^-(bits j): one AND and one conversion
// per vector of codes. The last position is a shift (its mask would set the sign bit).
//
// Everything here is internal (anonymous namespace) or a builtin: see cpu_kernel_body.h.
#include <utility>

#include "cpu_linear.h"
#include "cpu_vector.h"

#if !defined(ATTN_CPU_REGISTERS)
#error "define ATTN_CPU_REGISTERS before including"
#endif

namespace attn_kernels::cpu {
namespace ATTN_CPU_PATH {
namespace {

using Ints = int32_t __attribute__((vector_size(W * sizeof(int32_t))));

constexpr int kDenseStep = 2 * W;  // values of a dense row per step: one widened pair

// Rows of x are run in buckets of 1, 2, 4 or 8 (padded with zero rows): one compiled loop each.
constexpr int bucket(int rows) {
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
}

// Weight rows walked together: as many (up to 4) as leave `per_row` registers each, plus
// `fixed`, within the path's registers.
constexpr int tile_rows(int per_row, int fixed) {
  for (int r = 4; r > 1; r /= 2) {
    if (r * per_row + fixed <= ATTN_CPU_REGISTERS) return r;
  }
  return 1;
}

// The lanes of v summed as a tree of halves: log2(W) dependent adds, not W.
template <typename V, size_t... I>
ATTN_ALWAYS_INLINE auto halves_added(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, I...) + __builtin_shufflevector(v, v, (I + sizeof...(I))...);
}
template <typename V>
ATTN_ALWAYS_INLINE float lane_sum(V v) {
  constexpr size_t lanes = sizeof(V) / sizeof(float);
  if constexpr (lanes == 1) {
    return v[0];
  } else {
    return lane_sum(halves_added(v, std::make_index_sequence<lanes / 2>{}));
  }
}

// How far ahead the weights are prefetched into L2: the same place in the tile two tiles on. A
// tile's R rows lie one after another, so a distance in whole tiles fetches every line once and
// the next rows' first bytes as early as their last. The hardware prefetcher alone kept R streams
// of 4-bit codes to ~19 GB/s on two Zen 3 vCPUs (Qwen3-4B's gate/up, cold). A fixed distance
// within the row (4 KB for codes, 2 KB for bf16/f16: 26-27 GB/s there) left rows shorter than a
// few KB half-fetched at each tile's start: on a 2-vCPU Xeon (AVX-512), cold, M = 1, two tiles
// on against it took 8-bit gate/up (19456 x 2560) 2.4 ms against 3.5, 4-bit 0.83x the time, bf16
// 0.85x, down (2560 x 9728) 0.80x (4-bit) and 0.83x (8-bit); one tile on was slower at 4 bits
// for K = 1024 (1.1-1.2x), where a tile is 2 KB. Measured with `make bench-linear-kernel`.
ATTN_ALWAYS_INLINE int64_t prefetch_distance(int64_t tile_bytes) {
  return 2 * tile_bytes;
}

// Accumulators zeroed lane by lane: `= {}` became a `rep stos` through memory (~7% of a 4-bit
// call at K = 1024), which also kept them out of registers between chunks.
template <int R, int M>
ATTN_ALWAYS_INLINE void zero(Vec (&acc)[R][M]) {
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) acc[r][m] = Vec{};
  }
}

// n values (n <= W) at p as float lanes 0..n-1, the rest 0; never reads past p + n.
template <typename T>
ATTN_ALWAYS_INLINE Vec load_floats(const T* p, int n) {
  if constexpr (sizeof(T) == 4) {
    Vec v{};
    __builtin_memcpy(&v, p, n * sizeof(float));
    return v;
  } else {
    Shorts halves{};
    __builtin_memcpy(&halves, p, n * sizeof(T));
    if constexpr (__is_same(T, BFloat16)) {
      return (Vec)(__builtin_convertvector(halves, Bits) << 16);
    } else {
      return halves_to_floats(halves);
    }
  }
}

// n values (n < W) at p as float lanes 0..n-1, the rest 0, where W values may be read at p: one
// whole load and a select. Through load_floats (a copy into a vector, then read whole: a stalled
// store forward) a chunk's partial scales cost AVX-512's 4-bit layers up to 1.4x at groups of 128
// and K = 1024 (8 groups a row), where AVX2 takes whole vectors; 8-bit and long rows 3-6%.
template <typename T>
ATTN_ALWAYS_INLINE Vec load_floats_within(const T* p, int n) {
  Ints lane{};
  for (int l = 0; l < W; ++l) lane[l] = l;
  return (Vec)((Ints)load_floats(p, W) & (lane < n));
}

// sum_i a[i] * b[i] over n values of a (T) and b (float).
template <typename T>
float dot(const T* a, const float* b, int n) {
  Vec acc{};
  int i = 0;
  for (; i + W <= n; i += W) acc += load_floats(a + i, W) * load<Vec>(b + i);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += to_float(a[i]) * b[i];
  return s;
}

template <typename T>
ATTN_ALWAYS_INLINE void store_row_sums(const LinearProblem& p, int n, int r, int rows,
                                       const float* sums, int stride) {
  T* out = static_cast<T*>(p.out);
  const float bias = p.bias ? to_float(static_cast<const T*>(p.bias)[n + r]) : 0.0f;
  for (int m = 0; m < rows; ++m) {
    store(out + int64_t{m} * p.outputs + n + r, sums[m * stride] + bias);
  }
}

// ---- Dense weights -------------------------------------------------------------------------

int dense_main(const LinearProblem& p) {
  return p.inputs / kDenseStep * kDenseStep;
}

// R weight rows from row n against M prepared rows of x (row_floats apart).
template <typename T, int M, int R>
ATTN_ALWAYS_INLINE void dense_rows(const LinearProblem& p, const float* x, int row_floats, int n) {
  const int K = p.inputs, main = dense_main(p);
  const T* w = static_cast<const T*>(p.weight) + int64_t{n} * K;
  Vec acc[R][M];
  zero(acc);
  for (int c = 0; c < main; c += kDenseStep) {
    Pair wv[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (sizeof(T) == 2) {  // f32 streams at the floor: prefetching lost it 3-7%
        prefetch_to_l2(reinterpret_cast<const char*>(w + int64_t{r} * K + c) +
                       prefetch_distance(R * int64_t{K} * sizeof(T)));
      }
      wv[r] = widen(w + int64_t{r} * K + c);
    }
    for (int m = 0; m < M; ++m) {
      const Vec xa = load<Vec>(x + m * row_floats + c), xb = load<Vec>(x + m * row_floats + c + W);
      for (int r = 0; r < R; ++r) {
        acc[r][m] += wv[r].a * xa;
        acc[r][m] += wv[r].b * xb;
      }
    }
  }
  float sums[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      sums[r][m] = lane_sum(acc[r][m]);
      for (int k = main; k < K; ++k) {
        sums[r][m] += to_float(w[int64_t{r} * K + k]) * x[m * row_floats + k];
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row_sums<T>(p, n, r, p.rows, &sums[r][0], 1);
}

template <typename T, int M>
void dense_columns(const LinearProblem& p, const float* x, int row_floats, int begin, int end) {
  // Registers: two widened vectors and M accumulators per weight row, a pair of x.
  constexpr int R = tile_rows(2 + M, 2);
  int n = begin;
  for (; n + R <= end; n += R) dense_rows<T, M, R>(p, x, row_floats, n);
  for (; n < end; ++n) dense_rows<T, M, 1>(p, x, row_floats, n);
}

// ---- Quantized weights ---------------------------------------------------------------------

template <int BITS>
constexpr int kPerWord = 32 / BITS;

int block_values(const LinearProblem& p) {
  return 32 / p.bits * W;  // one vector of words
}
int quantized_main(const LinearProblem& p) {
  return p.inputs / block_values(p) * block_values(p);
}

// Code position J of every word, as float lanes: code * 2^(BITS J) (J < last), or the code.
template <int BITS, int J>
ATTN_ALWAYS_INLINE Vec codes_at(Bits words) {
  if constexpr (J == kPerWord<BITS> - 1) {
    return __builtin_convertvector((Ints)(words >> (BITS * J)), Vec);
  } else {
    constexpr uint32_t mask = ((1u << BITS) - 1) << (BITS * J);
    return __builtin_convertvector((Ints)(words & mask), Vec);
  }
}
template <int BITS, int J>
constexpr float code_scale() {  // what prepare multiplies x by for code position J
  return J == 0 || J == kPerWord<BITS> - 1 ? 1.0f : 1.0f / static_cast<float>(1u << (BITS * J));
}

// Lane l of a block's scales: the scale of the group of codes [P l, P l + P) of the block.
template <int G, size_t... L>
ATTN_ALWAYS_INLINE Vec spread(Vec v, std::index_sequence<L...>) {
  return __builtin_shufflevector(v, v, static_cast<int>(L / G)...);
}
// Where a prepared row's parts start: x (floats, K), the group sums of x (K / GS, then W zeros
// so that a chunk's last vector of sums reads zeros), then the int8 path's x scales and bytes.
int group_sums_at(const LinearProblem& p) {
  return p.inputs;
}
int s8_scales_at(const LinearProblem& p) {
  return p.inputs + p.inputs / p.group_size + W;
}

// A block's weight scales as lanes (lane l: codes [P l, P l + P)), from the chunk's scales at
// its first group.
template <int GS, int BLOCK, int P>
ATTN_ALWAYS_INLINE Vec block_scales(const float* s) {
  if constexpr (GS >= BLOCK) {
    return s[0] - Vec{};  // a broadcast (x - 0 is x: no add is emitted)
  } else {
    return spread<GS / P>(load<Vec>(s), std::make_index_sequence<W>{});
  }
}

// A tile of R quantized rows against M rows of x. The scales are converted to floats a chunk of
// groups at a time (vector conversions) so that a block takes its scale with one broadcast load
// (a conversion per block, a scalar load, a shift, a move and a broadcast, was a quarter of the
// int8 loop's instructions); the chunk's bias term, sum_g bias_g * (sum of x_g), is accumulated
// in the same pass. Then `chunk(c0, end, scales)` (codes [c0, end) of the chunk are in whole
// blocks, scales[r][g] are its groups' scales) and, per block of row r, `block(r, c, c - c0,
// words, scales[r], acc[r])` adds codes [c, c + BLOCK) (one vector of words). The codes past the
// last whole block are read one by one against x in natural order (unscaled, at
// x + m * row_floats); the sums are stored with the bias.
constexpr int kChunkGroups = 2 * W;
using ChunkScales = float[kChunkGroups + W];  // + W: a block's lane scales load one vector

template <typename T, int BITS, int GS, int BLOCK, int M, int R, typename Chunk, typename Block>
ATTN_ALWAYS_INLINE void quantized_tile(const LinearProblem& p, const float* x, int row_floats,
                                       int n, Chunk&& chunk, Block&& block) {
  constexpr int P = kPerWord<BITS>;
  const int K = p.inputs, groups = K / GS, main = quantized_main(p);  // whole blocks of BLOCK
  const int64_t words = K / P;
  const uint32_t* codes = static_cast<const uint32_t*>(p.weight) + n * words;
  const T* scales = static_cast<const T*>(p.scales) + int64_t{n} * groups;
  const T* biases = static_cast<const T*>(p.biases) + int64_t{n} * groups;
  const float* sums = x + group_sums_at(p);
  const int64_t last_scale = int64_t{p.outputs} * groups;  // scales (and biases) in the arrays
  Vec acc[R][M];
  zero(acc);
  for (int g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int count = groups - g0 < kChunkGroups ? groups - g0 : kChunkGroups;
    ChunkScales converted[R];
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * int64_t{groups} + g0;
      auto convert = [&](int g, Vec scale, Vec bias) __attribute__((always_inline)) {
        store_vec(&converted[r][g], scale);
        for (int m = 0; m < M; ++m) acc[r][m] += bias * load<Vec>(sums + m * row_floats + g0 + g);
      };
      int g = 0;
      for (; g + W <= count; g += W) {
        convert(g, load_floats(scales + at + g, W), load_floats(biases + at + g, W));
      }
      if (g < count && n * int64_t{groups} + at + g + W <= last_scale) {  // more rows follow
        convert(g, load_floats_within(scales + at + g, count - g),
                load_floats_within(biases + at + g, count - g));
      } else if (g < count) {  // the last row's end: never read past the arrays
        convert(g, load_floats(scales + at + g, count - g),
                load_floats(biases + at + g, count - g));
      }
    }
    const int c0 = g0 * GS, end = c0 + kChunkGroups * GS < main ? c0 + kChunkGroups * GS : main;
    chunk(c0, end, converted);
    for (int c = c0; c < end; c += BLOCK) {
      for (int r = 0; r < R; ++r) {
        const uint32_t* at = codes + r * words + c / P;
        prefetch_to_l2(reinterpret_cast<const char*>(at) + prefetch_distance(R * words * 4));
        block(r, c, c - c0, load<Bits>(at), converted[r], acc[r]);
      }
    }
  }
  float out[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = lane_sum(acc[r][m]);
      for (int k = main; k < K; ++k) {
        const uint32_t word = codes[r * words + k / P];
        const uint32_t code = (word >> (BITS * (k % P))) & ((1u << BITS) - 1);
        s += to_float(scales[int64_t{r} * groups + k / GS]) * static_cast<float>(code) *
             x[m * row_floats + k];
      }
      out[r][m] = s;
    }
  }
  for (int r = 0; r < R; ++r) store_row_sums<T>(p, n, r, p.rows, &out[r][0], 1);
}

// ---- Quantized weights, 4-bit, against int8 activations (x86) ------------------------------
//
// With bf16 or f16 x, 4-bit codes meet x rounded to int8 (max |x| / 127 per group, or per 64
// values where a group is longer) in the integer dot product of x86 (vpmaddubsw: 32
// code-by-int8 products summed in pairs, then vpmaddwd to 32-bit sums): ~12 operations a block of
// 8 W codes against ~30 for the float path (an AND, a conversion and an FMA per vector of codes).
// Measured on one Zen 3 core, Qwen3-4B's gate/up 4-bit: 10.3 against 5.9 GB/s. The weight and x
// scales are multiplied a chunk at a time, not per block and row (a hot M = 1 call: 8-10% faster
// than with a scale per 32 values). The rounding of x adds at most
// sum |w| * scale / 2 to an output, of the order of the output's own bf16 rounding (and below
// MLX's own bf16 path, which accumulates in bf16). float32 x keeps the float path (exact to
// float32 accumulation).
#if defined(__AVX2__) && ATTN_CPU_WIDTH == 8
#define ATTN_CPU_S8_DOT 1
// sum over the 8 codes of each 32-bit lane: even codes (low nibbles) with xe, odd with xo.
ATTN_ALWAYS_INLINE Ints dot_codes_s8(Bits even, Bits xe, Bits odd, Bits xo) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16((__m256i)even, (__m256i)xe),
                                         _mm256_maddubs_epi16((__m256i)odd, (__m256i)xo));
  return (Ints)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#elif defined(__AVX512BW__) && ATTN_CPU_WIDTH == 16
#define ATTN_CPU_S8_DOT 1
ATTN_ALWAYS_INLINE Ints dot_codes_s8(Bits even, Bits xe, Bits odd, Bits xo) {
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16((__m512i)even, (__m512i)xe),
                                         _mm512_maddubs_epi16((__m512i)odd, (__m512i)xo));
  return (Ints)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
}
#endif

// x values per int8 scale: one weight group, or 64 where a group is longer, on every path. A unit
// of AVX-512's whole block (128 values) rounded x coarser than AVX2's: Qwen3's 4-bit logits
// parted from mlx-lm's by 0.26 against 0.25 allowed (test_model.py), on AVX2 within it.
constexpr int s8_unit(int group_size) {
  return group_size < 64 ? group_size : 64;
}
// Where a prepared row's int8 values start (in floats): after its x scales.
int s8_bytes_at(const LinearProblem& p) {
  return s8_scales_at(p) + quantized_main(p) / s8_unit(p.group_size);
}

bool uses_s8(const LinearProblem& p) {
#if defined(ATTN_CPU_S8_DOT)
  return p.bits == 4 && p.dtype != ElementType::float32;
#else
  (void)p;
  return false;
#endif
}

#if defined(ATTN_CPU_S8_DOT)
// A prepared row of the int8 path: x as floats (natural order: the tail), the group sums, the
// int8 scales of x (one per U = min(GS, 64) values), then per block of 8 W codes the block's
// int8 values, the even codes' x then the odd codes' (byte i of a word vector holds codes 2 i and
// 2 i + 1). Per chunk the weight and x scales are multiplied once, W units at a time.
template <typename T, int GS, int M, int R>
ATTN_ALWAYS_INLINE void quantized_rows_s8(const LinearProblem& p, const float* x, int row_floats,
                                          int n) {
  constexpr int kBlock = 8 * W, U = s8_unit(GS);
  constexpr int kUnits = kChunkGroups * GS / U;  // units a chunk
  const float* x_scales = x + s8_scales_at(p);
  const auto* bytes = reinterpret_cast<const uint8_t*>(x + s8_bytes_at(p));
  float combined[R][M][kUnits + W];  // weight scale * x scale per unit of the chunk
  quantized_tile<T, 4, GS, kBlock, M, R>(
      p, x, row_floats, n,
      [&](int c0, int end, const ChunkScales* scales) __attribute__((always_inline)) {
        const int units = (end - c0) / U;
        for (int r = 0; r < R; ++r) {
          for (int m = 0; m < M; ++m) {
            const float* xs = x_scales + m * row_floats + c0 / U;
            for (int u = 0; u < units; u += W) {
              const Vec w = spread<GS / U>(load<Vec>(&scales[r][u * U / GS]),
                                           std::make_index_sequence<W>{});
              store_vec(&combined[r][m][u], w * load<Vec>(xs + u));
            }
          }
        }
      },
      [&](int r, int c, int in_chunk, Bits block, const float*, Vec(&acc)[M])
          __attribute__((always_inline)) {
        const Bits even = block & 0x0f0f0f0fu, odd = (block >> 4) & 0x0f0f0f0fu;
        for (int m = 0; m < M; ++m) {
          const uint8_t* xb = bytes + m * int64_t{row_floats} * 4 + c;
          const Ints dot = dot_codes_s8(even, load<Bits>(xb), odd, load<Bits>(xb + 4 * W));
          acc[m] += __builtin_convertvector(dot, Vec) *
                    block_scales<U, kBlock, 8>(&combined[r][m][in_chunk / U]);
        }
      });
}
#endif

// codes . x over one block, in two partial sums (even and odd code positions) so that the FMA
// chain is half as long: with one, 4-bit M=1 read 10.4 GB/s (latency: 8 dependent FMAs a row).
template <int BITS, size_t... J>
ATTN_ALWAYS_INLINE Vec block_dot(Bits words, const float* x, std::index_sequence<J...>) {
  Vec even{}, odd{};
  (((J % 2 == 0 ? even : odd) += codes_at<BITS, J>(words) * load<Vec>(x + J * W)), ...);
  return even + odd;
}

template <typename T, int BITS, int GS, int M, int R>
ATTN_ALWAYS_INLINE void quantized_rows(const LinearProblem& p, const float* x, int row_floats,
                                       int n) {
  constexpr int P = kPerWord<BITS>;
  quantized_tile<T, BITS, GS, P * W, M, R>(
      p, x, row_floats, n, [](int, int, const ChunkScales*) {},
      [&](int, int c, int in_chunk, Bits block, const float* scales, Vec(&acc)[M])
          __attribute__((always_inline)) {
        const Vec scale = block_scales<GS, P * W, P>(scales + in_chunk / GS);
        for (int m = 0; m < M; ++m) {
          acc[m] += scale * block_dot<BITS>(block, x + m * row_floats + c,
                                            std::make_index_sequence<P>{});
        }
      });
}

template <typename T, int BITS, int GS, int M>
void quantized_columns(const LinearProblem& p, const float* x, int row_floats, int begin, int end) {
  // Registers: M accumulators per weight row; the words, a vector of codes, a slice of x, the
  // scales and M inner sums.
  constexpr int R = tile_rows(M, 4 + M);
  int n = begin;
#if defined(ATTN_CPU_S8_DOT)
  if constexpr (BITS == 4 && !__is_same(T, float)) {
    for (; n + R <= end; n += R) quantized_rows_s8<T, GS, M, R>(p, x, row_floats, n);
    for (; n < end; ++n) quantized_rows_s8<T, GS, M, 1>(p, x, row_floats, n);
    return;
  }
#endif
  for (; n + R <= end; n += R) quantized_rows<T, BITS, GS, M, R>(p, x, row_floats, n);
  for (; n < end; ++n) quantized_rows<T, BITS, GS, M, 1>(p, x, row_floats, n);
}

// ---- Preparing x ---------------------------------------------------------------------------

size_t prepared_floats(const LinearProblem& p) {
  const size_t floats = p.bits ? s8_scales_at(p) : p.inputs;
  // The int8 path adds its x scales and 8 W bytes per block of 8 W codes, then room for a chunk's
  // vectors of x scales read past the last (at most 4 W units a chunk, + W).
  const size_t used = uses_s8(p) ? s8_bytes_at(p) + quantized_main(p) / 4 + 5 * W : floats;
  // Rows a whole number of cache lines apart, and never a multiple of 4 KB: rows 4 KB apart
  // (K = 1024, 2048, ...) share their L1 sets, and 8 rows of x with the weights' stream evict
  // one another (Zen 3's L1 has 8 ways).
  const size_t line = 16, padded = (used + line - 1) / line * line;
  return padded % 1024 == 0 ? padded + line : padded;
}

// The low bytes of the even lanes of q, then of the odd lanes: the int8 values of W consecutive x
// in the int8 path's order, where byte i of a word vector holds codes 2 i and 2 i + 1.
using Quarter = int8_t __attribute__((vector_size(W)));
template <size_t... I>
ATTN_ALWAYS_INLINE Quarter evens_then_odds(Ints q, std::index_sequence<I...>) {
  using IntBytes = int8_t __attribute__((vector_size(4 * W)));
  constexpr int half = sizeof...(I) / 2;
  return __builtin_shufflevector((IntBytes)q, (IntBytes)q,
                                 (4 * (I < half ? 2 * I : 2 * (I - half) + 1))...);
}

// x's main part rounded to int8 (a scale per U = s8_unit values: max |x| / 127) in the int8
// path's layout: per block of 8 W values the even ones' int8 values, then the odd ones'. Rounding
// is to nearest even, as rintf: adding and subtracting 1.5 * 2^23 does it exactly for
// |x / d| <= 127.
template <typename T>
void prepare_s8(const LinearProblem& p, const T* x, float* x_scales, uint8_t* bytes) {
  const int main = quantized_main(p), unit = s8_unit(p.group_size);
  for (int u = 0; u < main; u += unit) {
    Vec top{};
    for (int i = u; i < u + unit; i += W) {
      const Vec magnitude = (Vec)((Bits)load_floats(x + i, W) & 0x7fffffffu);
      top = magnitude > top ? magnitude : top;
    }
    float t = 0.0f;
    for (int l = 0; l < W; ++l) t = top[l] > t ? top[l] : t;
    const float d = t > 0.0f ? t / 127.0f : 1.0f;
    x_scales[u / unit] = d;
    for (int i = u; i < u + unit; i += W) {
      const Vec rounded = (load_floats(x + i, W) / d + 0x1.8p23f) - 0x1.8p23f;
      const Quarter q = evens_then_odds(__builtin_convertvector(rounded, Ints),
                                        std::make_index_sequence<W>{});
      const int block = i / (8 * W) * (8 * W), at = (i - block) / 2;
      __builtin_memcpy(bytes + block + at, &q, W / 2);
      __builtin_memcpy(bytes + block + 4 * W + at, reinterpret_cast<const int8_t*>(&q) + W / 2,
                       W / 2);
    }
  }
}

template <typename T, int BITS, size_t... J>
void prepare_block(const T* x, float* dst, std::index_sequence<J...>) {
  constexpr int P = kPerWord<BITS>;
  ((
       [&] {
         for (int l = 0; l < W; ++l) {
           dst[J * W + l] = to_float(x[P * l + J]) * code_scale<BITS, J>();
         }
       }()),
   ...);
}

// One row of x (T: its element type, or float for a SwiGLU's hidden row) into dst.
template <typename T>
void prepare_row(const LinearProblem& p, const T* x, float* dst) {
  const int K = p.inputs;
  int main = 0;
  if (p.bits == 0) {
    main = dense_main(p);
    for (int k = 0; k < main; ++k) dst[accumulator_index(k, p.dtype, W)] = to_float(x[k]);
  } else if (uses_s8(p)) {
    prepare_s8(p, x, dst + s8_scales_at(p), reinterpret_cast<uint8_t*>(dst + s8_bytes_at(p)));
    main = 0;  // x as floats in natural order throughout (the tail reads it)
  } else {
    main = quantized_main(p);
    const int block = block_values(p);
    for (int c = 0; c < main; c += block) {
      if (p.bits == 4) {
        prepare_block<T, 4>(x + c, dst + c, std::make_index_sequence<8>{});
      } else {
        prepare_block<T, 8>(x + c, dst + c, std::make_index_sequence<4>{});
      }
    }
  }
  int k = main;
  for (; k + W <= K; k += W) store_vec(dst + k, load_floats(x + k, W));
  for (; k < K; ++k) dst[k] = to_float(x[k]);
  if (p.bits) {
    for (int g = 0; g < K / p.group_size; ++g) {
      Vec sum{};
      for (int i = g * p.group_size; i < (g + 1) * p.group_size; i += W) {
        sum += load_floats(x + i, W);
      }
      dst[group_sums_at(p) + g] = lane_sum(sum);
    }
    fill(dst + K + K / p.group_size, dst + s8_scales_at(p), 0.0f);
  }
}

// silu(g) = g / (1 + e^-g), from e^-|g| (never overflows): g / (1 + e) for g >= 0, g e / (1 + e)
// below. NaN stays NaN; -inf gives NaN, as MLX's silu (-inf times sigmoid's 0).
ATTN_ALWAYS_INLINE Vec silu(Vec g) {
  const Vec e = exp_nonpositive_lanes((Vec)((Bits)g | 0x80000000u));
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

// Lanes rounded to T (to nearest even) and widened back: the values an op's output in T holds.
template <typename T>
ATTN_ALWAYS_INLINE Vec rounded_to(Vec v) {
  if constexpr (__is_same(T, BFloat16)) {
    const Bits u = (Bits)v;
    return v == v ? (Vec)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u) : v;
  } else if constexpr (__is_same(T, Float16)) {
    for (int l = 0; l < W; ++l) {  // float16 models are rare on CPUs: lane by lane
      T t;
      store(&t, v[l]);
      v[l] = to_float(t);
    }
  }
  return v;
}

// A row of a SwiGLU's hidden layer, silu(gate) * x over K values: in float32, rounded once to x's
// dtype as the separate op's output would be (greedy tokens stay those of the unfused layers:
// float32 hidden values flipped near-ties of 4- and 8-bit Qwen3-0.6B within 30 tokens).
template <typename T>
void swiglu_row(const T* gate, const T* x, int K, float* hidden) {
  int k = 0;
  for (; k + W <= K; k += W) {
    store_vec(hidden + k, rounded_to<T>(silu(load_floats(gate + k, W)) * load_floats(x + k, W)));
  }
  if (k < K) {
    const Vec tail = rounded_to<T>(silu(load_floats(gate + k, K - k)) * load_floats(x + k, K - k));
    __builtin_memcpy(hidden + k, &tail, (K - k) * sizeof(float));
  }
}

// Row m of x into prepared + m * row_floats; rows from p.rows up to `bucket_rows` are zeros. With
// a gate, each row's silu(gate) * x passes through the row after the bucket's (scratch) first.
template <typename T>
void prepare_rows(const LinearProblem& p, float* prepared, int bucket_rows) {
  const int row_floats = static_cast<int>(prepared_floats(p));
  float* const hidden = prepared + bucket_rows * row_floats;
  for (int m = 0; m < bucket_rows; ++m) {
    float* dst = prepared + m * row_floats;
    if (m >= p.rows) {
      fill(dst, dst + row_floats, 0.0f);
    } else if (p.gate) {
      swiglu_row(static_cast<const T*>(p.gate) + m * p.gate_row_stride,
                 static_cast<const T*>(p.x) + m * p.x_row_stride, p.inputs, hidden);
      prepare_row(p, static_cast<const float*>(hidden), dst);
    } else {
      prepare_row(p, static_cast<const T*>(p.x) + m * p.x_row_stride, dst);
    }
  }
}

void prepare(const LinearProblem& p, float* prepared) {
  const int rows = bucket(p.rows);
  switch (p.dtype) {
    case ElementType::float32: return prepare_rows<float>(p, prepared, rows);
    case ElementType::float16: return prepare_rows<Float16>(p, prepared, rows);
    case ElementType::bfloat16: return prepare_rows<BFloat16>(p, prepared, rows);
    case ElementType::boolean: return;  // rejected by the op
  }
}

// ---- Dispatch ------------------------------------------------------------------------------

template <typename T, int M>
void columns_for(const LinearProblem& p, const float* x, int begin, int end) {
  const int row_floats = static_cast<int>(prepared_floats(p));
  if (p.bits == 0) return dense_columns<T, M>(p, x, row_floats, begin, end);
  const int key = p.bits * 1000 + p.group_size;
  switch (key) {
    case 4032: return quantized_columns<T, 4, 32, M>(p, x, row_floats, begin, end);
    case 4064: return quantized_columns<T, 4, 64, M>(p, x, row_floats, begin, end);
    case 4128: return quantized_columns<T, 4, 128, M>(p, x, row_floats, begin, end);
    case 8032: return quantized_columns<T, 8, 32, M>(p, x, row_floats, begin, end);
    case 8064: return quantized_columns<T, 8, 64, M>(p, x, row_floats, begin, end);
    case 8128: return quantized_columns<T, 8, 128, M>(p, x, row_floats, begin, end);
    default: return;  // rejected by the op
  }
}

template <typename T>
void columns_typed(const LinearProblem& p, const float* x, int begin, int end) {
  switch (bucket(p.rows)) {
    case 1: return columns_for<T, 1>(p, x, begin, end);
    case 2: return columns_for<T, 2>(p, x, begin, end);
    case 4: return columns_for<T, 4>(p, x, begin, end);
    default: return columns_for<T, 8>(p, x, begin, end);
  }
}

void columns(const LinearProblem& p, const float* prepared, int begin, int end) {
  switch (p.dtype) {
    case ElementType::float32: return columns_typed<float>(p, prepared, begin, end);
    case ElementType::float16: return columns_typed<Float16>(p, prepared, begin, end);
    case ElementType::bfloat16: return columns_typed<BFloat16>(p, prepared, begin, end);
    case ElementType::boolean: return;
  }
}

}  // namespace
}  // namespace ATTN_CPU_PATH

LinearKernel ATTN_CONCAT(linear_kernel_, ATTN_CPU_PATH)() {
  return {ATTN_CPU_PATH::prepared_floats, ATTN_CPU_PATH::prepare, ATTN_CPU_PATH::columns};
}

}  // namespace attn_kernels::cpu
