"""Built-in Qwen3 configurations (the published config.json values) and a tiny one for tests."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    model_type: str = "qwen3"

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        """From a Hugging Face / MLX config.json (unknown keys ignored)."""
        config = dict(config)
        if "rope_theta" not in config and isinstance(config.get("rope_parameters"), dict):
            config["rope_theta"] = config["rope_parameters"].get("rope_theta", 1_000_000.0)
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in config]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        return cls(**{k: v for k, v in config.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, ModelArgs] = {
    "qwen3-0.6b": ModelArgs(1024, 28, 3072, 16, 8, 128, 151936),
    "qwen3-1.7b": ModelArgs(2048, 28, 6144, 16, 8, 128, 151936),
    "qwen3-4b": ModelArgs(2560, 36, 9728, 32, 8, 128, 151936),
    "qwen3-8b": ModelArgs(4096, 36, 12288, 32, 8, 128, 151936, tie_word_embeddings=False),
    # Tests: every dimension a multiple of 128 where 4-bit quantization (group 128) needs it.
    "qwen3-tiny": ModelArgs(128, 2, 256, 4, 2, 32, 1000),
}
