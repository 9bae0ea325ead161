// AttentionStep: the op (validation), the cache donation rule and the problems every backend
// fills (the CPU evaluation: attention_step_cpu.cpp).
#include "attention_step.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "mlx/backend/cuda/cuda.h"
#include "private_member.h"

namespace attn_kernels {

// An array's descriptor, the first half of is_donatable(), which MLX keeps private
// (private_member.h).
struct ArrayDesc {
  friend constexpr auto private_member(ArrayDesc);
};
template struct PrivateMember<ArrayDesc, &mx::array::array_desc_>;

namespace {

std::atomic<uint64_t> cache_copies{0};
std::atomic<uint64_t> folded_steps{0};

// How many arrays share `a`'s descriptor.
long array_holders(const mx::array& a) {
  return (a.*private_member(ArrayDesc{})).use_count();
}

// q's dtype, and both norm weights or neither: the steps' first checks.
void check_q_and_norms(
    const char* op,
    const mx::array& q,
    const std::optional<mx::array>& q_norm_weight,
    const std::optional<mx::array>& k_norm_weight) {
  const mx::Dtype dtype = q.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    fail(op, "q must be float32, float16 or bfloat16, got " + dtype_str(dtype));
  }
  if (q_norm_weight.has_value() != k_norm_weight.has_value()) {
    fail(op, std::string(q_norm_weight ? "k_norm_weight" : "q_norm_weight") + " is None while " +
                 (q_norm_weight ? "q_norm_weight" : "k_norm_weight") +
                 " is not: pass both norm weights or neither");
  }
}

// The checks both steps share: q, k, v and the norm weights against caches of `cache`'s shape
// (batch, kv_heads, capacity, ·) holding cache_head_dim values per row, and the step's constants.
// Returns head_dim.
int check_step(
    const char* op,
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& q_norm_weight,
    const std::optional<mx::array>& k_norm_weight,
    const mx::Shape& cache,
    int cache_head_dim,
    int offset,
    float eps) {
  auto fail = [op](const std::string& message) { attn_kernels::fail(op, message); };
  const bool qk_norm = q_norm_weight.has_value();
  for (auto [name, a] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}}) {
    if (a->ndim() != 3) {
      fail(std::string(name) + " must have shape (batch, length, heads * head_dim), got " +
           shape_str(*a));
    }
  }
  if (qk_norm) {
    for (auto [name, a] :
         {std::pair{"q_norm_weight", &*q_norm_weight}, {"k_norm_weight", &*k_norm_weight}}) {
      if (a->ndim() != 1) {
        fail(std::string(name) + " must have shape (head_dim,), got " + shape_str(*a));
      }
    }
    if (k_norm_weight->shape(0) != q_norm_weight->shape(0)) {
      fail("q_norm_weight and k_norm_weight must have the same size, got " +
           shape_str(*q_norm_weight) + " and " + shape_str(*k_norm_weight));
    }
  }
  // head_dim: the norm weights' size, or without norms the caches'.
  const int head_dim = qk_norm ? q_norm_weight->shape(0) : cache_head_dim;
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > kMaxHeadDim) {
    fail(std::string("head_dim (the ") + (qk_norm ? "norm weights'" : "caches' last") +
         " size) must be even and in [2, " + std::to_string(kMaxHeadDim) + "], got " +
         std::to_string(head_dim));
  }
  const int batch = q.shape(0), length = q.shape(1);
  const int kv_heads = cache[1], capacity = cache[2];
  if (cache_head_dim != head_dim) {
    fail("the caches' head_dim " + std::to_string(cache_head_dim) +
         " differs from the norm weights' " + std::to_string(head_dim));
  }
  if (cache[0] != batch) {
    fail("the caches' batch " + std::to_string(cache[0]) + " differs from q's " +
         std::to_string(batch));
  }
  if (length < 1) {
    fail("q must hold at least one position, got shape " + shape_str(q));
  }
  if (q.shape(2) % head_dim != 0) {
    fail("q's last dimension " + std::to_string(q.shape(2)) +
         " is not a multiple of head_dim " + std::to_string(head_dim));
  }
  const int q_heads = q.shape(2) / head_dim;
  const mx::Shape kv_shape = {batch, length, kv_heads * head_dim};
  if (k.shape() != kv_shape || v.shape() != kv_shape) {
    fail("k and v must have shape (batch, length, kv_heads * head_dim) = (" +
         std::to_string(batch) + ", " + std::to_string(length) + ", " +
         std::to_string(kv_heads * head_dim) + "), got " + shape_str(k) + " and " + shape_str(v));
  }
  if (kv_heads < 1 || q_heads % kv_heads != 0) {
    fail("query heads (" + std::to_string(q_heads) +
         ") must be a positive multiple of the caches' key/value heads (" +
         std::to_string(kv_heads) + ")");
  }
  if (offset < 0 || int64_t{offset} + length > capacity) {
    fail("offset + length must fit the caches: offset " + std::to_string(offset) + ", length " +
         std::to_string(length) + ", capacity " + std::to_string(capacity));
  }
  if (qk_norm && !(eps > 0.0f)) {
    fail("eps must be positive, got " + std::to_string(eps));
  }
  return head_dim;
}

