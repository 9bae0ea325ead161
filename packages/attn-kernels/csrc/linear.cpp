#include "linear.h"

#include <stdexcept>
#include <string>

#include <cstring>
#include <memory>

#include "mlx/backend/cpu/encoder.h"

#include "cpu_linear.h"
#include "op_checks.h"

namespace attn_kernels {

namespace {

constexpr const char* kOp = "decode_linear";

[[noreturn]] void fail(const std::string& message) {
  attn_kernels::fail(kOp, message);
}

void check_dtype(const char* name, const mx::array& a, mx::Dtype dtype) {
  if (a.dtype() != dtype) {
    fail(std::string(name) + " must have x's dtype " + dtype_str(dtype) + ", got " +
         dtype_str(a.dtype()));
  }
}

void check_shape(const char* name, const mx::array& a, const mx::Shape& expected,
                 const std::string& why) {
  if (a.shape() != expected) {
    fail(std::string(name) + " must have shape " + shape_str(expected) + why + ", got " +
         shape_str(a));
  }
}

}  // namespace

int64_t collapsed_row_stride(const mx::array& x) {
  const int K = x.shape(-1);
  if (x.flags().row_contiguous || x.size() == static_cast<size_t>(K)) return K;
  const int nd = x.ndim();
  if (x.strides()[nd - 1] != 1) return 0;
  for (int i = 0; i + 2 < nd; ++i) {
    if (x.shape(i) > 1 && x.strides()[i] != x.strides()[i + 1] * x.shape(i + 1)) return 0;
  }
  return x.strides()[nd - 2];
}

mx::array decode_linear(
    const mx::array& x,
    const mx::array& weight,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    const std::optional<mx::array>& bias,
    int group_size,
    int bits,
    const std::optional<mx::array>& gate,
    mx::StreamOrDevice s) {
  if (x.ndim() < 1) fail("x must have at least one dimension (..., K), got a scalar");
  if (!is_float(x.dtype())) {
    fail("x must be float32, float16 or bfloat16, got " + dtype_str(x.dtype()));
  }
  const int K = x.shape(-1);
  if (K < 1) fail("x's last dimension K must be at least 1, got shape " + shape_str(x));
  if (weight.ndim() != 2) {
    fail("weight must have 2 dimensions (N, K), got shape " + shape_str(weight));
  }
  const int N = weight.shape(0);
  std::vector<mx::array> inputs = {x, weight};
  if (bits == 0) {
    check_dtype("weight", weight, x.dtype());
    check_shape("weight", weight, {N, K}, " (x's K = " + std::to_string(K) + ")");
    if (scales || biases) fail("scales and biases are for quantized weights (bits 4 or 8)");
  } else {
    if (bits != 4 && bits != 8) fail("bits must be 0 (dense), 4 or 8, got " + std::to_string(bits));
    if (group_size != 32 && group_size != 64 && group_size != 128) {
      fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
    }
    if (K % group_size != 0) {
      fail("group_size " + std::to_string(group_size) + " does not divide x's K = " +
           std::to_string(K));
    }
    if (weight.dtype() != mx::uint32) {
      fail("a quantized weight must be uint32 codes (mx.quantize's packing), got " +
           dtype_str(weight.dtype()));
    }
    check_shape("weight", weight, {N, K * bits / 32},
                " (x's K = " + std::to_string(K) + " at bits=" + std::to_string(bits) +
                    "; were the codes quantized with other bits?)");
    if (!scales || !biases) fail("a quantized weight needs its scales and biases");
    const mx::Shape groups = {N, K / group_size};
    const std::string why = " (one per group of " + std::to_string(group_size) +
                            " values; was it quantized with another group_size?)";
    check_dtype("scales", *scales, x.dtype());
    check_shape("scales", *scales, groups, why);
    check_dtype("biases", *biases, x.dtype());
    check_shape("biases", *biases, groups, why);
    inputs.push_back(*scales);
    inputs.push_back(*biases);
  }
  if (bias) {
    check_dtype("bias", *bias, x.dtype());
    check_shape("bias", *bias, {N}, " (one per output)");
    inputs.push_back(*bias);
  }
  if (gate) {
    check_dtype("gate", *gate, x.dtype());
    check_shape("gate", *gate, x.shape(), " (x's: silu(gate) * x is the layer's input)");
    inputs.push_back(*gate);
  }
  if (mx::to_stream(s).device == mx::Device::gpu) {
    if (bits == 0) {
      fail("a GPU stream takes 4- or 8-bit codes; dense weights run MLX's matmul there "
           "(attn_kernels.decode_linear calls it)");
    }
    if (x.dtype() == mx::float32) {
      fail("a GPU stream takes bfloat16 or float16 x (the tensor cores' operands), got float32");
    }
    if (gate) fail("gate runs on the CPU only; on a GPU stream pass swiglu(gate, x) as x");
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  return mx::array(
      std::move(out_shape), x.dtype(),
      std::make_shared<DecodeLinear>(mx::to_stream(s), bits, group_size, bias.has_value(),
                                     gate.has_value()),
      std::move(inputs));
}

bool DecodeLinear::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeLinear&>(other);
  return bits_ == o.bits_ && group_size_ == o.group_size_ && has_bias_ == o.has_bias_ &&
         has_gate_ == o.has_gate_;
}

std::vector<mx::Shape> DecodeLinear::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

// An input as the dispatched task sees it: its data, or, where the kernel cannot read it in
// place, a row-contiguous copy that the task makes (inputs are ready only there).
struct Operand {
  const char* data;
  mx::Shape shape;
  mx::Strides strides;
  int itemsize;
  bool copy;

