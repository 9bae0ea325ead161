// AttentionStep: one decode step of attention after the q/k/v projections, as one primitive:
// q/k RMSNorm (Qwen3; none for Llama or Qwen2), RoPE, the K/V cache write and grouped attention
// over the cache.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "decode_attention.h"
#include "op_checks.h"
#include "quantized_problem.h"
#include "step_problem.h"

namespace attn_kernels {

// q (B, L, Hq·D), k, v (B, L, Hkv·D): the new tokens' projections; q_norm_weight, k_norm_weight
// (D,), both or neither (then q and k are rotated as given, eps unused); k_cache, v_cache
// (B, Hkv, capacity, D), positions [0, offset) already written. Returns
// {out (B, L, Hq·D), k_cache', v_cache'}: the caches with the new k (normalised, rotated) and v
// at [offset, offset + L), and out = causal attention of the normalised, rotated q over
// [0, offset + L) in o_proj's layout. The caches are updated in place when their buffers can be
// donated (MLX's rule, as SliceUpdate applies it); otherwise they are copied once, in this op.
// owned_caches: the caller promises that no other array reading the caches' memory (a view of
// them) is read after this step at the positions it writes ([offset, offset + L), a ring's slot);
// then a cache array nothing else holds is updated in place even while an earlier step that read
// it still runs (MLX's rule copies it then).
// fold: on CUDA, where the attention plan is split-mma (bf16/f16, D 64, 80, 96, 128 or 256),
// L <= 8 and both caches are donated, the step runs as one kernel (attend_mma_step) instead of
// the preprocessing kernel and the attend kernel; unset: the process default (on;
// ATTN_STEP_FOLD=0 turns it off, read once). A CUDA schedule choice: the CPU and Metal ignore it.
// starts, offsets: per batch row (int32 (B,)): the row's first valid cache position (mlx-lm's
// left padding) and its own write position (rows of different lengths; `offset` is then the
// largest of them). Row b's tokens go to offsets[b] + i (else offset + i), are rotated by RoPE at
// that position minus starts[b], and attend to [starts[b], offsets[b] + L).
// rope_freqs: RoPE's period of each pair j < D/2 (mx.fast.rope's freqs: the angle at position p is
// p / rope_freqs[j]; Llama 3's scaled frequencies, linear position scaling) instead of
// rope_base's base^(2j/D); CPU and CUDA.
// position (>= 0): the caches are a full ring (a sliding window that has wrapped, mlx-lm's
// RotatingKVCache): the one new token (L = 1) is written at slot `offset`, rotated by RoPE at
// `position`, and attends every position of the caches; no per-row starts or offsets. -1: none.
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
    const std::string& schedule = "auto",
    bool owned_caches = false,
    std::optional<bool> fold = std::nullopt,
    const std::optional<mx::array>& starts = std::nullopt,
    const std::optional<mx::array>& offsets = std::nullopt,
    const std::vector<float>& rope_freqs = {},
    int position = -1,
    mx::StreamOrDevice s = {});

// The primitive's inputs: q, k, v, the caches, then the norm weights when it normalises, then the
// per-row starts and offsets its row_ranges names (RowRanges bits: kRowEnds for offsets).
constexpr int kKCacheInput = 3, kVCacheInput = 4, kQNormInput = 5, kKNormInput = 6;

