// AttentionStep: the op (validation), the cache donation rule, and the CPU evaluation.
#include "attention_step.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

namespace attn_kernels {

namespace {

std::atomic<uint64_t> cache_copies{0};

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < a.ndim(); ++i) {
    os << (i ? ", " : "") << a.shape(i);
  }
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("[attention_step] " + message);
}

ElementType element_type(mx::Dtype t) {
  if (t == mx::float32) return ElementType::float32;
  if (t == mx::float16) return ElementType::float16;
  return ElementType::bfloat16;
}

}  // namespace

std::vector<mx::array> attention_step(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& q_norm_weight,
    const mx::array& k_norm_weight,
    const mx::array& k_cache,
    const mx::array& v_cache,
    int offset,
    float eps,
    float rope_base,
    float scale,
    const std::string& schedule,
    mx::StreamOrDevice s) {
  if (std::find(schedules().begin(), schedules().end(), schedule) == schedules().end()) {
    std::string names;
    for (const auto& n : schedules()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown schedule '" + schedule + "': use one of " + names);
  }
  const mx::Dtype dtype = q.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    std::ostringstream os;
    os << "q must be float32, float16 or bfloat16, got " << dtype;
    fail(os.str());
  }
  const std::pair<const char*, const mx::array*> all[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"q_norm_weight", &q_norm_weight},
      {"k_norm_weight", &k_norm_weight}, {"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (auto [name, a] : all) {
    if (a->dtype() != dtype) {
      std::ostringstream os;
      os << name << " must have q's dtype " << dtype << ", got " << a->dtype();
      fail(os.str());
    }
  }
  for (auto [name, a] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}}) {
    if (a->ndim() != 3) {
      fail(std::string(name) + " must have shape (batch, length, heads * head_dim), got " +
           shape_str(*a));
    }
  }
  for (auto [name, a] : {std::pair{"q_norm_weight", &q_norm_weight}, {"k_norm_weight", &k_norm_weight}}) {
    if (a->ndim() != 1) {
      fail(std::string(name) + " must have shape (head_dim,), got " + shape_str(*a));
    }
  }
  for (auto [name, a] : {std::pair{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    if (a->ndim() != 4) {
      fail(std::string(name) + " must have shape (batch, kv_heads, capacity, head_dim), got " +
           shape_str(*a));
    }
  }
  const int head_dim = q_norm_weight.shape(0);
  if (k_norm_weight.shape(0) != head_dim) {
    fail("q_norm_weight and k_norm_weight must have the same size, got " +
         shape_str(q_norm_weight) + " and " + shape_str(k_norm_weight));
  }
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > kMaxHeadDim) {
    fail("head_dim (the norm weights' size) must be even and in [2, " +
         std::to_string(kMaxHeadDim) + "], got " + std::to_string(head_dim));
  }
  if (k_cache.shape() != v_cache.shape()) {
    fail("k_cache and v_cache must have the same shape, got " + shape_str(k_cache) + " and " +
         shape_str(v_cache));
  }
  const int batch = q.shape(0), length = q.shape(1);
  const int kv_heads = k_cache.shape(1), capacity = k_cache.shape(2);
  if (k_cache.shape(3) != head_dim) {
    fail("the caches' head_dim " + std::to_string(k_cache.shape(3)) +
         " differs from the norm weights' " + std::to_string(head_dim));
  }
  if (k_cache.shape(0) != batch) {
    fail("the caches' batch " + std::to_string(k_cache.shape(0)) + " differs from q's " +
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
  if (!(eps > 0.0f) || !(rope_base > 0.0f)) {
    fail("eps and rope_base must be positive, got " + std::to_string(eps) + " and " +
         std::to_string(rope_base));
  }
  auto stream = mx::to_stream(s);
  return mx::array::make_arrays(
      {q.shape(), k_cache.shape(), v_cache.shape()},
      {dtype, dtype, dtype},
      std::make_shared<AttentionStep>(stream, offset, eps, rope_base, scale, schedule),
      {q, k, v, q_norm_weight, k_norm_weight, k_cache, v_cache});
}

bool AttentionStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AttentionStep&>(other);
  return offset_ == o.offset_ && eps_ == o.eps_ && rope_base_ == o.rope_base_ &&
         scale_ == o.scale_ && schedule_ == o.schedule_;
}

std::array<bool, 2> donate_caches(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
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
  std::array<bool, 2> donated{};
  for (int c = 0; c < 2; ++c) {
    // MLX's is_donatable(in, out) (backend/common/utils.h) plus the condition of the Vector
    // copy copy_gpu/copy_cpu donate under (the whole buffer, row-contiguous).
    const auto& in = inputs[5 + c];
    auto& out = outputs[1 + c];
    constexpr size_t donation_extra = 16384;
    donated[c] = in.is_donatable() && in.itemsize() == out.itemsize() &&
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

StepProblem make_step_problem(
    const std::vector<mx::array>& inputs,
    const std::vector<mx::array>& outputs,
    int offset,
    float eps,
    float rope_base) {
  const auto& q = inputs[0];
  const auto& k_cache = outputs[1];
  StepProblem p{};
  p.dtype = element_type(q.dtype());
  p.head_dim = inputs[3].shape(0);
  p.batch = q.shape(0);
  p.length = q.shape(1);
  p.q_heads = q.shape(2) / p.head_dim;
  p.kv_heads = k_cache.shape(1);
  p.offset = offset;
  p.eps = eps;
  p.log2_base = std::log2(rope_base);
  for (int i = 0; i < 3; ++i) {
    p.q_strides[i] = inputs[0].strides()[i];
    p.k_strides[i] = inputs[1].strides()[i];
    p.v_strides[i] = inputs[2].strides()[i];
  }
  for (int i = 0; i < 4; ++i) {
    p.kc_strides[i] = outputs[1].strides()[i];
    p.vc_strides[i] = outputs[2].strides()[i];
  }
  return p;
}

DecodeProblem make_step_attention(
    const StepProblem& step, const void* queries, const void* keys, const void* values,
    void* out, float scale) {
  DecodeProblem p{};
  p.queries = queries;
  p.keys = keys;
  p.values = values;
  p.mask = nullptr;
  p.out = out;
  p.dtype = step.dtype;
  p.mask_dtype = ElementType::float32;
  p.q_heads = step.q_heads;
  p.kv_heads = step.kv_heads;
  p.rows = step.batch * step.q_heads;
  p.kv_rows = step.batch * step.kv_heads;
  p.query_len = step.length;
  p.head_dim = step.head_dim;
  p.context = step.offset + step.length;
  p.group = step.q_heads / step.kv_heads;
  p.scale = scale;
  p.causal = true;
  const int64_t L = step.length, D = step.head_dim;
  const int64_t q_strides[4] = {step.q_heads * L * D, L * D, D, 1};
  for (int i = 0; i < 4; ++i) {
    p.q_strides[i] = q_strides[i];
    p.k_strides[i] = step.kc_strides[i];
    p.v_strides[i] = step.vc_strides[i];
  }
  return p;
}

namespace {

// The step's elementwise part on the CPU, in MLX's order of roundings: RMSNorm rounds x·r to
// the dtype and multiplies by the weight in the dtype (as mx.fast.rms_norm), RoPE rotates that
// in float32 and rounds once.
template <typename T>
void norm_rope_row(
    const T* x, int64_t stride, const T* w, float eps, const float* cos_t, const float* sin_t,
    int D, T* dst, int64_t dst_stride) {
  float y[kMaxHeadDim];
  float sum = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float xd = static_cast<float>(x[d * stride]);
    y[d] = xd;
    sum += xd * xd;
  }
  const float r = 1.0f / std::sqrt(sum / D + eps);
  for (int d = 0; d < D; ++d) {
    y[d] = static_cast<float>(w[d] * static_cast<T>(y[d] * r));
  }
  const int half = D / 2;
  for (int j = 0; j < half; ++j) {
    const float a = y[j], b = y[j + half];
    dst[j * dst_stride] = static_cast<T>(a * cos_t[j] - b * sin_t[j]);
    dst[(j + half) * dst_stride] = static_cast<T>(a * sin_t[j] + b * cos_t[j]);
  }
}

template <typename T>
void preprocess_cpu(const StepProblem& p) {
  const int D = p.head_dim, half = D / 2, L = p.length;
  std::vector<float> cos_t(size_t(L) * half), sin_t(size_t(L) * half);
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < half; ++j) {
      const float theta = rope_angle(p.offset + i, j, half, p.log2_base);
      cos_t[size_t(i) * half + j] = std::cos(theta);
      sin_t[size_t(i) * half + j] = std::sin(theta);
    }
  }
  auto q = static_cast<const T*>(p.q);
  auto k = static_cast<const T*>(p.k);
  auto v = static_cast<const T*>(p.v);
  auto qw = static_cast<const T*>(p.q_weight);
  auto kw = static_cast<const T*>(p.k_weight);
  auto q_out = static_cast<T*>(p.q_out);
  auto k_cache = static_cast<T*>(p.k_cache);
  auto v_cache = static_cast<T*>(p.v_cache);
  for (int b = 0; b < p.batch; ++b) {
    for (int i = 0; i < L; ++i) {
      const float* c = cos_t.data() + size_t(i) * half;
      const float* s = sin_t.data() + size_t(i) * half;
      const int pos = p.offset + i;
      for (int h = 0; h < p.q_heads; ++h) {
        const T* x = q + b * p.q_strides[0] + i * p.q_strides[1] + int64_t{h} * D * p.q_strides[2];
        T* dst = q_out + ((int64_t{b} * p.q_heads + h) * L + i) * D;
        norm_rope_row(x, p.q_strides[2], qw, p.eps, c, s, D, dst, 1);
      }
      for (int h = 0; h < p.kv_heads; ++h) {
        const T* x = k + b * p.k_strides[0] + i * p.k_strides[1] + int64_t{h} * D * p.k_strides[2];
        T* dst = k_cache + b * p.kc_strides[0] + h * p.kc_strides[1] + pos * p.kc_strides[2];
        norm_rope_row(x, p.k_strides[2], kw, p.eps, c, s, D, dst, p.kc_strides[3]);
        const T* vx = v + b * p.v_strides[0] + i * p.v_strides[1] + int64_t{h} * D * p.v_strides[2];
        T* vdst = v_cache + b * p.vc_strides[0] + h * p.vc_strides[1] + pos * p.vc_strides[2];
        for (int d = 0; d < D; ++d) {
          vdst[d * p.vc_strides[3]] = vx[d * p.v_strides[2]];
        }
      }
    }
  }
}

// A cache that could not be donated: copied element by element (any strides) into the
// row-contiguous output.
struct CacheCopy {
  const void* src;
  void* dst;
  mx::Strides strides;  // the source's
  mx::Shape shape;
};

template <typename T>
void copy_cache(const CacheCopy& c) {
  const T* src = static_cast<const T*>(c.src);
  T* dst = static_cast<T*>(c.dst);
  const auto& strides = c.strides;
  const auto& shape = c.shape;
  size_t n = 0;
  for (int a = 0; a < shape[0]; ++a) {
    for (int b = 0; b < shape[1]; ++b) {
      for (int c = 0; c < shape[2]; ++c) {
        const T* row = src + a * strides[0] + b * strides[1] + c * strides[2];
        for (int d = 0; d < shape[3]; ++d) {
          dst[n++] = row[d * strides[3]];
        }
      }
    }
  }
}

template <typename T>
void run_step_cpu(
    const StepProblem& step, float scale, void* out, const std::vector<CacheCopy>& copies) {
  for (const auto& c : copies) {
    copy_cache<T>(c);
  }
  const size_t q_elems = size_t(step.batch) * step.q_heads * step.length * step.head_dim;
  std::vector<T> queries(q_elems);
  StepProblem p = step;
  p.q_out = queries.data();
  preprocess_cpu<T>(p);
  if (step.length == 1) {
    decode_attention_cpu(make_step_attention(p, queries.data(), p.k_cache, p.v_cache, out, scale));
    return;
  }
  // (B, Hq, L, D) from the kernel, (B, L, Hq, D) for o_proj.
  std::vector<T> heads_first(q_elems);
  decode_attention_cpu(
      make_step_attention(p, queries.data(), p.k_cache, p.v_cache, heads_first.data(), scale));
  const int L = step.length, H = step.q_heads, D = step.head_dim;
  T* o = static_cast<T*>(out);
  for (int b = 0; b < step.batch; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < L; ++i) {
        std::copy_n(
            heads_first.data() + ((int64_t{b} * H + h) * L + i) * D, D,
            o + ((int64_t{b} * L + i) * H + h) * D);
      }
    }
  }
}

}  // namespace