// RoPE's frequencies: rope_base (positive) where rope_freqs is empty, else rope_freqs (the period
// of each pair, mx.fast.rope's freqs): head_dim / 2 positive finite values, on the CPU or CUDA
// (Metal's kernel forms its angles from the base).
void check_rope(const char* op, float rope_base, const std::vector<float>& rope_freqs,
                int head_dim, const mx::Stream& stream) {
  auto fail = [op](const std::string& message) { attn_kernels::fail(op, message); };
  if (rope_freqs.empty()) {
    if (!(rope_base > 0.0f)) {
      fail("rope_base must be positive, got " + std::to_string(rope_base));
    }
    return;
  }
  if (static_cast<int>(rope_freqs.size()) != head_dim / 2) {
    fail("rope_freqs must hold head_dim / 2 = " + std::to_string(head_dim / 2) +
         " periods, got " + std::to_string(rope_freqs.size()));
  }
  for (float f : rope_freqs) {
    if (!(f > 0.0f) || !std::isfinite(f)) {
      fail("rope_freqs must be positive and finite, got " + std::to_string(f));
    }
  }
  if (stream.device == mx::Device::gpu && !mx::cu::is_available()) {
    fail("rope_freqs is not implemented on Metal (its kernel forms the angles from rope_base)");
  }
}

// The per-row starts and offsets of a step, checked and appended to `inputs`: offsets (the rows'
// write positions) in [0, offset], `offset` being the largest (offset + length fits the caches,
// check_step); starts in [0, offset] and, where both are known, no later than the row's offset.
// Returns their RowRanges bits.
int add_step_ranges(const char* op, std::vector<mx::array>& inputs,
                    const std::optional<mx::array>& starts, const std::optional<mx::array>& offsets,
                    int batch, int offset, mx::StreamOrDevice s) {
  int flags = 0;
  if (starts) {
    inputs.push_back(checked_row_bounds(op, "starts", *starts, batch, 0, offset, s));
    flags |= kRowStarts;
  }
  if (offsets) {
    inputs.push_back(checked_row_bounds(op, "offsets", *offsets, batch, 0, offset, s));
    flags |= kRowEnds;
  }
  if (starts && offsets && host_readable(*starts) && host_readable(*offsets)) {
    for (int b = 0; b < batch; ++b) {
      const int32_t first = starts->data<int32_t>()[b * starts->strides()[0]];
      const int32_t at = offsets->data<int32_t>()[b * offsets->strides()[0]];
      if (first > at) {
        fail(op, "starts[" + std::to_string(b) + "] = " + std::to_string(first) +
                     " is past offsets[" + std::to_string(b) + "] = " + std::to_string(at));
      }
    }
  }
  return flags;
}

}  // namespace

