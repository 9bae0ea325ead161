// The CPU kernel over a quantized cache (mx.quantize triples: value = scale * code + bias per
// group), part of the kernel body (cpu_kernel_body.h includes it; the same path, width and
// flags). It walks a key/value row's positions as the float kernel does and shares its blocks:
// each block of kBlock positions is dequantised once into an L1-resident float block, which
// block_scores and block_accumulate read as they read converted rows, for every query vector
// of the group; so each code byte is read once per call and nothing is wider than the
// registers (16-lane vectors on AVX2 spilled: the kernel took 10-12x the bf16 kernel's time).
//
// 4-bit rows stay in the order of their bytes: byte i holds codes 2i (low nibble) and 2i + 1,
// so W bytes widen to the even dimensions of a pair of vectors and then the odd ones, the order
// the float kernel keeps bf16 rows in (accumulator_index): no shuffles, and the split's merge
// reorders the output as it does for bf16. 8-bit rows keep their order.

namespace attn_kernels::cpu {
namespace ATTN_CPU_PATH {
namespace {

static_assert(kPair <= 32, "a pair of vectors must lie in one quantization group (>= 32)");
constexpr int kMaxQuantizedWords = kMaxHeadDim * 8 / 32;  // a row's uint32 codes at 8 bits

using CodeBytes = uint8_t __attribute__((vector_size(W)));
using CodeShorts = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));
using CodeInts = int32_t __attribute__((vector_size(W * sizeof(int32_t))));

// W bytes at p as W int32 lanes. x86 in one instruction (vpmovzxbd): GCC 12 builds the generic
// conversions from scalar byte extracts and inserts (perf: a 4-bit call at S = 8192 spent most of
// its time there on AVX2); other targets widen step by step (u8 -> u16 -> i32), which GCC keeps
// in vector instructions.
ATTN_ALWAYS_INLINE CodeInts widen_codes(const uint8_t* p) {
#if defined(__AVX2__) && ATTN_CPU_WIDTH == 8
  return (CodeInts)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX512F__) && ATTN_CPU_WIDTH == 16
  // The unmasked form warns (-Wmaybe-uninitialized) in GCC 12.
  return (CodeInts)_mm512_maskz_cvtepu8_epi32(
      0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(__builtin_convertvector(load<CodeBytes>(p), CodeShorts),
                                 CodeInts);
#endif
}

// Where a dimension of a quantized row sits in the kernel's accumulators.
ATTN_ALWAYS_INLINE ElementType quantized_order(int bits) {
  return bits == 4 ? ElementType::bfloat16 : ElementType::float32;
}

// One of keys or values of one key/value row: codes, scales and biases with their strides.
template <typename T, int Bits>
struct QuantizedRows {
  const uint32_t* codes;
  const T* scales;
  const T* biases;
  int64_t code_row, code_step, scale_row, scale_step, bias_row, bias_step;
  int group_size;

  // Position j's row of D values (D % 32 == 0) as floats into dst, in quantized_order.
  ATTN_ALWAYS_INLINE void dequantize(int j, float* dst, int D) const {
    const uint32_t* words = codes + j * code_row;
    uint32_t gathered[kMaxQuantizedWords];
    if (code_step != 1) {  // codes whose last axis is strided (tests): gathered first
      for (int i = 0; i < D * Bits / 32; ++i) gathered[i] = words[i * code_step];
      words = gathered;
    }
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
    const T* s = scales + j * scale_row;
    const T* b = biases + j * bias_row;
    // Group by group: one scale and bias broadcast per group (per pair of vectors, their loads
    // and broadcasts were about half of this loop's instructions).
    for (int d0 = 0, g = 0; d0 < D; ++g) {
      const Vec scale = Vec{} + to_float(s[g * scale_step]);
      const Vec bias = Vec{} + to_float(b[g * bias_step]);
      for (const int group_end = d0 + group_size; d0 < group_end; d0 += kPair) {
        CodeInts first, second;
        if constexpr (Bits == 8) {
          first = widen_codes(bytes + d0);
          second = widen_codes(bytes + d0 + W);
        } else {  // the low nibbles (even dimensions), then the high ones
          const CodeInts packed = widen_codes(bytes + d0 / 2);
          first = packed & 15;
          second = packed >> 4;
        }
        store_vec(dst + d0, __builtin_convertvector(first, Vec) * scale + bias);
        store_vec(dst + d0 + W, __builtin_convertvector(second, Vec) * scale + bias);
      }
    }
  }