  Operand(const mx::array& a, bool in_place)
      : data(static_cast<const char*>(a.data<void>())),
        shape(a.shape()),
        strides(a.strides()),
        itemsize(static_cast<int>(a.itemsize())),
        copy(!in_place) {}

  // The elements in row-major order into `dst` (any strides; rare: a transposed or sliced view).
  void gather(char* dst) const {
    const int nd = static_cast<int>(shape.size());
    std::vector<int> index(nd, 0);
    size_t n = 1;
    for (int d : shape) n *= d;
    for (size_t i = 0; i < n; ++i) {
      int64_t at = 0;
      for (int d = 0; d < nd; ++d) at += index[d] * strides[d];
      std::memcpy(dst + i * itemsize, data + at * itemsize, itemsize);
      for (int d = nd - 1; d >= 0 && ++index[d] == shape[d]; --d) index[d] = 0;
    }
  }
};

void DecodeLinear::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  const mx::array& x = inputs[0];
  const int64_t stride = collapsed_row_stride(x);
  const int64_t gate_stride = has_gate_ ? collapsed_row_stride(inputs.back()) : 0;
  std::vector<Operand> operands = {Operand(x, stride != 0)};
  for (size_t i = 1; i < inputs.size(); ++i) {
    const bool in_place = has_gate_ && i + 1 == inputs.size() ? gate_stride != 0
                                                                : inputs[i].flags().row_contiguous;
    operands.emplace_back(inputs[i], in_place);
  }
  LinearProblem p{};
  p.inputs = x.shape(-1);
  p.outputs = inputs[1].shape(0);
  p.rows = static_cast<int>(x.size() / p.inputs);
  p.dtype = element_type(x.dtype());
  p.bits = bits_;
  p.group_size = group_size_;
  p.x_row_stride = stride ? stride : p.inputs;
  p.gate_row_stride = gate_stride ? gate_stride : p.inputs;
  p.out = out.data<void>();
  if (p.rows == 0) return;
  encoder.dispatch([p, operands = std::move(operands), has_bias = has_bias_,
                    has_gate = has_gate_, path = cpu_path_from_env()]() mutable {
    std::vector<std::unique_ptr<char[]>> copies;
    std::vector<const void*> data;
    for (const Operand& o : operands) {
      if (!o.copy) {
        data.push_back(o.data);
        continue;
      }
      size_t n = 1;
      for (int d : o.shape) n *= d;
      copies.emplace_back(new char[n * o.itemsize]);
      o.gather(copies.back().get());
      data.push_back(copies.back().get());
    }
    p.x = data[0];
    p.weight = data[1];
    size_t next = 2;
    if (p.bits) {
      p.scales = data[next++];
      p.biases = data[next++];
    }
    p.bias = has_bias ? data[next++] : nullptr;
    p.gate = has_gate ? data[next] : nullptr;
    linear_cpu(p, path);
  });
}

}  // namespace attn_kernels
