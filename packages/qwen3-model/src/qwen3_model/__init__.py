"""Qwen3 on MLX with a preallocated KV cache and the fused decode-attention dispatch guard."""

from qwen3_model.cache import KVCache, make_cache
from qwen3_model.configs import CONFIGS, ModelArgs
from qwen3_model.loading import load, save, weight_bytes
from qwen3_model.model import CHECKPOINTS, Model

__all__ = [
    "CHECKPOINTS",
    "CONFIGS",
    "KVCache",
    "Model",
    "ModelArgs",
    "load",
    "make_cache",
    "save",
    "weight_bytes",
]
__version__ = "0.1.0"
