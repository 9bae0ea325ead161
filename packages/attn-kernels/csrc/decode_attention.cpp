#include "decode_attention.h"

#include <string>

#include "mlx/backend/cpu/encoder.h"

namespace attn_kernels {

namespace {

constexpr const char* kOp = "decode_attention";

}  // namespace

mx::array decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    const std::string& schedule,
    const std::optional<mx::array>& starts,
    const std::optional<mx::array>& ends,
    mx::StreamOrDevice s) {
  check_schedule(kOp, schedule);
  for (auto [name, a] : {std::pair{"queries", &queries}, {"keys", &keys}, {"values", &values}}) {
    if (a->ndim() != 4) {
      fail(kOp, std::string(name) +
                    " must have 4 dimensions (batch, heads, length, head_dim), got shape " +
                    shape_str(*a));
    }
    if (!is_float(a->dtype())) {
      fail(kOp, std::string(name) + " must be float32, float16 or bfloat16, got " +
                    dtype_str(a->dtype()));
    }
  }
  if (keys.dtype() != queries.dtype() || values.dtype() != queries.dtype()) {
    fail(kOp, "queries, keys and values must share one dtype, got " + dtype_str(queries.dtype()) +
                  ", " + dtype_str(keys.dtype()) + ", " + dtype_str(values.dtype()));
  }
  if (keys.shape() != values.shape()) {
    fail(kOp, "keys and values must have the same shape, got " + shape_str(keys) + " and " +
                  shape_str(values));
  }
  const int batch = queries.shape(0), q_heads = queries.shape(1);
  const int query_len = queries.shape(2), head_dim = queries.shape(3);
  const int kv_heads = keys.shape(1), context = keys.shape(2);
  if (keys.shape(0) != batch) {
    fail(kOp, "keys' batch " + std::to_string(keys.shape(0)) + " differs from queries' " +
                  std::to_string(batch));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    fail(kOp, "head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
                  std::to_string(head_dim));
  }
  if (keys.shape(3) != head_dim) {
    fail(kOp, "keys' head_dim " + std::to_string(keys.shape(3)) + " differs from queries' " +
                  std::to_string(head_dim));
  }
  if (kv_heads < 1 || q_heads % kv_heads != 0) {
    fail(kOp, "query heads (" + std::to_string(q_heads) +
                  ") must be a positive multiple of key/value heads (" +
                  std::to_string(kv_heads) + ")");
  }
  if (causal && mask) {
    fail(kOp, "pass either an explicit mask or causal=True, not both");
  }
  if (causal && query_len > context) {
    fail(kOp, "causal attention needs query length <= context, got L=" +
                  std::to_string(query_len) + " > S=" + std::to_string(context));
  }
  std::vector<mx::array> inputs = {queries, keys, values};
  if (mask) {
    check_mask(kOp, *mask, {batch, q_heads, query_len, context});
    inputs.push_back(*mask);
  }
  auto stream = mx::to_stream(s);
  const int row_ranges = add_row_ranges(kOp, inputs, starts, ends, batch, context, stream);
  if (context == 0 || query_len == 0 || batch == 0 || q_heads == 0) {
    // The contract (attention.py): no keys is the fully masked row (zeros); no queries, an empty
    // output. Neither needs a kernel.
    return mx::zeros(queries.shape(), queries.dtype(), stream);
  }
  return mx::array(
      queries.shape(), queries.dtype(),
      std::make_shared<DecodeAttention>(stream, scale, causal, schedule, mask.has_value(),
                                        row_ranges),
      std::move(inputs));
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeAttention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && schedule_ == o.schedule_ &&
         has_mask_ == o.has_mask_ && row_ranges_ == o.row_ranges_;
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
  DecodeProblem p = problem(inputs, [](const mx::array& a) { return a.data<void>(); });
  p.out = out.data<void>();
  // The path is resolved here, not in the task: a bad ATTN_KERNELS_CPU_PATH raises to the caller.
  const CpuPath path = cpu_path_from_env();
  decode_attention_cpu_prepare(p);
  encoder.dispatch([p, path]() { decode_attention_cpu(p, path); });
}

}  // namespace attn_kernels
