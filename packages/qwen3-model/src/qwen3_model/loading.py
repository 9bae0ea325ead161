"""load(): built-in configs with seeded random weights, or a local checkpoint folder, offline."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from qwen3_model.configs import CONFIGS, ModelArgs
from qwen3_model.model import Model

QUANTIZATIONS = {"4bit": {"group_size": 128, "bits": 4}}


def _quantize(model: Model, quantize: str | None) -> None:
    if quantize in (None, "none"):
        return
    if quantize not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantize {quantize!r}: use None, 'none' or one of {list(QUANTIZATIONS)}"
        )
    nn.quantize(model, **QUANTIZATIONS[quantize])
    model.quantization = QUANTIZATIONS[quantize]


def load(
    name_or_path: str | Path,
    *,
    quantize: str | None = None,
    seed: int = 0,
    checkpoint: str = "decode-attention",
    dtype: mx.Dtype = mx.bfloat16,
) -> Model:
    """A built-in name (see CONFIGS) gives seeded random weights in `dtype`; a folder with
    config.json and *.safetensors (bf16 Hugging Face layout, or MLX's quantized layout) loads
    from disk. quantize="4bit" quantizes like the published MLX 4-bit checkpoints (group 128)."""
    name = str(name_or_path)
    if name in CONFIGS:
        mx.random.seed(seed)
        model = Model(CONFIGS[name], checkpoint)
        model.set_dtype(dtype)
        _quantize(model, quantize)
        model.fuse_projections()
        mx.eval(model.parameters())
        return model
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(
            f"{name!r} is neither a built-in model ({', '.join(CONFIGS)}) nor a folder"
        )
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    config = json.loads(config_file.read_text())
    model = Model(ModelArgs.from_dict(config), checkpoint)
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    stored = config.get("quantization") or config.get("quantization_config")
    if stored:
        nn.quantize(
            model,
            group_size=stored["group_size"],
            bits=stored["bits"],
            class_predicate=lambda p, _m: f"{p}.scales" in weights,
        )
        model.quantization = {"group_size": stored["group_size"], "bits": stored["bits"]}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match its config.json: {e}") from e
    if not stored:
        _quantize(model, quantize)
    elif quantize not in (None, "none"):
        raise ValueError(f"{path} is already quantized ({stored}); leave quantize unset")
    model.fuse_projections()
    mx.eval(model.parameters())
    return model


def save(model: Model, path: str | Path) -> Path:
    """config.json + model.safetensors in the layout load() (and mlx-lm) read back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.args.to_dict()
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def weight_bytes(model: Model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
