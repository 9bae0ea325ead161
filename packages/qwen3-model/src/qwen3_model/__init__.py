"""Qwen3 on MLX with a preallocated KV cache and the fused decode-attention dispatch guard.

As in mlx-lm, the function `generate` shadows the module `qwen3_model.generate` here; the module
stays importable (`from qwen3_model.generate import main`)."""

from qwen3_model.batch import (
    BatchGenerator,
    BatchKVCache,
    BatchResponse,
    BatchResult,
    batch_generate,
)
from qwen3_model.cache import KVCache, make_cache
from qwen3_model.configs import CONFIGS, ModelArgs
from qwen3_model.generate import (
    GenerationResponse,
    generate,
    generate_step,
    make_sampler,
    stream_generate,
)
from qwen3_model.loading import (
    QUANTIZATIONS,
    CheckpointError,
    describe_weights,
    load,
    save,
    weight_bytes,
)
from qwen3_model.model import CHECKPOINTS, Model
from qwen3_model.quantized_cache import QuantizedKVCache
from qwen3_model.tokenizer import Tokenizer

__all__ = [
    "CHECKPOINTS",
    "CONFIGS",
    "QUANTIZATIONS",
    "BatchGenerator",
    "BatchKVCache",
    "BatchResponse",
    "BatchResult",
    "CheckpointError",
    "GenerationResponse",
    "KVCache",
    "Model",
    "ModelArgs",
    "QuantizedKVCache",
    "Tokenizer",
    "batch_generate",
    "describe_weights",
    "generate",
    "generate_step",
    "load",
    "make_cache",
    "make_sampler",
    "save",
    "stream_generate",
    "weight_bytes",
]
__version__ = "0.1.0"
