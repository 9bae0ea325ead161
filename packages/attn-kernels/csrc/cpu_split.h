// How both CPU attention kernels (over a float cache, cpu_kernel_body.h, and over a quantized one,
// cpu_kernel_quantized_body.h) split a call and merge it: units of (key/value row, context
// chunk) over the thread pool, each writing one online-softmax state per query vector of its row
// (max, denominator, accumulator); the unit that finishes a row's last chunk merges the row's
// states into its output rows, so merging runs in parallel and needs no second hand-off.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_geometry.h"
#include "cpu_kernel.h"
#include "cpu_scalar.h"
#include "decode_problem.h"
#include "thread_pool.h"

namespace attn_kernels::cpu {

// A kernel's states as the split sees them.
struct SplitLayout {
  int state_dims;         // accumulator floats per query vector (the head dim, maybe padded)
  size_t scratch_floats;  // per thread
  // Where dimension d of an output row sits in the accumulator: accumulator_index's bf16 pairs
  // of `width`-float vectors (the float kernel with bf16 inputs), else in order.
  bool bf16_pairs;
  int width;
};

// Merges the chunk states of one query vector and writes its normalised output row: zeros when
// no chunk saw a key (every key masked, or the row's range is empty), NaN when any score was NaN
// (as the readable path).
template <typename T>
void finish_vector(const float* states, int chunks, int chunk_stride, int head_dim,
                   const SplitLayout& layout, float* merged, T* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int c = 0; c < chunks; ++c) {
    max = nan_max(states[c * chunk_stride], max);
  }
  if (std::isnan(max)) {
    for (int d = 0; d < head_dim; ++d) store(out + d, max);
    return;
  }
  std::fill(merged, merged + layout.state_dims, 0.0f);
  float denominator = 0.0f;
  if (max != -std::numeric_limits<float>::infinity()) {
    for (int c = 0; c < chunks; ++c) {
      const float* st = states + c * chunk_stride;
      const float f = exp_nonpositive(st[0] - max);
      denominator += st[1] * f;
      for (int d = 0; d < layout.state_dims; ++d) {
        merged[d] += st[kStateHeader + d] * f;
      }
    }
  }
  const float inv = denominator > 0.0f ? 1.0f / denominator : 0.0f;
  if (!layout.bf16_pairs) {
    for (int d = 0; d < head_dim; ++d) store(out + d, merged[d] * inv);
    return;
  }
  // Each 2 * width dimensions hold the even ones, then the odd ones (accumulator_index), walked
  // without a division per value (with one, this loop held 18% of the samples of bf16 calls at
  // S = 32, L = 8 in a perf profile).
  const int w = layout.width;
  for (int base = 0; base < head_dim; base += 2 * w) {
    for (int i = 0; i < w && base + 2 * i < head_dim; ++i) {
      store(out + base + 2 * i, merged[base + i] * inv);
      if (base + 2 * i + 1 < head_dim) store(out + base + 2 * i + 1, merged[base + w + i] * inv);
    }
  }
}

// The call of geometry g, output rows of T at `out` (contiguous (B, Hq, L, D)). attend(kv_row,
// begin, end, state, scratch): key/value row kv_row over context positions [begin, end), every
// query vector of the row (group * L of them) into one state each, `layout.state_dims +
// kStateHeader` floats apart, every float written (also where the row's range leaves the chunk
// nothing to see).
template <typename T, typename Attend>
void run_split(const AttentionGeometry& g, void* out, const SplitLayout& layout, Attend attend) {
  const int S = g.context, vectors = g.group * g.query_len;
  const int state_size = layout.state_dims + kStateHeader;
  const int threads =
      cpu_threads_for(int64_t{g.kv_rows} * S * g.group * g.query_len * g.head_dim);
  const int chunks = cpu_context_chunks(g.kv_rows, S, threads);
  const int chunk_len = (S + chunks - 1) / chunks;
  const int units = g.kv_rows * chunks;
  // states[kv_row][chunk][vector], reused across calls by the calling thread.
  thread_local std::vector<float> states;
  states.resize(std::max(states.size(), static_cast<size_t>(units) * vectors * state_size));
  struct alignas(64) Counter {  // a cache line each: every unit's completion writes one
    std::atomic<int> n;
  };
  std::vector<Counter> running(g.kv_rows);
  for (auto& r : running) r.n.store(chunks, std::memory_order_relaxed);
  float* const all_states = states.data();  // the caller's: workers have thread_locals of their own

  auto finish_row = [&](int h) {
    thread_local std::vector<float> merged;
    merged.resize(std::max(merged.size(), static_cast<size_t>(state_size)));
    for (int r = 0; r < vectors; ++r) {
      const int row = h * g.group + r / g.query_len, i = r % g.query_len;
      T* dst = static_cast<T*>(out) + (static_cast<int64_t>(row) * g.query_len + i) * g.head_dim;
      const float* first =
          all_states + (static_cast<size_t>(h) * chunks * vectors + r) * state_size;
      finish_vector(first, chunks, vectors * state_size, g.head_dim, layout, merged.data(), dst);
    }
  };
  auto attend_unit = [&](int unit) {
    thread_local std::vector<float> scratch;
    scratch.resize(std::max(scratch.size(), layout.scratch_floats));
    const int kv_row = unit / chunks, c = unit % chunks;
    const int begin = c * chunk_len, end = std::min(S, begin + chunk_len);
    float* st = all_states + static_cast<size_t>(unit) * vectors * state_size;
    attend(kv_row, begin, end, st, scratch.data());
    if (running[kv_row].n.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      finish_row(kv_row);
    }
  };
  if (threads == 1) {
    for (int u = 0; u < units; ++u) {
      attend_unit(u);
    }
  } else {
    cpu_pool().parallel_for(units, threads, attend_unit);
  }
}

}  // namespace attn_kernels::cpu