std::vector<mx::array> attention_step(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& q_norm_weight,
    const std::optional<mx::array>& k_norm_weight,
    const mx::array& k_cache,
    const mx::array& v_cache,
    int offset,
    float eps,
    float rope_base,
    float scale,
    const std::string& schedule,
    bool owned_caches,
    std::optional<bool> fold,
    const std::optional<mx::array>& starts,
    const std::optional<mx::array>& offsets,
    const std::vector<float>& rope_freqs,
    int position,
    mx::StreamOrDevice s) {
  constexpr const char* op = "attention_step";
  auto fail = [](const std::string& message) { attn_kernels::fail(op, message); };
  check_schedule(op, schedule);
  check_q_and_norms(op, q, q_norm_weight, k_norm_weight);
  const mx::Dtype dtype = q.dtype();
  const bool qk_norm = q_norm_weight.has_value();
  std::vector<std::pair<const char*, const mx::array*>> all = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"k_cache", &k_cache}, {"v_cache", &v_cache}};
  if (qk_norm) {
    all.push_back({"q_norm_weight", &*q_norm_weight});
    all.push_back({"k_norm_weight", &*k_norm_weight});
  }
  for (auto [name, a] : all) {
    if (a->dtype() != dtype) {
      fail(std::string(name) + " must have q's dtype " + dtype_str(dtype) + ", got " +
           dtype_str(a->dtype()));
    }
  }
  for (auto [name, a] : {std::pair{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    if (a->ndim() != 4) {
      fail(std::string(name) + " must have shape (batch, kv_heads, capacity, head_dim), got " +
           shape_str(*a));
    }
  }
  if (k_cache.shape() != v_cache.shape()) {
    fail("k_cache and v_cache must have the same shape, got " + shape_str(k_cache) + " and " +
         shape_str(v_cache));
  }
  const int head_dim = check_step(op, q, k, v, q_norm_weight, k_norm_weight, k_cache.shape(),
                                  k_cache.shape(3), offset, eps);
  std::vector<mx::array> inputs = {q, k, v, k_cache, v_cache};
  if (qk_norm) {
    inputs.push_back(*q_norm_weight);
    inputs.push_back(*k_norm_weight);
  }
  auto stream = mx::to_stream(s);
  check_rope(op, rope_base, rope_freqs, head_dim, stream);
  const int row_ranges =
      add_step_ranges(op, inputs, starts, offsets, q.shape(0), offset, stream);
  if (position != -1) {
    // A full ring: every slot holds a key of the window, so its one query may see them all
    // (position >= capacity - 1 >= offset, as check_step keeps offset + length in the caches).
    const int capacity = k_cache.shape(2);
    if (position < 0 || position < capacity - 1) {
      fail("position (a full ring's sequence position) must be -1 or at least capacity - 1 = " +
           std::to_string(capacity - 1) + ", got " + std::to_string(position));
    }
    if (q.shape(1) != 1) {
      fail("position (a ring) takes one new token, got length " + std::to_string(q.shape(1)));
    }
    if (row_ranges != 0) {
      fail("position (a ring) takes no per-row starts or offsets");
    }
  }
  return mx::array::make_arrays(
      {q.shape(), k_cache.shape(), v_cache.shape()},
      {dtype, dtype, dtype},
      std::make_shared<AttentionStep>(
          stream, offset, qk_norm, qk_norm ? eps : 0.0f, rope_base, scale, schedule,
          owned_caches, fold, row_ranges, rope_freqs, position),
      std::move(inputs));
}

bool AttentionStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AttentionStep&>(other);
  return offset_ == o.offset_ && qk_norm_ == o.qk_norm_ && eps_ == o.eps_ &&
         rope_base_ == o.rope_base_ && scale_ == o.scale_ && schedule_ == o.schedule_ &&
         owned_caches_ == o.owned_caches_ && fold_ == o.fold_ && row_ranges_ == o.row_ranges_ &&
         rope_freqs_ == o.rope_freqs_ && position_ == o.position_;
}

