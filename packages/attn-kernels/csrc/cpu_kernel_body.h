// The CPU kernel body, written once in GCC/Clang vector extensions and compiled once per
// instruction set: cpu_kernel_<path>.cpp defines ATTN_CPU_PATH (the namespace and kernel_<path>
// function), ATTN_CPU_WIDTH (floats per vector register) and ATTN_CPU_SCORE_POSITIONS (key
// positions scored at once), then includes this file; CMake gives each its target flags.
//
// Per key/value row, all of its query vectors walk the cache once, kBlock positions at a time,
// with a running max, denominator and float32 accumulator (online softmax). K and V rows are
// read straight from the cache and widened in registers (bf16: a shift and a mask, no shuffles;
// f16: the hardware conversion), so every byte is read once and nothing is copied; so are rows
// whose last pair is half full (head dim 80 on AVX-512). Other rows that are strided or of a
// length that is not a multiple of a vector pair are converted into scratch first (tests, odd
// head dims).
//
// Everything here is internal (anonymous namespace) or a builtin, never a standard-library
// template: a template instantiated in files compiled for different instruction sets is one weak
// symbol after linking, and the linker may keep the AVX-512 copy for the portable path.
#include <utility>

#include "cpu_kernel.h"
#include "cpu_vector.h"

#if !defined(ATTN_CPU_PATH) || !defined(ATTN_CPU_WIDTH) || !defined(ATTN_CPU_SCORE_POSITIONS)
#error "define ATTN_CPU_PATH, ATTN_CPU_WIDTH and ATTN_CPU_SCORE_POSITIONS before including"
#endif

