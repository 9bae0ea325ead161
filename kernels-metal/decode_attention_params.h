// Parameters of the Metal DecodeAttention kernel: the call's geometry, which every backend reads
// (packages/attn-kernels/csrc/attention_geometry.h), and the key/value strides. One layout on
// both sides (the launcher, eval_gpu_metal.cpp, and the emulation build it on the host).
#pragma once

#include "attention_geometry.h"

// The buffers: queries, keys, values, the mask, the output, these parameters, then the per-row
// starts and ends (int32; a stand-in that is never read where row_ranges lacks their bit).
struct DecodeAttentionParams : attn_kernels::AttentionGeometry {
  // Element strides of (batch, head, position, dim).
  attn_i64 k_strides[4];
  attn_i64 v_strides[4];
};
