// AttentionStep: one decode step of attention after the q/k/v projections, as one primitive:
// q/k RMSNorm (Qwen3; none for Llama or Qwen2), RoPE, the K/V cache write and grouped attention
// over the cache.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "decode_attention.h"
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
// them) is read past offset after this step; then a cache array nothing else holds is updated in
// place even while an earlier step that read it still runs (MLX's rule copies it then).
// fold: on CUDA, where the attention plan is split-mma (bf16/f16, D 64 or 128), L <= 8 and both
// caches are donated, the step runs as one kernel (attend_mma_step) instead of the preprocessing
// kernel and the attend kernel; unset: the process default (on; ATTN_STEP_FOLD=0 turns it off,
// read once). A CUDA schedule choice: the CPU and Metal ignore it.
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
    mx::StreamOrDevice s = {});

// The primitive's inputs: q, k, v, the caches, then the norm weights when it normalises.
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
      std::optional<bool> fold)
      : mx::Primitive(stream),
        offset_(offset),
        qk_norm_(qk_norm),
        eps_(eps),
        rope_base_(rope_base),
        scale_(scale),
        schedule_(std::move(schedule)),
        owned_caches_(owned_caches),
        fold_(fold) {}

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
  std::optional<bool> fold_;  // unset: the process default (CUDA only)
};

// The step over a quantized cache (mlx-lm's QuantizedKVCache layout): k_cache and v_cache are
// (codes, scales, biases) triples of mx.quantize (codes uint32 (B, Hkv, capacity, D·bits/32),
// scales and biases (B, Hkv, capacity, D/group_size) in q's dtype); the new k (normalised,
// rotated, rounded to the dtype) and v are quantized as mx.quantize does on the backend that runs
// the step and written at [offset, offset + L); the attention reads the codes as
// decode_attention_quantized does. head_dim (the norm weights' size, else the codes' last size
// times 32 / bits) must be a multiple of 64 and of group_size. Returns {out, the key triple',
// the value triple'}, donated or copied as attention_step's caches. Runs on the CPU and CUDA.
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
    mx::StreamOrDevice s = {});

// AttentionStepQuantized's inputs: q, k, v, the key triple, the value triple, then the norm
// weights when it normalises; its outputs: out, then the six cache arrays in that order.
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
      bool owned_caches)
      : mx::Primitive(stream),
        offset_(offset),
        qk_norm_(qk_norm),
        eps_(eps),
        rope_base_(rope_base),
        scale_(scale),
        group_size_(group_size),
        bits_(bits),
        owned_caches_(owned_caches) {}

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

// The StepProblem of evaluated inputs and allocated outputs, pointers left for the backend
// (CPU: data(), CUDA: gpu_ptr) to fill (the norm weights' only where qk_norm). With bits (the
// quantized step) the outputs are out and the two triples, and their strides are set too.
StepProblem make_step_problem(
    const std::vector<mx::array>& inputs,
    const std::vector<mx::array>& outputs,
    int offset,
    bool qk_norm,
    float eps,
    float rope_base,
    int bits = 0,
    int group_size = 0);

// StepProblem::inv_freq for its head_dim and RoPE base, for the backends that read it (CUDA).
void set_inverse_frequencies(StepProblem& p);

// The attention over the updated cache: queries (B, Hq, L, D) contiguous at `queries`, keys and
// values the output caches' first offset + L positions, causal; writes (B, Hq, L, D) to `out`.
DecodeProblem make_step_attention(
    const StepProblem& step, const void* queries, const void* keys, const void* values,
    void* out, float scale);

// The quantized step's attention over the updated triples (its outputs' first offset + L
// positions), queries as in make_step_attention; pointers to fill as there: the caches' from
// the StepProblem, the queries and output given.
QuantizedProblem make_step_quantized_attention(
    const StepProblem& step, const void* queries, void* out, float scale);

}  // namespace attn_kernels
