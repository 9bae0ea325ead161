"""Grouped-query decode attention for MLX.

- `scaled_dot_product_attention`: the readable mlx.core oracle (and the composition baseline).
- `decode_attention_custom`: the fused `DecodeAttention` primitive (CPU, CUDA, Metal).
- `decode_attention_quantized`: the same over a quantized KV cache (mlx-lm's layout).
- `attention_step`: q/k RMSNorm, RoPE, the K/V cache write and decode attention in one
  `AttentionStep` primitive (docs/fused-step.md); `attention_step_quantized` the same over a
  quantized cache.
- `decode_linear`, `decode_linear_quantized`: a decode step's linear layers on the CPU, each
  weight read once (dense, or mlx-lm's quantized layout as stored).
- `graph_limits`: how many kernels MLX's CUDA backend puts in one graph on a stream;
  `output_memory`: where our ops' outputs live on it (device memory the extension keeps).
"""

import mlx.core  # noqa: F401  (loads libmlx before the extension)

from attn_kernels.attention import (
    MAX_HEAD_DIM,
    SCHEDULES,
    causal_mask,
    decode_attention_custom,
    range_mask,
    scaled_dot_product_attention,
)
from attn_kernels.attention_step import (
    attention_step,
    attention_step_cache_copies,
    attention_step_folds,
    attention_step_quantized,
)
from attn_kernels.cuda_backend import graph_limits, output_memory
from attn_kernels.linear import decode_linear, decode_linear_quantized
from attn_kernels.quantized import decode_attention_quantized, dequantize_kv

__all__ = [
    "MAX_HEAD_DIM",
    "SCHEDULES",
    "attention_step",
    "attention_step_cache_copies",
    "attention_step_folds",
    "attention_step_quantized",
    "causal_mask",
    "decode_attention_custom",
    "decode_attention_quantized",
    "decode_linear",
    "decode_linear_quantized",
    "dequantize_kv",
    "graph_limits",
    "output_memory",
    "range_mask",
    "scaled_dot_product_attention",
]
__version__ = "0.1.0"
