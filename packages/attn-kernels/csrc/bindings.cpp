#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/variant.h>

#include "attention_step.h"
#include "decode_attention.h"
#include "decode_attention_quantized.h"
#include "graph_limits.h"
#include "linear.h"
#include "output_memory.h"

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
      "cpu_paths",
      [] {
        std::vector<std::string> names;
        for (auto path : attn_kernels::cpu_paths_supported()) {
          names.emplace_back(attn_kernels::cpu_path_name(path));
        }
        return names;
      },
      "The CPU kernel's instruction-set paths this CPU runs, best first.");
  m.def(
      "cpu_path",
      [] { return std::string(attn_kernels::cpu_path_name(attn_kernels::cpu_path_from_env())); },
      "The CPU kernel's path for the next call: $ATTN_KERNELS_CPU_PATH (avx512, avx2, portable, "
      "neon), else the best this CPU runs. ValueError for a path this CPU or build lacks.");
  m.def("cpu_threads", &attn_kernels::cpu_threads, "Threads the CPU kernel's pool runs.");
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
      "starts"_a = nb::none(),
      "ends"_a = nb::none(),
      "stream"_a = nb::none(),
      R"(Grouped-query attention over flattened heads, one pass of online softmax.

Args:
    queries: (B, Hq, L, D).
    keys, values: (B, Hkv, S, D), Hq % Hkv == 0; strided views are read in place.
    scale: multiplier of the dot products.
    mask: optional (B, Hq, L, S), additive float or boolean (True keeps a key).
    causal: query i sees keys <= end - L + i (no mask tensor is built).
    schedule: GPU kernel schedule (auto, split-mma, split, split-gqa, chapter-8/16/32); the CPU ignores it.
    starts, ends: optional int32 (B,): batch row b sees cache positions [starts[b], ends[b])
        (defaults 0 and S) instead of a mask.

Returns:
    (B, Hq, L, D) in the queries' dtype. A row that sees no key is all zeros.)");
  m.def(
      "decode_attention_quantized",
      &attn_kernels::decode_attention_quantized,
      "queries"_a,
      "keys"_a,
      "values"_a,
      "scale"_a,
      "mask"_a = nb::none(),
      "causal"_a = false,
      "group_size"_a = 64,
      "bits"_a = 8,
      nb::kw_only(),
      "starts"_a = nb::none(),
      "ends"_a = nb::none(),
      "stream"_a = nb::none(),
      R"(decode_attention over a quantized cache: keys and values are mx.quantize triples.

Args:
    queries: (B, Hq, L, D).
    keys, values: [codes, scales, biases]: codes uint32 (B, Hkv, S, D * bits / 32), scales and
        biases (B, Hkv, S, D / group_size) in the queries' dtype; strided views are read in place.
    scale, mask, causal, starts, ends: as in decode_attention.
    group_size: 32, 64 or 128, dividing D. bits: 4 or 8.

Returns:
    (B, Hq, L, D) in the queries' dtype.)");
  m.def(
      "attention_step",
      &attn_kernels::attention_step,
      "q"_a,
      "k"_a,
      "v"_a,
      "q_norm_weight"_a.none(),
      "k_norm_weight"_a.none(),
      "k_cache"_a,
      "v_cache"_a,
      "offset"_a,
      "eps"_a,
      "rope_base"_a,
      "scale"_a,
      "schedule"_a = "auto",
      "owned_caches"_a = false,
      "fold"_a = nb::none(),
      nb::kw_only(),
      "starts"_a = nb::none(),
      "offsets"_a = nb::none(),
      "rope_freqs"_a = std::vector<float>{},
      "position"_a = -1,
      "stream"_a = nb::none(),
      "One decode step of attention after the projections (see attn_kernels.attention_step).");
  m.def(
      "attention_step_quantized",
      &attn_kernels::attention_step_quantized,
      "q"_a,
      "k"_a,
      "v"_a,
      "q_norm_weight"_a.none(),
      "k_norm_weight"_a.none(),
      "k_cache"_a,
      "v_cache"_a,
      "offset"_a,
      "eps"_a,
      "rope_base"_a,
      "scale"_a,
      "group_size"_a,
      "bits"_a,
      "owned_caches"_a = false,
      nb::kw_only(),
      "starts"_a = nb::none(),
      "offsets"_a = nb::none(),
      "rope_freqs"_a = std::vector<float>{},
      "stream"_a = nb::none(),
      "One decode step over a quantized cache (see attn_kernels.attention_step_quantized).");
  m.def(
      "attention_step_cache_copies",
      &attn_kernels::attention_step_cache_copies,
      "How many times attention_step has copied a cache it could not update in place.");
  m.def(
      "decode_linear",
      &attn_kernels::decode_linear,
      "x"_a,
      "weight"_a,
      "scales"_a = nb::none(),
      "biases"_a = nb::none(),
      "bias"_a = nb::none(),
      "group_size"_a = 64,
      "bits"_a = 0,
      "gate"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x @ weight.T (+ bias) on the CPU linear kernel (see attn_kernels.decode_linear).");
  m.def(
      "set_graph_limits",
      &attn_kernels::set_graph_limits,
      "stream"_a,
      "max_ops"_a = 0,
      "max_mb"_a = 0,
      "The stream's CUDA graph commit limits (ops, MB) before the call, setting each that is > 0 "
      "(see attn_kernels.graph_limits); None without CUDA graphs.");
  m.def(
      "output_memory",
      [](std::optional<bool> device) -> std::optional<nb::dict> {
        const auto state = attn_kernels::output_memory(device);
        if (!state) return std::nullopt;
        nb::dict d;
        d["device"] = state->device;
        d["live_bytes"] = state->live_bytes;
        d["cached_bytes"] = state->cached_bytes;
        d["allocations"] = state->allocations;
        return d;
      },
      "device"_a = nb::none(),
      "Where our CUDA ops' outputs live, after setting `device` where given (see "
      "attn_kernels.output_memory); None without the CUDA backend.");
  m.def(
      "attention_step_folds",
      &attn_kernels::attention_step_folds,
      "How many attention steps have run as one kernel (CUDA's fold).");
}
