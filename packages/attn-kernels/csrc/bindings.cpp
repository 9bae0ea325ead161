#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/variant.h>

#include "attention_step.h"
#include "decode_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "DecodeAttention: fused one-pass decode attention for MLX";
  m.attr("MAX_HEAD_DIM") = attn_kernels::kMaxHeadDim;
  m.attr("SCHEDULES") = nb::cast(attn_kernels::schedules());
  m.def(
      "measure_read_bandwidth",
      &attn_kernels::measure_read_bandwidth,
      "bytes"_a = size_t{1} << 30,
      "repeats"_a = 5,
      "Best read rate in bytes/s of the CPU kernel's threads streaming over `bytes` of memory.");
  m.def(
      "decode_attention",
      &attn_kernels::decode_attention,
      "queries"_a,
      "keys"_a,
      "values"_a,
      "scale"_a,
      "mask"_a = nb::none(),
      "causal"_a = false,
      "schedule"_a = "auto",
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Grouped-query attention over flattened heads, one pass of online softmax.

Args:
    queries: (B, Hq, L, D).
    keys, values: (B, Hkv, S, D), Hq % Hkv == 0; strided views are read in place.
    scale: multiplier of the dot products.
    mask: optional (B, Hq, L, S), additive float or boolean (True keeps a key).
    causal: query i sees keys <= S - L + i (no mask tensor is built).
    schedule: GPU kernel schedule (auto, split-mma, split, split-gqa, chapter-8/16/32); the CPU ignores it.

Returns:
    (B, Hq, L, D) in the queries' dtype. A row whose mask removes every key is all zeros.)");
  m.def(
      "attention_step",
      &attn_kernels::attention_step,
      "q"_a,
      "k"_a,
      "v"_a,
      "q_norm_weight"_a,
      "k_norm_weight"_a,
      "k_cache"_a,
      "v_cache"_a,
      "offset"_a,
      "eps"_a,
      "rope_base"_a,
      "scale"_a,
      "schedule"_a = "auto",
      nb::kw_only(),
      "stream"_a = nb::none(),
      "One decode step of attention after the projections (see attn_kernels.attention_step).");
  m.def(
      "attention_step_cache_copies",
      &attn_kernels::attention_step_cache_copies,
      "How many times attention_step has copied a cache it could not update in place.");
}
