// AttentionStep's eval_gpu through MLX's CUDA command encoder: the preprocessing kernel
// (attention_step.cu), then DecodeAttention's attend kernel over the updated caches, as graph
// nodes with their dependencies; a cache copy first when a cache cannot be donated, and the
// token-first reordering after attention when L > 1. With fold (the primitive's; unset: the
// process default: on unless ATTN_STEP_FOLD=0), where the attention runs split-mma on donated caches (the
// decode case) and L <= 8 (plan.attend_step), one kernel does both (attend_mma_step,
// decode_attention_mma.cuh).
#include <cstdlib>
#include <string>

#include "attention_step.h"
#include "attention_step_cuda.h"
#include "decode_attention_cuda.h"
#include "decode_attention_quantized_cuda.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "output_memory_cuda.h"

namespace attn_kernels {

namespace {

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// An array's device memory (gpu_ptr, never data(): kernels-cuda/README.md).
void* device_pointer(const mx::array& a) {
  return const_cast<void*>(static_cast<const void*>(mx::gpu_ptr<char>(a)));
}

// The fold's process default, for calls that leave it unset: on, unless ATTN_STEP_FOLD=0 (read
// once). On the H200 (8340ee2, one process, rounds rotated) it launched 364 kernels per step
// instead of 400 and decoded as fast as the two kernels (docs/fused-step.md).
bool fold_by_default() {
  static const bool enabled = [] {
    const char* v = std::getenv("ATTN_STEP_FOLD");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

void add_copy(mx::cu::CommandEncoder& encoder, cuda::StridedCopy copy, size_t itemsize) {
  void* args[] = {&copy};
  const cuda::CopyLaunch launch = cuda::plan_copy(copy, itemsize);
  encoder.add_kernel_node_raw(
      launch.kernel, dim3(launch.blocks), dim3(cuda::kCopyThreads), dim3(1, 1, 1), 0, args);
}

// The caches that could not be donated get their own buffers (outputs[1...]), filled from
// their inputs (from first_input on) by copy nodes. From MLX's allocator, not allocate_output:
// the next step donates a cache only where MLX owns its buffer (is_owned()), so a cache in the
// extension's blocks would be copied again at every step.
void allocate_caches(std::vector<mx::array>& outputs, const std::vector<bool>& donated) {
  for (size_t c = 0; c < donated.size(); ++c) {
    if (!donated[c]) {
      outputs[1 + c].set_data(mx::allocator::malloc(outputs[1 + c].nbytes()));
    }
  }
}

void copy_caches(
    mx::cu::CommandEncoder& encoder,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const std::vector<bool>& donated,
    int first_input) {
  for (size_t c = 0; c < donated.size(); ++c) {
    if (!donated[c]) {
      const auto& in = inputs[first_input + c];
      cuda::StridedCopy copy{mx::gpu_ptr<void>(in), mx::gpu_ptr<void>(outputs[1 + c]), {}, {}, 0};
      for (int a = 0; a < 4; ++a) {
        copy.shape[a] = in.shape(a);
        copy.strides[a] = in.strides()[a];
      }
      copy.size = static_cast<int64_t>(in.size());
      encoder.set_input_array(in);
      encoder.set_output_array(outputs[1 + c]);
      add_copy(encoder, copy, in.itemsize());
    }
  }
}

// out's allocation: out | rotated queries (B, Hq, L, D) | heads-first attention output when
// L > 1 | the split attention's partial states (as DecodeAttention keeps them behind its
// output: one allocation per call). Byte offsets.
struct Scratch {
  size_t q_at, heads_at, partials_at;
};
Scratch scratch_layout(const StepProblem& step, const mx::array& out) {
  const int L = step.length;
  const size_t q_bytes = size_t(step.batch) * step.q_heads * L * step.head_dim * out.itemsize();
  const size_t q_at = align256(out.nbytes());
  const size_t heads_at = align256(q_at + q_bytes);
  return {q_at, heads_at, L > 1 ? align256(heads_at + q_bytes) : heads_at};
}

// The preprocessing kernel (norms, RoPE, the cache writes) as its own node.
void add_preprocess(mx::cu::CommandEncoder& encoder, StepProblem& step) {
  void* args[] = {&step};
  const unsigned heads = step.q_heads + step.kv_heads;
  const unsigned head_blocks = (heads + cuda::kStepWarps - 1) / cuda::kStepWarps;
  encoder.add_kernel_node_raw(
      cuda::step_preprocess_kernel(step.dtype), dim3(step.batch * step.length, head_blocks),
      dim3(cuda::kStepWarps * 32), dim3(1, 1, 1), 0, args);
}

// When L > 1: (B, Hq, L, D) -> (B, L, Hq, D), the source read as (B, L, Hq, D) via strides.
void add_reorder(
    mx::cu::CommandEncoder& encoder, mx::array& out, char* base, size_t heads_at,
    const StepProblem& step) {
  const int L = step.length, H = step.q_heads, D = step.head_dim;
  if (L == 1) return;
  cuda::StridedCopy reorder{
      base + heads_at, base, {step.batch, L, H, D},
      {int64_t{H} * L * D, D, int64_t{L} * D, 1}, int64_t{step.batch} * L * H * D};
  encoder.set_output_array(out);
  add_copy(encoder, reorder, out.itemsize());
}

}  // namespace

void AttentionStep::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& encoder = mx::cu::get_command_encoder(stream());
  const auto donated = donate_caches(inputs, outputs, owned_caches_);
  allocate_caches(outputs, donated);
  StepProblem step = make_step_problem(inputs, outputs, offset_, qk_norm_, kQNormInput, eps_,
                                       rope_base_, rope_freqs_, 0, 0, row_ranges_, position_,
                                       device_pointer);

  const int L = step.length;
  const Scratch at = scratch_layout(step, out);
  // Planned with the scratch's alignment (256 bytes; plan() checks 16), then pointed at it.
  DecodeProblem attention =
      make_step_attention(step, reinterpret_cast<const void*>(uintptr_t{256}), nullptr, scale_);
  const cuda::Plan plan = cuda::plan(attention, cuda::parse_schedule(schedule_));
  allocate_output(out, at.partials_at + plan.partial_floats * sizeof(float), encoder);
  char* base = mx::gpu_ptr<char>(out);
  step.q_out = base + at.q_at;
  attention.queries = step.q_out;
  attention.out = L == 1 ? static_cast<void*>(base) : base + at.heads_at;
  float* partials = plan.splits > 1 ? reinterpret_cast<float*>(base + at.partials_at) : nullptr;
  copy_caches(encoder, inputs, outputs, donated, kKCacheInput);

  // Dependencies by buffer: a node follows the last writer of every buffer it names. The
  // caches are named as outputs by both nodes (also the attend node, which only reads them), so
  // the next writer of a cache waits for this step's reads, and no cache is counted as bytes
  // read into the graph (MLX's commit heuristic).
  for (int i = 0; i < static_cast<int>(inputs.size()); ++i) {
    if (i != kKCacheInput && i != kVCacheInput) {  // q, k, v and the norm weights
      encoder.set_input_array(inputs[i]);
    }
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  const dim3 attend_grid(plan.attend_grid[0], plan.attend_grid[1]);
  if (plan.attend_step && donated[0] && donated[1] && fold_.value_or(fold_by_default())) {
    count_folded_step();
    void* args[] = {&attention, &partials, &chunk, &slot, &step};
    encoder.add_kernel_node_raw(
        plan.attend_step, attend_grid, dim3(plan.attend_threads), dim3(1, 1, 1),
        plan.attend_step_smem, args);
  } else {
    add_preprocess(encoder, step);
    for (auto& o : outputs) {
      encoder.set_output_array(o);
    }
    void* attend_args[] = {&attention, &partials, &chunk, &slot};
    encoder.add_kernel_node_raw(
        plan.attend, attend_grid, dim3(plan.attend_threads), dim3(1, 1, 1), plan.attend_smem,
        attend_args);
  }
  add_reorder(encoder, out, base, at.heads_at, step);
}

// The quantized step: the preprocessing kernel quantizing the new keys and values into the
// triples (quantize_row), then the quantized attention kernel (plan_quantized) over them; cache
// copies first where a cache cannot be donated, the token-first reordering last when L > 1.
void AttentionStepQuantized::eval_gpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& encoder = mx::cu::get_command_encoder(stream());
  const auto donated = donate_caches(inputs, outputs, owned_caches_, kQuantizedCacheInput);
  allocate_caches(outputs, donated);
  StepProblem step =
      make_step_problem(inputs, outputs, offset_, qk_norm_, kQuantizedQNormInput, eps_,
                        rope_base_, rope_freqs_, bits_, group_size_, row_ranges_, -1,
                        device_pointer);

  const int L = step.length;
  const Scratch at = scratch_layout(step, out);
  QuantizedProblem attention = make_step_quantized_attention(
      step, reinterpret_cast<const void*>(uintptr_t{256}), nullptr, scale_);
  const cuda::QuantizedPlan plan = cuda::plan_quantized(attention);
  allocate_output(out, at.partials_at + plan.partial_floats * sizeof(float), encoder);
  char* base = mx::gpu_ptr<char>(out);
  step.q_out = base + at.q_at;
  attention.queries = step.q_out;
  attention.out = L == 1 ? static_cast<void*>(base) : base + at.heads_at;
  float* partials = plan.splits > 1 ? reinterpret_cast<float*>(base + at.partials_at) : nullptr;
  copy_caches(encoder, inputs, outputs, donated, kQuantizedCacheInput);
  // Dependencies as in AttentionStep::eval_gpu: the caches named as outputs only.
  for (int i = 0; i < static_cast<int>(inputs.size()); ++i) {
    if (i < kQuantizedCacheInput || i >= kQuantizedCacheInput + 6) {
      encoder.set_input_array(inputs[i]);
    }
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  add_preprocess(encoder, step);
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  int chunk = plan.chunk;
  unsigned slot = plan.arrival_slot;
  void* attend_args[] = {&attention, &partials, &chunk, &slot};
  encoder.add_kernel_node_raw(
      plan.attend, dim3(plan.grid[0], plan.grid[1]), dim3(plan.threads), dim3(1, 1, 1), plan.smem,
      attend_args);
  add_reorder(encoder, out, base, at.heads_at, step);
}

}  // namespace attn_kernels