namespace attn_kernels::cpu {
namespace ATTN_CPU_PATH {
namespace {

constexpr int kPair = 2 * W;  // head-dimension values per step: one pair of vectors
// Positions per online-softmax step: one block max, one rescale of the accumulators.
constexpr int kBlock = 16;
// Query vectors that share each widened slice of K or V (then tiles of 2 and 1).
constexpr int kTile = 4;
// Key positions scored at once: kTile * J accumulators plus J widened keys stay in registers.
constexpr int J = ATTN_CPU_SCORE_POSITIONS;
static_assert(kBlock % J == 0 && kBlock % W == 0 && (kTile * J) % W == 0);

constexpr int kPrefetchRows = 2 * kBlock;

// Rows as the score and accumulate loops see them: pair c of row j.
template <typename T>
struct CacheRows {  // contiguous rows in the cache, widened in registers
  const T* data;
  int64_t stride;
  ATTN_ALWAYS_INLINE Pair at(int j, int c) const { return widen(data + j * stride + c * kPair); }
};
struct ScratchRows {  // rows converted to floats, already in accumulator_index order
  const float* data;
  int stride;
  ATTN_ALWAYS_INLINE Pair at(int j, int c) const {
    return widen(data + j * stride + c * kPair);
  }
};
// Contiguous rows whose last pair is half full (head dim 80 on AVX-512: 2.5 pairs), all read
// from the cache. Converting such rows into scratch took D = 80 to 1.8-4.9x mx.fast where the
// sweep's other head dims ran 5-95x.
template <typename T>
struct HalfTailRows {
  const T* data;
  int64_t stride;
  int whole;  // full pairs
  ATTN_ALWAYS_INLINE Pair at(int j, int c) const {
    const T* row = data + j * stride + c * kPair;
    return c < whole ? widen(row) : widen_half(row);
  }
};

// A row of n elements with element stride `stride` as floats in accumulator_index order,
// zero-padded to n_padded.
template <typename T>
void convert_row(float* dst, const T* src, int n, int n_padded, int64_t stride, ElementType dtype) {
  fill(dst, dst + n_padded, 0.0f);
  for (int d = 0; d < n; ++d) {
    dst[accumulator_index(d, dtype, W)] = to_float(src[d * stride]);
  }
}

// Transpose-sum: W vectors in, one out whose lane i is the sum of the lanes of vector i.
// log2(W) levels of pairwise folds; a fold of group size G halves every group of G lanes of x
// and of y and packs them, x's into the low half of the result, y's into the high half.
constexpr int fold_source(int group, int lane) {
  const int half = W / 2, n = lane % half;
  return (lane < half ? 0 : W) + n / (group / 2) * group + n % (group / 2);
}
template <int G, size_t... L>
ATTN_ALWAYS_INLINE Vec fold(Vec x, Vec y, std::index_sequence<L...>) {
  return __builtin_shufflevector(x, y, fold_source(G, L)...) +
      __builtin_shufflevector(x, y, (fold_source(G, L) + G / 2)...);
}
template <int G>
ATTN_ALWAYS_INLINE void fold_levels(Vec* v, int n) {
  for (int i = 0; i < n / 2; ++i) {
    v[i] = fold<G>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>());
  }
  if constexpr (G > 2) {
    fold_levels<G / 2>(v, n / 2);
  }
}
ATTN_ALWAYS_INLINE Vec transpose_sum(Vec* v) {  // clobbers v
  fold_levels<W>(v, W);
  return v[0];
}

// Independent multiply-add chains a tile keeps going: two FMA pipes times a latency of ~4 cycles.
// A tile of R query vectors scores kChains / R positions at once (at least J) and accumulates
// kChains / (2R) pairs of the head dimension at once, so that a group of one or two (no GQA) is
// not bound by the latency of a few chains: with J positions and one pair at a time such tiles
// took 1.1-1.6x as long (dev/ab_cpu.cpp; docs/cpu-kernel.md, design choices).
constexpr int kChains = W > 8 ? W : 8;
template <int R>
constexpr int score_positions() {
  return R * J >= kChains ? J : kChains / R;
}

// Scores of R query vectors (q: R rows of Dp floats) against P positions j0.. of `keys`, times
// scale, into scores[r * kBlock + j0 + jj]. The R x P partial sums stay in registers over the
// head dimension, then transpose-sums. Whichever of the keys and the query vectors is fewer is
// held in registers across the other.
template <int R, typename Rows>
ATTN_ALWAYS_INLINE void score_tile(const float* q, int Dp, const Rows& keys, int j0, float* scores,
                                   float scale) {
  constexpr int P = score_positions<R>(), N = R * P, Groups = (N + W - 1) / W;
  Vec acc[Groups * W] = {};
  for (int c = 0; c < Dp / kPair; ++c) {
    if constexpr (P <= R) {
      Pair k[P];
      for (int jj = 0; jj < P; ++jj) {
        k[jj] = keys.at(j0 + jj, c);
      }
      for (int r = 0; r < R; ++r) {
        const Pair qv = widen(q + r * Dp + c * kPair);
        for (int jj = 0; jj < P; ++jj) {
          acc[r * P + jj] += qv.a * k[jj].a;
          acc[r * P + jj] += qv.b * k[jj].b;
        }
      }
    } else {
      Pair qv[R];
      for (int r = 0; r < R; ++r) {
        qv[r] = widen(q + r * Dp + c * kPair);
      }
      for (int jj = 0; jj < P; ++jj) {
        const Pair k = keys.at(j0 + jj, c);
        for (int r = 0; r < R; ++r) {
          acc[r * P + jj] += qv[r].a * k.a;
          acc[r * P + jj] += qv[r].b * k.b;
        }
      }
    }
  }
  for (int g = 0; g < Groups; ++g) {
    const Vec total = transpose_sum(acc + g * W) * scale;
    for (int l = 0; l < W && g * W + l < N; ++l) {
      const int n = g * W + l;
      scores[n / P * kBlock + j0 + n % P] = total[l];
    }
  }
}

// Lines of the rows j0..j0+P of `ahead` (null: none), into L2.
template <int P, typename T>
ATTN_ALWAYS_INLINE void prefetch_rows(const T* ahead, int64_t stride, int j0, int D) {
  if (ahead == nullptr) return;
  for (int jj = 0; jj < P; ++jj) {
    const char* row = reinterpret_cast<const char*>(ahead + (j0 + jj) * stride);
    for (int b = 0; b < D * static_cast<int>(sizeof(T)); b += 64) {
      prefetch_to_l2(row + b);
    }
  }
}

// scores[r][j] of query vectors [r, r + R) for the n positions of a block, P at a time, then a
// partial block's last positions one at a time. The first tile prefetches.
template <int R, typename T, typename Rows>
ATTN_ALWAYS_INLINE void tile_scores(const float* q, int r, int Dp, const Rows& keys, int n,
                                    float scale, const T* ahead, int64_t stride, int D,
                                    float* scores) {
  constexpr int P = score_positions<R>();
  int j0 = 0;
  for (; j0 + P <= n; j0 += P) {
    if (r == 0) prefetch_rows<P>(ahead, stride, j0, D);
    score_tile<R>(q + r * Dp, Dp, keys, j0, scores + r * kBlock, scale);
  }
  for (; j0 < n; ++j0) {
    for (int t = r; t < r + R; ++t) {
      Vec acc[W] = {};
      for (int c = 0; c < Dp / kPair; ++c) {
        const Pair qv = widen(q + t * Dp + c * kPair), k = keys.at(j0, c);
        acc[0] += qv.a * k.a;
        acc[0] += qv.b * k.b;
      }
      scores[t * kBlock + j0] = transpose_sum(acc)[0] * scale;
    }
  }
}

// scores[r][j] for every query vector and the n positions of a block (keys: the block's rows):
// tiles of kTile query vectors, then of 2 and 1.
template <typename T, typename Rows>
ATTN_ALWAYS_INLINE void block_scores(const float* q, int vectors, int Dp, const Rows& keys, int n,
                                     float scale, const T* ahead, int64_t stride, int D,
                                     float* scores) {
  int r = 0;
  for (; r + kTile <= vectors; r += kTile) {
    tile_scores<kTile>(q, r, Dp, keys, n, scale, ahead, stride, D, scores);
  }
  if (r + 2 <= vectors) {
    tile_scores<2>(q, r, Dp, keys, n, scale, ahead, stride, D, scores);
    r += 2;
  }
  if (r < vectors) {
    tile_scores<1>(q, r, Dp, keys, n, scale, ahead, stride, D, scores);
  }
}

// acc_t = acc_t * rescale_t + sum_j weight[t][j] * v_j for T query vectors over C pairs of
// vectors of the head dimension from pair c0: T x C pairs of accumulators in registers, the
// positions in order; N positions (0: n at run time). `ahead`: the V rows two blocks on, whose
// lines of these pairs are prefetched as the same lines of this block are read.
template <int T, int C, int N, typename Elem, typename Rows>
ATTN_ALWAYS_INLINE void accumulate_pairs(const float* weights, const float* rescale,
                                         const Rows& values, int n, const Elem* ahead,
                                         int64_t stride, float* state, int state_size, int c0) {
  const int positions = N > 0 ? N : n;
  Vec a[T][C], b[T][C];
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < C; ++c) {
      const float* acc = state + t * state_size + kStateHeader + (c0 + c) * kPair;
      a[t][c] = load<Vec>(acc) * rescale[t];
      b[t][c] = load<Vec>(acc + W) * rescale[t];
    }
  }
  // The lines that begin within these pairs' bytes of a row (each line of a row once).
  constexpr int kPairBytes = kPair * sizeof(Elem);
  const int first_line = (c0 * kPairBytes + 63) / 64 * 64, end = (c0 + C) * kPairBytes;
#pragma GCC unroll 4
  for (int j = 0; j < positions; ++j) {
    if (ahead != nullptr) {
      const char* row = reinterpret_cast<const char*>(ahead + j * stride);
      for (int byte = first_line; byte < end; byte += 64) prefetch_to_l2(row + byte);
    }
    float w[T];
    for (int t = 0; t < T; ++t) w[t] = weights[t * kBlock + j];
    for (int c = 0; c < C; ++c) {
      const Pair v = values.at(j, c0 + c);
      for (int t = 0; t < T; ++t) {
        a[t][c] += w[t] * v.a;
        b[t][c] += w[t] * v.b;
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < C; ++c) {
      float* acc = state + t * state_size + kStateHeader + (c0 + c) * kPair;
      store_vec(acc, a[t][c]);
      store_vec(acc + W, b[t][c]);
    }
  }
}

// The pairs of the head dimension from pair c for T query vectors, C pairs at a time, the rest
// (a head dim such as 80) by halves.
template <int T, int C, int N, typename Elem, typename Rows>
ATTN_ALWAYS_INLINE void accumulate_tile_from(const float* weights, const float* rescale,
                                             const Rows& values, int n, const Elem* ahead,
                                             int64_t stride, float* state, int state_size, int Dp,
                                             int c) {
  for (; c + C <= Dp / kPair; c += C) {
    accumulate_pairs<T, C, N>(weights, rescale, values, n, ahead, stride, state, state_size, c);
  }
  if constexpr (C > 1) {
    accumulate_tile_from<T, C / 2, N>(weights, rescale, values, n, ahead, stride, state,
                                      state_size, Dp, c);
  }
}
template <int T, int N, typename Elem, typename Rows>
ATTN_ALWAYS_INLINE void accumulate_tile(const float* weights, const float* rescale,
                                        const Rows& values, int n, const Elem* ahead,
                                        int64_t stride, float* state, int state_size, int Dp) {
  constexpr int C = 2 * T >= kChains ? 1 : kChains / (2 * T);
  accumulate_tile_from<T, C, N>(weights, rescale, values, n, ahead, stride, state, state_size,
                                Dp, 0);
}

template <int N, typename Elem, typename Rows>
ATTN_ALWAYS_INLINE void block_accumulate(const float* weights, const float* rescale,
                                         const Rows& values, int n, const Elem* ahead,
                                         int64_t stride, float* state, int vectors, int state_size,
                                         int Dp) {
  int r = 0;
  for (; r + kTile <= vectors; r += kTile) {  // the first tile prefetches
    accumulate_tile<kTile, N>(weights + r * kBlock, rescale + r, values, n,
                              r == 0 ? ahead : nullptr, stride, state + r * state_size,
                              state_size, Dp);
  }
  if (r + 2 <= vectors) {
    accumulate_tile<2, N>(weights + r * kBlock, rescale + r, values, n, r == 0 ? ahead : nullptr,
                          stride, state + r * state_size, state_size, Dp);
    r += 2;
  }
  if (r < vectors) {
    accumulate_tile<1, N>(weights + r * kBlock, rescale + r, values, n, r == 0 ? ahead : nullptr,
                          stride, state + r * state_size, state_size, Dp);
  }
}

// A block's kBlock scores as kBlock / W native vectors (wider generic vectors were lowered to
// scalar code on the narrower targets).
constexpr int kBlockVecs = kBlock / W;

// Lane l of x swapped with lane l ^ H, for the horizontal reductions.
template <int H, size_t... L>
ATTN_ALWAYS_INLINE Vec swap_lanes(Vec x, std::index_sequence<L...>) {
  return __builtin_shufflevector(x, x, (static_cast<int>(L) ^ H)...);
}
ATTN_ALWAYS_INLINE Vec nan_max_vec(Vec x, Vec y) {
  return (x > y || x != x) ? x : y;
}
template <int H = W / 2>
ATTN_ALWAYS_INLINE float horizontal_max(Vec x) {
  x = nan_max_vec(x, swap_lanes<H>(x, std::make_index_sequence<W>()));
  if constexpr (H > 1) {
    return horizontal_max<H / 2>(x);
  } else {
    return x[0];
  }
}
template <int H = W / 2>
ATTN_ALWAYS_INLINE float horizontal_sum(Vec x) {
  x += swap_lanes<H>(x, std::make_index_sequence<W>());
  if constexpr (H > 1) {
    return horizontal_sum<H / 2>(x);
  } else {
    return x[0];
  }
}
// The largest of a block's scores; NaN if any is NaN.
ATTN_ALWAYS_INLINE float block_max(const Vec* s) {
  Vec m = s[0];
  for (int i = 1; i < kBlockVecs; ++i) m = nan_max_vec(m, s[i]);
  return horizontal_max(m);
}
// exp_nonpositive (cpu_scalar.h) on a vector.
ATTN_ALWAYS_INLINE Vec vec_exp(Vec x) {
  return exp_nonpositive_lanes(x);
}

// Element `at` of the explicit mask as an additive float (P: DecodeProblem or QuantizedProblem).
template <typename P>
ATTN_ALWAYS_INLINE float mask_value(const P& p, int64_t at) {
  switch (p.mask_kind) {
    case kMaskFloat32: return static_cast<const float*>(p.mask)[at];
    case kMaskFloat16: return to_float(static_cast<const Float16*>(p.mask)[at]);
    case kMaskBFloat16: return to_float(static_cast<const BFloat16*>(p.mask)[at]);
    case kMaskBool: return to_float(static_cast<const bool*>(p.mask)[at]);
  }
  return 0.0f;
}

// Query vectors of key/value row kv_row as floats in the accumulator order of `order` (unscaled:
// the scores are scaled), and their states emptied. Vector r is query position
// r % L of head row kv_row * group + r / L.
template <typename T, typename P>
ATTN_ALWAYS_INLINE void start_vectors(const P& p, int kv_row, int Dp, ElementType order,
                                      float* queries, float* state, int state_size) {
  const int L = p.query_len, vectors = p.group * L;
  for (int r = 0; r < vectors; ++r) {
    const int row = kv_row * p.group + r / L, i = r % L;
    const T* q = static_cast<const T*>(p.queries) + p.q_offset(row, i);
    convert_row(queries + r * Dp, q, p.head_dim, Dp, p.q_strides[3], order);
    float* st = state + r * state_size;
    st[0] = -__builtin_inff();
    st[1] = 0.0f;
    fill(st + kStateHeader, st + state_size, 0.0f);
  }
}

// One block's online-softmax step for every query vector of key/value row kv_row: the block's
// scores (positions j0.., n of them, in scores[r * kBlock + j]) hidden past what each vector
// sees and masked, then turned into weights in place; each vector's max and denominator
// updated and the factor its accumulator must be rescaled by in rescale[r]. False when no
// vector sees any key of the block (nothing to accumulate).
template <typename P>
ATTN_ALWAYS_INLINE bool block_softmax(const P& p, CacheRange range, int kv_row, int j0, int n,
                                      float* scores, float* rescale, float* state,
                                      int state_size) {
  const int L = p.query_len, vectors = p.group * L;
  const float neg_inf = -__builtin_inff();
  bool any = false;
  // Vector r is query row i = r % L of head row = kv_row * group + r / L, stepped without
  // dividing.
  for (int r = 0, row = kv_row * p.group, i = 0; r < vectors;
       ++r, i = i + 1 == L ? 0 : i + 1, row += i == 0) {
    float* s = scores + r * kBlock;
    const int seen = visible_keys(range, L, i, p.causal).last + 1 - j0;  // from the range's start
    const int visible = seen < 0 ? 0 : seen > n ? n : seen;
    for (int j = visible; j < kBlock; ++j) {
      s[j] = neg_inf;
    }
    if (p.mask) {
      const int64_t base = p.mask_offset(row, i);
      for (int j = 0; j < visible; ++j) {
        const int64_t at = base + (j0 + j) * p.m_strides[3];
        // False removes the key whatever its score (a NaN key included), as the contract says.
        if (p.mask_kind == kMaskBool) {
          if (!static_cast<const bool*>(p.mask)[at]) s[j] = neg_inf;
        } else {
          s[j] += mask_value(p, at);
        }
      }
    }
    float* st = state + r * state_size;
    Vec block[kBlockVecs];
    for (int v = 0; v < kBlockVecs; ++v) block[v] = load<Vec>(s + v * W);
    const float top = block_max(block);  // NaN if any score is NaN
    if (top == neg_inf) {
      rescale[r] = 1.0f;
      fill(s, s + kBlock, 0.0f);  // every key of this block is hidden from this vector
      continue;
    }
    const float new_max = nan_max(top, st[0]);
    rescale[r] = exp_nonpositive(st[0] - new_max);
    Vec sum = {};
    for (int v = 0; v < kBlockVecs; ++v) {
      const Vec weights = vec_exp(block[v] - new_max);
      store_vec(s + v * W, weights);
      sum += weights;
    }
    st[0] = new_max;
    st[1] = st[1] * rescale[r] + horizontal_sum(sum);
    any = true;
  }
  return any;
}

size_t scratch_floats(const DecodeProblem& p) {
  const size_t vectors = static_cast<size_t>(p.group) * p.query_len, Dp = padded_dim(p.head_dim, W);
  return vectors * Dp + 2 * kBlock * Dp + vectors * kBlock + vectors;
}

template <typename T>
ATTN_ALWAYS_INLINE void attend_chunk(const DecodeProblem& p, int kv_row, int begin, int end,
                                     float* state, float* scratch) {
  const int D = p.head_dim, Dp = padded_dim(D, W);
  const int vectors = p.group * p.query_len, state_size = Dp + kStateHeader;
  float* queries = scratch;                    // vectors x Dp, accumulator_index order
  float* keys_block = queries + vectors * Dp;  // kBlock x Dp (strided or odd-length rows only)
  float* values_block = keys_block + kBlock * Dp;
  float* scores = values_block + kBlock * Dp;  // vectors x kBlock, then weights in place
  float* rescale = scores + vectors * kBlock;  // vectors
  start_vectors<T>(p, kv_row, Dp, p.dtype, queries, state, state_size);

  // Only the positions of the batch row's range (the whole context without per-row ranges).
  const CacheRange range = p.range(kv_row / p.kv_heads);
  begin = begin > range.start ? begin : range.start;
  end = end < range.end ? end : range.end;
  const T* keys = static_cast<const T*>(p.keys) + p.kv_offset(p.k_strides, kv_row);
  const T* values = static_cast<const T*>(p.values) + p.kv_offset(p.v_strides, kv_row);
  const int64_t k_row = p.k_strides[2], v_row = p.v_strides[2];
  const bool keys_direct = p.k_strides[3] == 1 && D == Dp;
  const bool values_direct = p.v_strides[3] == 1 && D == Dp;
  // Contiguous rows whose last pair is half full are read in place too.
  const int whole = D / kPair;
  const bool half_tail = D - whole * kPair == W;
  const bool keys_tail = p.k_strides[3] == 1 && half_tail;
  const bool values_tail = p.v_strides[3] == 1 && half_tail;
  for (int j0 = begin; j0 < end; j0 += kBlock) {
    const int n = end - j0 < kBlock ? end - j0 : kBlock;
    const bool full = n == kBlock;
    // Full blocks prefetch the rows two blocks on, while those are still in this chunk.
    const bool ahead = full && j0 + kPrefetchRows + kBlock <= end;
    const T* keys_ahead = ahead ? keys + (j0 + kPrefetchRows) * k_row : nullptr;
    if (keys_direct) {
      block_scores(queries, vectors, Dp, CacheRows<T>{keys + j0 * k_row, k_row}, n, p.scale,
                   keys_ahead, k_row, D, scores);
    } else if (keys_tail) {
      block_scores(queries, vectors, Dp, HalfTailRows<T>{keys + j0 * k_row, k_row, whole}, n,
                   p.scale, keys_ahead, k_row, D, scores);
    } else {
      for (int j = 0; j < n; ++j) {
        convert_row(keys_block + j * Dp, keys + (j0 + j) * k_row, D, Dp, p.k_strides[3], p.dtype);
      }
      block_scores(queries, vectors, Dp, ScratchRows{keys_block, Dp}, n, p.scale, keys_ahead,
                   k_row, D, scores);
    }

    if (!block_softmax(p, range, kv_row, j0, n, scores, rescale, state, state_size)) {
      continue;
    }
    const T* values_ahead = ahead ? values + (j0 + kPrefetchRows) * v_row : nullptr;
    // Rows read in place: a full block's position count is known at compile time.
    auto accumulate_in_place = [&](const auto& rows) __attribute__((always_inline)) {
      if (full) {
        block_accumulate<kBlock>(scores, rescale, rows, n, values_ahead, v_row, state, vectors,
                                 state_size, Dp);
      } else {
        block_accumulate<0>(scores, rescale, rows, n, values_ahead, v_row, state, vectors,
                            state_size, Dp);
      }
    };
    if (values_direct) {
      accumulate_in_place(CacheRows<T>{values + j0 * v_row, v_row});
    } else if (values_tail) {
      accumulate_in_place(HalfTailRows<T>{values + j0 * v_row, v_row, whole});
    } else {
      for (int j = 0; j < n; ++j) {
        convert_row(values_block + j * Dp, values + (j0 + j) * v_row, D, Dp, p.v_strides[3],
                    p.dtype);
      }
      block_accumulate<0>(scores, rescale, ScratchRows{values_block, Dp}, n, values_ahead, v_row,
                          state, vectors, state_size, Dp);
    }
  }
}

void attend(const DecodeProblem& p, int kv_row, int begin, int end, float* state, float* scratch) {
  switch (p.dtype) {
    case ElementType::float32: return attend_chunk<float>(p, kv_row, begin, end, state, scratch);
    case ElementType::float16: return attend_chunk<Float16>(p, kv_row, begin, end, state, scratch);
    case ElementType::bfloat16:
      return attend_chunk<BFloat16>(p, kv_row, begin, end, state, scratch);
    case ElementType::boolean: return;  // rejected by the op
  }
}

}  // namespace
}  // namespace ATTN_CPU_PATH
}  // namespace attn_kernels::cpu

#include "cpu_kernel_quantized_body.h"  // the quantized cache's kernel, on the blocks above

namespace attn_kernels::cpu {

Kernel ATTN_CONCAT(kernel_, ATTN_CPU_PATH)() {
  using namespace ATTN_CPU_PATH;
  return {W, scratch_floats, attend, quantized_scratch_floats, attend_quantized};
}

}  // namespace attn_kernels::cpu
