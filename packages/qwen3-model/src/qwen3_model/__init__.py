"""Qwen3 on MLX with a preallocated KV cache and the fused decode-attention dispatch guard."""

from qwen3_model.cache import KVCache, make_cache
from qwen3_model.configs import CONFIGS, ModelArgs
from qwen3_model.loading import load, save, weight_bytes
from qwen3_model.model import CHECKPOINTS, MAX_CONTEXT, MAX_QUERY, Model
from qwen3_model.quantized_cache import QuantizedKVCache

__all__ = [
    "CHECKPOINTS",
    "CONFIGS",
    "MAX_CONTEXT",
    "MAX_QUERY",
    "KVCache",
    "Model",
    "ModelArgs",
    "QuantizedKVCache",
    "load",
    "make_cache",
    "save",
    "weight_bytes",
]
__version__ = "0.1.0"