  // Positions j0..j0+n into rows of D floats. `ahead`: also prefetch the codes kPrefetchRows on
  // (8 bits, one thread, S = 8192: 0.78x the time; 4 bits about even).
  ATTN_ALWAYS_INLINE void dequantize_block(int j0, int n, float* block, int D, bool ahead) const {
    for (int j = 0; j < n; ++j) {
      if (ahead) {
        const uint32_t* next = codes + (j0 + j + kPrefetchRows) * code_row;
        const auto* row = reinterpret_cast<const char*>(next);
        for (int byte = 0; byte < D * Bits / 8; byte += 64) prefetch_to_l2(row + byte);
      }
      dequantize(j0 + j, block + j * D, D);
    }
  }
};

template <typename T, int Bits>
ATTN_ALWAYS_INLINE QuantizedRows<T, Bits> quantized_rows(const QuantizedProblem& p, int kv_row,
                                                         const uint32_t* codes, const void* scales,
                                                         const void* biases,
                                                         const int64_t (&strides)[3][4]) {
  return {codes + p.kv_offset(strides[0], kv_row),
          static_cast<const T*>(scales) + p.kv_offset(strides[1], kv_row),
          static_cast<const T*>(biases) + p.kv_offset(strides[2], kv_row),
          strides[0][2], strides[0][3], strides[1][2], strides[1][3], strides[2][2], strides[2][3],
          p.group_size};
}

size_t quantized_scratch_floats(const QuantizedProblem& p) {
  const size_t vectors = static_cast<size_t>(p.group) * p.query_len, D = p.head_dim;
  return vectors * D + 2 * kBlock * D + vectors * kBlock + vectors;
}

// Key/value row kv_row, positions [begin, end), every query vector of its group, as the float
// kernel's attend_chunk with dequantised blocks for rows.
template <typename T, int Bits>
ATTN_ALWAYS_INLINE void attend_quantized_chunk(const QuantizedProblem& p, int kv_row, int begin,
                                               int end, float* state, float* scratch) {
  const int D = p.head_dim, vectors = p.group * p.query_len, state_size = D + kStateHeader;
  float* queries = scratch;  // vectors x D, quantized_order
  float* keys_block = queries + vectors * D;
  float* values_block = keys_block + kBlock * D;
  float* scores = values_block + kBlock * D;  // vectors x kBlock, then weights in place
  float* rescale = scores + vectors * kBlock;
  start_vectors<T>(p, kv_row, D, quantized_order(Bits), queries, state, state_size);

  const CacheRange range = p.range(kv_row / p.kv_heads);
  begin = begin > range.start ? begin : range.start;
  end = end < range.end ? end : range.end;
  const auto keys =
      quantized_rows<T, Bits>(p, kv_row, p.k_codes, p.k_scales, p.k_biases, p.k_strides);
  const auto values =
      quantized_rows<T, Bits>(p, kv_row, p.v_codes, p.v_scales, p.v_biases, p.v_strides);
  const float* no_prefetch = nullptr;  // the blocks' rows are in L1; the codes prefetch below
  const ScratchRows key_rows{keys_block, D}, value_rows{values_block, D};
  for (int j0 = begin; j0 < end; j0 += kBlock) {
    const int n = end - j0 < kBlock ? end - j0 : kBlock;
    // Full blocks prefetch the rows two blocks on while those are in this chunk (contiguous codes).
    const bool ahead = n == kBlock && j0 + kPrefetchRows + kBlock <= end;
    keys.dequantize_block(j0, n, keys_block, D, ahead && keys.code_step == 1);
    block_scores(queries, vectors, D, key_rows, n, p.scale, no_prefetch, 0, D, scores);
    if (!block_softmax(p, range, kv_row, j0, n, scores, rescale, state, state_size)) {
      continue;
    }
    values.dequantize_block(j0, n, values_block, D, ahead && values.code_step == 1);
    if (n == kBlock) {
      block_accumulate<kBlock>(scores, rescale, value_rows, n, no_prefetch, 0, state, vectors,
                               state_size, D);
    } else {
      block_accumulate<0>(scores, rescale, value_rows, n, no_prefetch, 0, state, vectors,
                          state_size, D);
    }
  }
}

template <typename T>
ATTN_ALWAYS_INLINE void attend_quantized_dtype(const QuantizedProblem& p, int kv_row, int begin,
                                               int end, float* state, float* scratch) {
  if (p.bits == 8) {
    attend_quantized_chunk<T, 8>(p, kv_row, begin, end, state, scratch);
  } else {
    attend_quantized_chunk<T, 4>(p, kv_row, begin, end, state, scratch);
  }
}

void attend_quantized(const QuantizedProblem& p, int kv_row, int begin, int end, float* state,
                      float* scratch) {
  switch (p.dtype) {
    case ElementType::float32:
      return attend_quantized_dtype<float>(p, kv_row, begin, end, state, scratch);
    case ElementType::float16:
      return attend_quantized_dtype<Float16>(p, kv_row, begin, end, state, scratch);
    case ElementType::bfloat16:
      return attend_quantized_dtype<BFloat16>(p, kv_row, begin, end, state, scratch);
    case ElementType::boolean: return;  // rejected by the op
  }
}

}  // namespace
}  // namespace ATTN_CPU_PATH
}  // namespace attn_kernels::cpu
