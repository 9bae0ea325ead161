#include "decode_attention.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

namespace attn_kernels {

namespace {

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
  throw std::invalid_argument("[decode_attention] " + message);
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

ElementType element_type(mx::Dtype t) {
  if (t == mx::float32) return ElementType::float32;
  if (t == mx::float16) return ElementType::float16;
  if (t == mx::bfloat16) return ElementType::bfloat16;
  return ElementType::boolean;
}

void copy_strides(const mx::array& a, int64_t* dst) {
  for (int i = 0; i < 4; ++i) {
    dst[i] = a.strides()[i];
  }
}

}  // namespace

mx::array decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    const std::string& schedule,
    mx::StreamOrDevice s) {
  if (std::find(schedules().begin(), schedules().end(), schedule) == schedules().end()) {
    std::string names;
    for (const auto& n : schedules()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown schedule '" + schedule + "': use one of " + names);
  }
  for (auto [name, a] : {std::pair{"queries", &queries}, {"keys", &keys}, {"values", &values}}) {
    if (a->ndim() != 4) {
      fail(std::string(name) + " must have 4 dimensions (batch, heads, length, head_dim), got shape " +
           shape_str(*a));
    }
    if (!is_float(a->dtype())) {
      std::ostringstream os;
      os << name << " must be float32, float16 or bfloat16, got " << a->dtype();
      fail(os.str());
    }
  }
  if (keys.dtype() != queries.dtype() || values.dtype() != queries.dtype()) {
    std::ostringstream os;
    os << "queries, keys and values must share one dtype, got " << queries.dtype() << ", "
       << keys.dtype() << ", " << values.dtype();
    fail(os.str());
  }
  if (keys.shape() != values.shape()) {
    fail("keys and values must have the same shape, got " + shape_str(keys) + " and " +
         shape_str(values));
  }
  const int batch = queries.shape(0), q_heads = queries.shape(1);
  const int query_len = queries.shape(2), head_dim = queries.shape(3);
  const int kv_heads = keys.shape(1), context = keys.shape(2);
  if (keys.shape(0) != batch) {
    fail("keys' batch " + std::to_string(keys.shape(0)) + " differs from queries' " +
         std::to_string(batch));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    fail("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
         std::to_string(head_dim));
  }
  if (keys.shape(3) != head_dim) {
    fail("keys' head_dim " + std::to_string(keys.shape(3)) + " differs from queries' " +
         std::to_string(head_dim));
  }
  if (kv_heads < 1 || q_heads % kv_heads != 0) {
    fail("query heads (" + std::to_string(q_heads) + ") must be a positive multiple of key/value heads (" +
         std::to_string(kv_heads) + ")");
  }
  if (causal && mask) {
    fail("pass either an explicit mask or causal=True, not both");
  }
  if (causal && query_len > context) {
    fail("causal attention needs query length <= context, got L=" + std::to_string(query_len) +
         " > S=" + std::to_string(context));
  }
  std::vector<mx::array> inputs = {queries, keys, values};
  if (mask) {
    const mx::Shape expected = {batch, q_heads, query_len, context};
    if (mask->shape() != expected) {
      fail("mask must have shape (B, Hq, L, S) = (" + std::to_string(batch) + ", " +
           std::to_string(q_heads) + ", " + std::to_string(query_len) + ", " +
           std::to_string(context) + "), got " + shape_str(*mask));
    }
    if (!is_float(mask->dtype()) && mask->dtype() != mx::bool_) {
      std::ostringstream os;
      os << "mask must be additive (float32/float16/bfloat16) or boolean, got " << mask->dtype();
      fail(os.str());
    }
    inputs.push_back(*mask);
  }
  auto stream = mx::to_stream(s);
  if (context == 0 || query_len == 0 || batch == 0 || q_heads == 0) {
    // The contract (attention.py): no keys is the fully masked row (zeros); no queries, an empty
    // output. Neither needs a kernel.
    return mx::zeros(queries.shape(), queries.dtype(), stream);
  }
  return mx::array(
      queries.shape(), queries.dtype(), std::make_shared<DecodeAttention>(stream, scale, causal, schedule),
      std::move(inputs));
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeAttention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && schedule_ == o.schedule_;
}

DecodeProblem problem_shape(const std::vector<mx::array>& inputs, float scale, bool causal) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  DecodeProblem p{};
  p.dtype = element_type(q.dtype());
  p.mask_dtype = inputs.size() > 3 ? element_type(inputs[3].dtype()) : ElementType::float32;
  p.q_heads = q.shape(1);
  p.kv_heads = k.shape(1);
  p.rows = q.shape(0) * p.q_heads;
  p.kv_rows = k.shape(0) * p.kv_heads;
  p.query_len = q.shape(2);
  p.head_dim = q.shape(3);
  p.context = k.shape(2);
  p.group = p.q_heads / p.kv_heads;
  p.scale = scale;
  p.causal = causal;
  copy_strides(q, p.q_strides);
  copy_strides(k, p.k_strides);
  copy_strides(v, p.v_strides);
  if (inputs.size() > 3) {
    copy_strides(inputs[3], p.m_strides);
  }
  return p;
}

void DecodeAttention::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  DecodeProblem problem =
      make_problem(inputs, scale_, causal_, [](const mx::array& a) { return a.data<void>(); });
  problem.out = out.data<void>();
  // The path is resolved here, not in the task: a bad ATTN_KERNELS_CPU_PATH raises to the caller.
  const CpuPath path = cpu_path_from_env();
  decode_attention_cpu_prepare(problem);
  encoder.dispatch([problem, path]() { decode_attention_cpu(problem, path); });
}

}  // namespace attn_kernels