class AttentionStep : public mx::Primitive {
 public:
  AttentionStep(
      mx::Stream stream,
      int offset,
      bool qk_norm,
      float eps,
      float rope_base,
      float scale,
      std::string schedule,
      bool owned_caches,
      std::optional<bool> fold,
      int row_ranges,
      std::vector<float> rope_freqs,
      int position)
      : mx::Primitive(stream),
        offset_(offset),
        qk_norm_(qk_norm),
        eps_(eps),
        rope_base_(rope_base),
        scale_(scale),
        schedule_(std::move(schedule)),
        owned_caches_(owned_caches),
        fold_(fold),
        row_ranges_(row_ranges),
        rope_freqs_(std::move(rope_freqs)),
        position_(position) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "AttentionStep"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[kKCacheInput].shape(), inputs[kVCacheInput].shape()};
  }

 private:
  int offset_;
  bool qk_norm_;  // RMS-normalise q and k (the weights are inputs 5 and 6)
  float eps_, rope_base_, scale_;
  std::string schedule_;
  bool owned_caches_;
  std::optional<bool> fold_;       // unset: the process default (CUDA only)
  int row_ranges_;                 // RowRanges bits: per-row starts, per-row offsets
  std::vector<float> rope_freqs_;  // RoPE's periods per pair (empty: from rope_base)
  int position_;                   // a full ring's sequence position (-1: not a ring)
};

// The step over a quantized cache (mlx-lm's QuantizedKVCache layout): k_cache and v_cache are
// (codes, scales, biases) triples of mx.quantize (codes uint32 (B, Hkv, capacity, D·bits/32),
// scales and biases (B, Hkv, capacity, D/group_size) in q's dtype); the new k (normalised,
// rotated, rounded to the dtype) and v are quantized as mx.quantize does on the backend that runs
// the step and written at [offset, offset + L); the attention reads the codes as
// decode_attention_quantized does. head_dim (the norm weights' size, else the codes' last size
// times 32 / bits) must be a multiple of 64 and of group_size. starts and offsets as in
// attention_step. Returns {out, the key triple', the value triple'}, donated or copied as
// attention_step's caches. Runs on the CPU and CUDA.
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
    bool owned_caches = false,
    const std::optional<mx::array>& starts = std::nullopt,
    const std::optional<mx::array>& offsets = std::nullopt,
    const std::vector<float>& rope_freqs = {},
    mx::StreamOrDevice s = {});

// AttentionStepQuantized's inputs: q, k, v, the key triple, the value triple, then the norm
// weights when it normalises, then the per-row starts and offsets; its outputs: out, then the six
// cache arrays in that order.
constexpr int kQuantizedCacheInput = 3, kQuantizedQNormInput = 9, kQuantizedKNormInput = 10;

class AttentionStepQuantized : public mx::Primitive {
 public:
  AttentionStepQuantized(
      mx::Stream stream,
      int offset,
      bool qk_norm,
      float eps,
      float rope_base,
      float scale,
      int group_size,
      int bits,
      bool owned_caches,
      int row_ranges,
      std::vector<float> rope_freqs)
      : mx::Primitive(stream),
        offset_(offset),
        qk_norm_(qk_norm),
        eps_(eps),
        rope_base_(rope_base),
        scale_(scale),
        group_size_(group_size),
        bits_(bits),
        owned_caches_(owned_caches),
        row_ranges_(row_ranges),
        rope_freqs_(std::move(rope_freqs)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "AttentionStepQuantized"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes = {inputs[0].shape()};
    for (int c = 0; c < 6; ++c) shapes.push_back(inputs[kQuantizedCacheInput + c].shape());
    return shapes;
  }

 private:
  int offset_;
  bool qk_norm_;
  float eps_, rope_base_, scale_;
  int group_size_, bits_;
  bool owned_caches_;
  int row_ranges_;
  std::vector<float> rope_freqs_;
};

// Gives each output cache (outputs[1], outputs[2]) its input's buffer when MLX may donate it
// (nothing else references it, same item size, row-contiguous, no larger than the output plus
// MLX's slack; with owned_caches: no other array holds it, whoever else holds its buffer). A
// cache not donated is left unallocated and counted: the caller copies it.
// The quantized step's six caches are outputs[1..6], inputs[first_cache_input...].
std::vector<bool> donate_caches(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    bool owned_caches,
    int first_cache_input = kKCacheInput);

// How many cache copies the op has made since the process started (a diagnostic: a decode
// loop whose caches can be donated makes none).
uint64_t attention_step_cache_copies();

