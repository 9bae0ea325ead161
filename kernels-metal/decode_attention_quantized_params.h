// Parameters of the Metal quantized-KV kernel: the call's geometry (attention_geometry.h) and the
// quantized arrays' layout. One layout on both sides (eval_gpu_metal_quantized.cpp, the emulation).
#pragma once

#include "attention_geometry.h"

// Keys and values are mx.quantize triples: codes (uint32), scales and biases (the queries'
// type). The buffers: queries, the key triple, the value triple, the mask, the output, these
// parameters, then the per-row starts and ends (as in DecodeAttentionParams).
struct QuantizedAttentionParams : attn_kernels::AttentionGeometry {
  int group_size;
  int bits;
  // codes, scales, biases: [array * 4 + axis], elements
  attn_i64 k_strides[12];
  attn_i64 v_strides[12];
};
