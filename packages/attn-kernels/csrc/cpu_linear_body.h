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

ATTN_ALWAYS_INLINE float lane_sum(Vec v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
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
  Vec acc[R][M] = {};
  for (int c = 0; c < main; c += kDenseStep) {
    Pair wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen(w + int64_t{r} * K + c);
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
template <typename T, int BITS, int GS>
ATTN_ALWAYS_INLINE Vec block_scales(const T* scales) {
  constexpr int lanes_per_group = GS / kPerWord<BITS>;
  if constexpr (lanes_per_group >= W) {
    return Vec{} + to_float(scales[0]);
  } else {
    return spread<lanes_per_group>(load_floats(scales, W / lanes_per_group),
                                   std::make_index_sequence<W>{});
  }
}

// The end of R quantized rows: the accumulators' lanes summed, the codes past the last whole
// block (against x in natural order, unscaled, at x + m * row_floats), the biases against the
// group sums of x (at + K), the bias; stored.
template <typename T, int BITS, int GS, int M, int R>
ATTN_ALWAYS_INLINE void quantized_tail(const LinearProblem& p, const float* x, int row_floats,
                                       int n, int main, const Vec (&acc)[R][M]) {
  constexpr int P = kPerWord<BITS>;
  const int K = p.inputs, groups = K / GS, words = K / P;
  const uint32_t* codes = static_cast<const uint32_t*>(p.weight) + int64_t{n} * words;
  const T* scales = static_cast<const T*>(p.scales) + int64_t{n} * groups;
  const T* biases = static_cast<const T*>(p.biases) + int64_t{n} * groups;
  float sums[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * row_floats;
      float s = lane_sum(acc[r][m]);
      for (int k = main; k < K; ++k) {
        const uint32_t word = codes[int64_t{r} * words + k / P];
        const uint32_t code = (word >> (BITS * (k % P))) & ((1u << BITS) - 1);
        s += to_float(scales[int64_t{r} * groups + k / GS]) * static_cast<float>(code) * xm[k];
      }
      sums[r][m] = s + dot(biases + int64_t{r} * groups, xm + K, groups);
    }
  }
  for (int r = 0; r < R; ++r) store_row_sums<T>(p, n, r, p.rows, &sums[r][0], 1);
}

// ---- Quantized weights, 4-bit, against int8 activations (x86) ------------------------------
//
// With bf16 or f16 x, 4-bit codes meet x rounded to int8 (a scale per 32 values: max |x| / 127)
// in the integer dot product of x86 (vpmaddubsw: 32 code-by-int8 products summed in pairs, then
// vpmaddwd to 32-bit sums): ~13 operations a block of 8 W codes against ~30 for the float path
// (an AND, a conversion and an FMA per vector of codes). Measured on one Zen 3 core, Qwen3-4B's
// gate/up 4-bit: 10.3 against 5.9 GB/s. The rounding of x adds at most sum |w| * scale / 2 to an
// output, of the order of the output's own bf16 rounding (and below MLX's own bf16 path, which
// accumulates in bf16). float32 x keeps the float path (exact to float32 accumulation).
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

constexpr int kS8Block = 32;  // x values per int8 scale

bool uses_s8(const LinearProblem& p) {
#if defined(ATTN_CPU_S8_DOT)
  return p.bits == 4 && p.dtype != ElementType::float32;
#else
  (void)p;
  return false;
#endif
}

#if defined(ATTN_CPU_S8_DOT)
// A prepared row of the int8 path: x as floats (natural order: the tail), the group sums, then
// per block of 8 W codes W lane scales (lane l: the int8 scale of codes 8 l .. 8 l + 7) and the
// block's int8 values, the even codes' x then the odd codes' (byte i of a word vector holds codes
// 2 i and 2 i + 1).
template <typename T, int GS, int M, int R>
ATTN_ALWAYS_INLINE void quantized_rows_s8(const LinearProblem& p, const float* x, int row_floats,
                                          int n) {
  constexpr int kBlock = 8 * W;
  const int K = p.inputs, groups = K / GS, main = quantized_main(p), words = K / 8;
  const uint32_t* codes = static_cast<const uint32_t*>(p.weight) + int64_t{n} * words;
  const T* scales = static_cast<const T*>(p.scales) + int64_t{n} * groups;
  Vec acc[R][M] = {};
  for (int c = 0; c < main; c += kBlock) {
    for (int r = 0; r < R; ++r) {
      const Bits block = load<Bits>(codes + int64_t{r} * words + c / 8);
      const Bits even = block & 0x0f0f0f0fu, odd = (block >> 4) & 0x0f0f0f0fu;
      const Vec scale = block_scales<T, 4, GS>(scales + int64_t{r} * groups + c / GS);
      for (int m = 0; m < M; ++m) {
        const float* lanes = x + m * row_floats + K + groups;  // then the bytes
        const auto* bytes = reinterpret_cast<const uint8_t*>(lanes + main / 8) + c;
        const Ints dot = dot_codes_s8(even, load<Bits>(bytes), odd, load<Bits>(bytes + 4 * W));
        acc[r][m] += __builtin_convertvector(dot, Vec) * (scale * load<Vec>(lanes + c / 8));
      }
    }
  }
  quantized_tail<T, 4, GS, M, R>(p, x, row_floats, n, main, acc);
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
  constexpr int P = kPerWord<BITS>, kBlock = P * W;
  const int K = p.inputs, groups = K / GS, main = quantized_main(p), words = K / P;
  const uint32_t* codes = static_cast<const uint32_t*>(p.weight) + int64_t{n} * words;
  const T* scales = static_cast<const T*>(p.scales) + int64_t{n} * groups;
  Vec acc[R][M] = {};
  for (int c = 0; c < main; c += kBlock) {
    for (int r = 0; r < R; ++r) {
      const Bits block = load<Bits>(codes + int64_t{r} * words + c / P);
      const Vec scale = block_scales<T, BITS, GS>(scales + int64_t{r} * groups + c / GS);
      for (int m = 0; m < M; ++m) {
        const Vec inner =
            block_dot<BITS>(block, x + m * row_floats + c, std::make_index_sequence<P>{});
        acc[r][m] += scale * inner;
      }
    }
  }
  quantized_tail<T, BITS, GS, M, R>(p, x, row_floats, n, main, acc);
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
  const size_t floats = p.inputs + (p.bits ? p.inputs / p.group_size : 0);
  // The int8 path adds W lane scales and 8 W bytes per block of 8 W codes.
  return uses_s8(p) ? floats + quantized_main(p) / 8 + quantized_main(p) / 4 : floats;
}

// x's main part rounded to int8 (a scale per kS8Block values) in the int8 path's layout.
template <typename T>
void prepare_s8(const LinearProblem& p, const T* x, float* lanes, uint8_t* bytes) {
  const int main = quantized_main(p);
  float block_scale[8 * W / kS8Block];
  for (int c = 0; c < main; c += 8 * W) {
    for (int b = 0; b < 8 * W / kS8Block; ++b) {
      float top = 0.0f;
      for (int k = 0; k < kS8Block; ++k) {
        top = __builtin_fmaxf(top, __builtin_fabsf(to_float(x[c + b * kS8Block + k])));
      }
      const float d = top > 0.0f ? top / 127.0f : 1.0f;
      block_scale[b] = d;
      for (int k = 0; k < kS8Block; ++k) {
        const int at = b * kS8Block + k;  // even codes' x first, then odd codes'
        const float q = __builtin_rintf(to_float(x[c + at]) / d);
        bytes[c + (at % 2) * 4 * W + at / 2] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
    }
    for (int l = 0; l < W; ++l) lanes[c / 8 + l] = block_scale[8 * l / kS8Block];
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

// Row m of x into prepared + m * row_floats; rows from p.rows up to `bucket_rows` are zeros.
template <typename T>
void prepare_rows(const LinearProblem& p, float* prepared, int bucket_rows) {
  const int K = p.inputs, row_floats = static_cast<int>(prepared_floats(p));
  for (int m = 0; m < bucket_rows; ++m) {
    float* dst = prepared + m * row_floats;
    if (m >= p.rows) {
      fill(dst, dst + row_floats, 0.0f);
      continue;
    }
    const T* x = static_cast<const T*>(p.x) + m * p.x_row_stride;
    int main = 0;
    if (p.bits == 0) {
      main = dense_main(p);
      for (int k = 0; k < main; ++k) dst[accumulator_index(k, p.dtype, W)] = to_float(x[k]);
    } else if (uses_s8(p)) {
      prepare_s8(p, x, dst + K + K / p.group_size,
                 reinterpret_cast<uint8_t*>(dst + K + K / p.group_size + quantized_main(p) / 8));
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
    for (int k = main; k < K; ++k) dst[k] = to_float(x[k]);
    if (p.bits) {
      for (int g = 0; g < K / p.group_size; ++g) {
        float s = 0.0f;
        for (int k = g * p.group_size; k < (g + 1) * p.group_size; ++k) s += to_float(x[k]);
        dst[K + g] = s;
      }
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