std::vector<mx::array> attention_step_quantized(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& q_norm_weight,
    const std::optional<mx::array>& k_norm_weight,
    const std::vector<mx::array>& k_cache,
    const std::vector<mx::array>& v_cache,
    int offset,
    float eps,
    float rope_base,
    float scale,
    int group_size,
    int bits,
    bool owned_caches,
    const std::optional<mx::array>& starts,
    const std::optional<mx::array>& offsets,
    const std::vector<float>& rope_freqs,
    mx::StreamOrDevice s) {
  constexpr const char* op = "attention_step_quantized";
  auto fail = [](const std::string& message) { attn_kernels::fail(op, message); };
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  check_q_and_norms(op, q, q_norm_weight, k_norm_weight);
  const mx::Dtype dtype = q.dtype();
  const bool qk_norm = q_norm_weight.has_value();
  std::vector<std::pair<const char*, const mx::array*>> same_dtype = {{"k", &k}, {"v", &v}};
  if (qk_norm) {
    same_dtype.push_back({"q_norm_weight", &*q_norm_weight});
    same_dtype.push_back({"k_norm_weight", &*k_norm_weight});
  }
  const char* parts[] = {"codes", "scales", "biases"};
  for (auto [name, triple] : {std::pair{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    if (triple->size() != 3) {
      fail(std::string(name) + " must be a (codes, scales, biases) triple from mx.quantize, got " +
           std::to_string(triple->size()) + " arrays");
    }
  }
  for (auto [name, triple] : {std::pair{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    for (int t = 0; t < 3; ++t) {
      if ((*triple)[t].ndim() != 4) {
        fail(std::string(name) + "'s " + parts[t] +
             " must have shape (batch, kv_heads, capacity, ·), got " + shape_str((*triple)[t]));
      }
      if (k_cache[t].shape() != v_cache[t].shape()) {
        fail(std::string("k_cache and v_cache must have the same shapes, got ") + parts[t] + " " +
             shape_str(k_cache[t]) + " and " + shape_str(v_cache[t]));
      }
    }
    if ((*triple)[0].dtype() != mx::uint32) {
      fail(std::string(name) + "'s codes must be uint32 (mx.quantize's packing), got " +
           dtype_str((*triple)[0].dtype()));
    }
  }
  same_dtype.push_back({"k_cache's scales", &k_cache[1]});
  same_dtype.push_back({"k_cache's biases", &k_cache[2]});
  same_dtype.push_back({"v_cache's scales", &v_cache[1]});
  same_dtype.push_back({"v_cache's biases", &v_cache[2]});
  for (auto [name, a] : same_dtype) {
    if (a->dtype() != dtype) {
      fail(std::string(name) + " must have q's dtype " + dtype_str(dtype) + ", got " +
           dtype_str(a->dtype()));
    }
  }
  const mx::Shape& codes = k_cache[0].shape();
  const int head_dim = check_step(op, q, k, v, q_norm_weight, k_norm_weight, codes,
                                  codes[3] * 32 / bits, offset, eps);
  // The GPU step kernels are planned for multiples of 64; the CPU's quantizes group by group.
  const auto stream = mx::to_stream(s);
  const bool on_cpu = stream.device == mx::Device::cpu;
  if (head_dim % group_size != 0 || (!on_cpu && head_dim % 64 != 0)) {
    fail("head_dim must be a multiple of group_size " + std::to_string(group_size) +
         (on_cpu ? "" : " and, on a GPU, of 64") + ", got " + std::to_string(head_dim));
  }
  if (codes[3] * 32 != head_dim * bits) {
    fail("the codes hold " + std::to_string(codes[3]) + " words per row; head_dim " +
         std::to_string(head_dim) + " at bits=" + std::to_string(bits) + " packs into " +
         std::to_string(head_dim * bits / 32) + " (were they quantized with other bits?)");
  }
  const mx::Shape groups = {codes[0], codes[1], codes[2], head_dim / group_size};
  if (k_cache[1].shape() != groups || k_cache[2].shape() != groups) {
    fail("the scales and biases must have shape " + shape_str(groups) + " (one per group of " +
         std::to_string(group_size) + " values), got " + shape_str(k_cache[1]) + " and " +
         shape_str(k_cache[2]) + " (were they quantized with another group_size?)");
  }
  std::vector<mx::array> inputs = {q, k, v};
  std::vector<mx::Shape> shapes = {q.shape()};
  std::vector<mx::Dtype> dtypes = {dtype};
  for (const auto* triple : {&k_cache, &v_cache}) {
    for (const auto& a : *triple) {
      inputs.push_back(a);
      shapes.push_back(a.shape());
      dtypes.push_back(a.dtype());
    }
  }
  if (qk_norm) {
    inputs.push_back(*q_norm_weight);
    inputs.push_back(*k_norm_weight);
  }
  check_rope(op, rope_base, rope_freqs, head_dim, stream);
  const int row_ranges =
      add_step_ranges(op, inputs, starts, offsets, q.shape(0), offset, stream);
  return mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<AttentionStepQuantized>(
          stream, offset, qk_norm, qk_norm ? eps : 0.0f, rope_base, scale, group_size, bits,
          owned_caches, row_ranges, rope_freqs),
      std::move(inputs));
}

bool AttentionStepQuantized::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AttentionStepQuantized&>(other);
  return offset_ == o.offset_ && qk_norm_ == o.qk_norm_ && eps_ == o.eps_ &&
         rope_base_ == o.rope_base_ && scale_ == o.scale_ && group_size_ == o.group_size_ &&
         bits_ == o.bits_ && owned_caches_ == o.owned_caches_ && row_ranges_ == o.row_ranges_ &&
         rope_freqs_ == o.rope_freqs_;
}

std::vector<bool> donate_caches(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    bool owned_caches,
    int first_cache_input) {
  // Each output of a multi-output primitive holds its own copy of the input list, so a cache
  // that nothing else references is held once per output and is_donatable() is never true.
  // The outputs other than the one being evaluated lose their lists right after this eval
  // (array::detach); dropping them first leaves the cache held by the evaluated output alone.
  // Not while tracing (compile, grad): those lists are kept for the transform.
  int evaluated = 0;
  bool tracing = false;
  for (auto& o : outputs) {
    evaluated += &o.inputs() == &inputs;
    tracing |= o.is_tracer();
  }
  if (evaluated == 1 && !tracing) {
    for (auto& o : outputs) {
      if (&o.inputs() != &inputs) {
        o.inputs().clear();
      }
    }
  }
  std::vector<bool> donated(outputs.size() - 1);
  for (size_t c = 0; c < donated.size(); ++c) {
    // MLX's is_donatable(in, out) (backend/common/utils.h) plus the condition of the Vector
    // copy copy_gpu/copy_cpu donate under (the whole buffer, row-contiguous). With owned caches
    // only the array must be unshared: other references to its buffer are the caller's views
    // (promised not to be read past offset) and MLX's hold on it for earlier steps still
    // running on the stream (their kernels read only positions before offset and run first).
    const auto& in = inputs[first_cache_input + c];
    auto& out = outputs[1 + c];
    constexpr size_t donation_extra = 16384;
    const bool unshared = owned_caches
        ? array_holders(in) == 1 && in.data_shared_ptr()->is_owned()
        : in.is_donatable();
    donated[c] = unshared && in.itemsize() == out.itemsize() &&
                 in.buffer_size() <= out.nbytes() + donation_extra &&
                 in.flags().row_contiguous && in.data_size() == in.size();
    if (donated[c]) {
      out.copy_shared_buffer(in);
    } else {
      cache_copies.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return donated;
}

uint64_t attention_step_cache_copies() {
  return cache_copies.load(std::memory_order_relaxed);
}

uint64_t attention_step_folds() {
  return folded_steps.load(std::memory_order_relaxed);
}

void count_folded_step() {
  folded_steps.fetch_add(1, std::memory_order_relaxed);
}

void set_inverse_frequencies(StepProblem& p, const std::vector<float>& rope_freqs) {
  static_assert(sizeof(p.inv_freq) / sizeof(float) == kMaxHeadDim / 2);
  if (!rope_freqs.empty()) {  // mx.fast.rope's reciprocal of each period, in float32
    for (int j = 0; j < p.head_dim / 2; ++j) p.inv_freq[j] = 1.0f / rope_freqs[j];
    return;
  }
  // Every layer of every step asks for the same table: keep the last one per thread instead of
  // head_dim / 2 double powers per evaluation.
  thread_local int table_dim = 0;
  thread_local float table_base = 0.0f;
  thread_local std::array<float, kMaxHeadDim / 2> table{};
  if (table_dim != p.head_dim || table_base != p.log2_base) {
    for (int j = 0; j < p.head_dim / 2; ++j) {
      table[j] = rope_inverse_frequency(j, p.head_dim / 2, p.log2_base);
    }
    table_dim = p.head_dim;
    table_base = p.log2_base;
  }
  std::copy(table.begin(), table.begin() + p.head_dim / 2, p.inv_freq);
}

}  // namespace attn_kernels
