#include "decode_attention_quantized.h"

#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

#include "decode_attention.h"

namespace attn_kernels {

namespace {

constexpr const char* kOp = "decode_attention_quantized";

[[noreturn]] void fail(const std::string& message) {
  attn_kernels::fail(kOp, message);
}

// One (codes, scales, biases) triple against the shapes the queries and settings imply.
void check_triple(const char* name, const std::vector<mx::array>& triple, const mx::array& queries,
                  int group_size, int bits) {
  if (triple.size() != 3) {
    fail(std::string(name) + " must be a (codes, scales, biases) triple from mx.quantize, got " +
         std::to_string(triple.size()) + " arrays");
  }
  const auto& codes = triple[0];
  if (codes.ndim() != 4) {
    fail(std::string(name) + "' codes must have 4 dimensions (batch, heads, length, packed), got " +
         shape_str(codes.shape()));
  }
  if (codes.dtype() != mx::uint32) {
    fail(std::string(name) + "' codes must be uint32 (mx.quantize's packing), got " +
         dtype_str(codes.dtype()));
  }
  const int head_dim = queries.shape(3);
  const int packed = head_dim * bits / 32;
  if (codes.shape(3) != packed) {
    fail(std::string(name) + "' codes hold " + std::to_string(codes.shape(3)) +
         " words per row; head_dim " + std::to_string(head_dim) + " at bits=" +
         std::to_string(bits) + " packs into " + std::to_string(packed) +
         " (were they quantized with other bits?)");
  }
  if (codes.shape(0) != queries.shape(0)) {
    fail(std::string(name) + "' batch " + std::to_string(codes.shape(0)) +
         " differs from queries' " + std::to_string(queries.shape(0)));
  }
  const mx::Shape expected = {codes.shape(0), codes.shape(1), codes.shape(2), head_dim / group_size};
  const char* parts[] = {"scales", "biases"};
  for (int t = 1; t < 3; ++t) {
    const std::string what = std::string(name) + "' " + parts[t - 1];
    if (triple[t].shape() != expected) {
      fail(what + " must have shape " + shape_str(expected) + " (one per group of " +
           std::to_string(group_size) + " values), got " + shape_str(triple[t].shape()) +
           " (was it quantized with another group_size?)");
    }
    if (triple[t].dtype() != queries.dtype()) {
      fail(what + " must have the queries' dtype " + dtype_str(queries.dtype()) + ", got " +
           dtype_str(triple[t].dtype()));
    }
  }
}

}  // namespace

mx::array decode_attention_quantized(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    float scale,
    const std::optional<mx::array>& mask,
    bool causal,
    int group_size,
    int bits,
    const std::optional<mx::array>& starts,
    const std::optional<mx::array>& ends,
    mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (queries.ndim() != 4) {
    fail("queries must have 4 dimensions (batch, heads, length, head_dim), got shape " +
         shape_str(queries.shape()));
  }
  if (!is_float(queries.dtype())) {
    fail("queries must be float32, float16 or bfloat16, got " + dtype_str(queries.dtype()));
  }
  const int batch = queries.shape(0), q_heads = queries.shape(1);
  const int query_len = queries.shape(2), head_dim = queries.shape(3);
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    fail("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
         std::to_string(head_dim));
  }
  if (head_dim % group_size != 0) {
    fail("group_size " + std::to_string(group_size) + " does not divide head_dim " +
         std::to_string(head_dim));
  }
  check_triple("keys", keys, queries, group_size, bits);
  check_triple("values", values, queries, group_size, bits);
  for (int t = 0; t < 3; ++t) {
    if (keys[t].shape() != values[t].shape()) {
      fail("keys and values must have the same shapes, got " + shape_str(keys[t].shape()) +
           " and " + shape_str(values[t].shape()));
    }
  }
  const int kv_heads = keys[0].shape(1), context = keys[0].shape(2);
  if (kv_heads < 1 || q_heads % kv_heads != 0) {
    fail("query heads (" + std::to_string(q_heads) +
         ") must be a positive multiple of key/value heads (" + std::to_string(kv_heads) + ")");
  }
  if (context < 1) {
    fail("keys must hold at least one position, got codes of shape " + shape_str(keys[0].shape()));
  }
  if (query_len < 1) {
    fail("queries must hold at least one position, got shape " + shape_str(queries.shape()));
  }
  if (causal && mask) {
    fail("pass either an explicit mask or causal=True, not both");
  }
  if (causal && query_len > context) {
    fail("causal attention needs query length <= context, got L=" + std::to_string(query_len) +
         " > S=" + std::to_string(context));
  }
  std::vector<mx::array> inputs = {queries, keys[0], keys[1], keys[2], values[0], values[1], values[2]};
  if (mask) {
    check_mask(kOp, *mask, {batch, q_heads, query_len, context});
    inputs.push_back(*mask);
  }
  const auto stream = mx::to_stream(s);
  const int row_ranges = add_row_ranges(kOp, inputs, starts, ends, batch, context, stream);
  return mx::array(
      queries.shape(), queries.dtype(),
      std::make_shared<DecodeAttentionQuantized>(stream, scale, causal, group_size, bits,
                                                 mask.has_value(), row_ranges),
      std::move(inputs));
}

bool DecodeAttentionQuantized::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeAttentionQuantized&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && group_size_ == o.group_size_ &&
         bits_ == o.bits_ && has_mask_ == o.has_mask_ && row_ranges_ == o.row_ranges_;
}

void DecodeAttentionQuantized::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  QuantizedProblem p =
      problem(inputs, [](const mx::array& a) { return static_cast<const void*>(a.data<void>()); });
  p.out = out.data<void>();
  const CpuPath path = cpu_path_from_env();
  encoder.dispatch([p, path]() { decode_attention_quantized_cpu(p, path); });
}

}  // namespace attn_kernels