// How many steps have run as one kernel (fold) since the process started (a diagnostic: the
// CUDA eval counts them; elsewhere it stays 0).
uint64_t attention_step_folds();
void count_folded_step();

// StepProblem::inv_freq: 1 / rope_freqs (RoPE's periods, as mx.fast.rope's freqs takes them),
// or for the problem's head_dim and RoPE base where rope_freqs is empty.
void set_inverse_frequencies(StepProblem& p, const std::vector<float>& rope_freqs);

// The StepProblem of evaluated inputs and allocated outputs (the caches: outputs[1...]), every
// pointer as `pointer(array)` gives it (CPU: data(), CUDA: gpu_ptr; Metal: nullptr), q_out left
// for the backend. With bits (the quantized step) the outputs are out and the two triples.
// norms_at: the input index of the q norm weight (none without qk_norm); the per-row starts and
// offsets that row_ranges names follow the norm weights. ring_position: attention_step's
// `position` (-1: the caches are not a ring).
template <typename Pointer>
StepProblem make_step_problem(
    const std::vector<mx::array>& inputs,
    const std::vector<mx::array>& outputs,
    int offset,
    bool qk_norm,
    int norms_at,
    float eps,
    float rope_base,
    const std::vector<float>& rope_freqs,
    int bits,
    int group_size,
    int row_ranges,
    int ring_position,
    Pointer pointer) {
  const auto& q = inputs[0];
  const auto& k_cache = outputs[1];
  // The quantized step's outputs: out, key codes, scales, biases, value codes, scales, biases.
  const auto& v_cache = outputs[bits ? 4 : 2];
  StepProblem p{};
  p.dtype = element_type(q.dtype());
  p.head_dim = bits ? k_cache.shape(3) * 32 / bits : k_cache.shape(3);
  p.bits = bits;
  p.group_size = group_size;
  p.qk_norm = qk_norm ? 1 : 0;
  p.batch = q.shape(0);
  p.length = q.shape(1);
  p.q_heads = q.shape(2) / p.head_dim;
  p.kv_heads = k_cache.shape(1);
  p.offset = offset;
  p.capacity = k_cache.shape(2);
  p.row_ranges = row_ranges;
  p.ring = ring_position >= 0 ? 1 : 0;
  p.rope_shift = ring_position >= 0 ? ring_position - offset : 0;
  p.eps = eps;
  p.log2_base = std::log2(rope_base);
  set_inverse_frequencies(p, rope_freqs);
  for (int i = 0; i < 3; ++i) {
    p.q_strides[i] = inputs[0].strides()[i];
    p.k_strides[i] = inputs[1].strides()[i];
    p.v_strides[i] = inputs[2].strides()[i];
  }
  for (int i = 0; i < 4; ++i) {
    p.kc_strides[i] = k_cache.strides()[i];
    p.vc_strides[i] = v_cache.strides()[i];
    p.sb_strides[i] = bits ? outputs[2].strides()[i] : 0;  // every scale and bias array alike
  }
  p.q = pointer(inputs[0]);
  p.k = pointer(inputs[1]);
  p.v = pointer(inputs[2]);
  p.q_weight = qk_norm ? pointer(inputs[norms_at]) : nullptr;
  p.k_weight = qk_norm ? pointer(inputs[norms_at + 1]) : nullptr;
  p.k_cache = pointer(outputs[1]);
  p.v_cache = pointer(v_cache);
  if (bits) {
    p.k_scales = pointer(outputs[2]);
    p.k_biases = pointer(outputs[3]);
    p.v_scales = pointer(outputs[5]);
    p.v_biases = pointer(outputs[6]);
  }
  int next = norms_at + (qk_norm ? 2 : 0);
  p.row_starts = nullptr;
  p.row_offsets = nullptr;
  if (row_ranges & kRowStarts) p.row_starts = static_cast<const int32_t*>(pointer(inputs[next++]));
  if (row_ranges & kRowEnds) p.row_offsets = static_cast<const int32_t*>(pointer(inputs[next++]));
  return p;
}

}  // namespace attn_kernels
