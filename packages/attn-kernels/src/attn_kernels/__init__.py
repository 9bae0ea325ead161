"""Grouped-query decode attention for MLX.

- `scaled_dot_product_attention`: the readable mlx.core oracle and fallback.
- `decode_attention_custom`: the fused `DecodeAttention` primitive (CPU, CUDA, Metal).
"""

import mlx.core  # noqa: F401  (loads libmlx before the extension)

from attn_kernels.attention import (
    MAX_HEAD_DIM,
    SCHEDULES,
    causal_mask,
    decode_attention_custom,
    scaled_dot_product_attention,
)

__all__ = [
    "MAX_HEAD_DIM",
    "SCHEDULES",
    "causal_mask",
    "decode_attention_custom",
    "scaled_dot_product_attention",
]
__version__ = "0.1.0"