void AttentionStep::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  // The caches that must be copied before the step writes them.
  std::vector<CacheCopy> copies;
  const auto donated = donate_caches(inputs, outputs);
  for (int c = 0; c < 2; ++c) {
    if (!donated[c]) {
      const auto& in = inputs[5 + c];
      auto& out = outputs[1 + c];
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copies.push_back({in.data<void>(), out.data<void>(), in.strides(), in.shape()});
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  StepProblem step = make_step_problem(inputs, outputs, offset_, eps_, rope_base_);
  step.q = inputs[0].data<void>();
  step.k = inputs[1].data<void>();
  step.v = inputs[2].data<void>();
  step.q_weight = inputs[3].data<void>();
  step.k_weight = inputs[4].data<void>();
  step.k_cache = outputs[1].data<void>();
  step.v_cache = outputs[2].data<void>();
  encoder.dispatch([step, scale = scale_, o = out.data<void>(), copies = std::move(copies)]() {
    switch (step.dtype) {
      case ElementType::float32:
        run_step_cpu<float>(step, scale, o, copies);
        break;
      case ElementType::float16:
        run_step_cpu<mx::float16_t>(step, scale, o, copies);
        break;
      default:
        run_step_cpu<mx::bfloat16_t>(step, scale, o, copies);
        break;
    }
  });
}

}  // namespace attn_kernels
