"""load(): built-in configs with seeded random weights, or a local checkpoint folder, offline."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from qwen3_model.configs import CONFIGS, ModelArgs
from qwen3_model.model import Model

QUANTIZATIONS = {"4bit": {"group_size": 128, "bits": 4}, "8bit": {"group_size": 64, "bits": 8}}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read or does not fit its config; the message names it."""


def _quantize(model: Model, quantize: str | None) -> None:
    if quantize in (None, "none"):
        return
    if quantize not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantize {quantize!r}: use None, 'none' or one of {list(QUANTIZATIONS)}"
        )
    nn.quantize(model, **QUANTIZATIONS[quantize])
    model.quantization = QUANTIZATIONS[quantize]


def _materialise(model: Model, progress: Callable[[int, int], None] | None) -> None:
    """Evaluate the parameters layer by layer, so a caller can show progress while a large model
    is generated or read."""
    layers = model.layers
    total = len(layers) + 1
    for i, layer in enumerate(layers):
        mx.eval(layer.parameters())
        if progress:
            progress(i + 1, total)
    mx.eval(model.parameters())
    if progress:
        progress(total, total)


def _random_model(args: ModelArgs, checkpoint: str, dtype: mx.Dtype) -> Model:
    model = Model(args, checkpoint)
    # MLX draws the embedding from a normal distribution, which costs about four times a uniform
    # draw on the CPU (a third of qwen3-0.6b's load time). A uniform draw of the same standard
    # deviation gives the same scale of activations and logits.
    embed = model.model.embed_tokens
    bound = math.sqrt(3.0 / args.hidden_size)  # nn.Embedding's std is 1/sqrt(hidden_size)
    embed.weight = mx.random.uniform(-bound, bound, embed.weight.shape)
    model.set_dtype(dtype)
    return model


def _read_config(config_file: Path) -> tuple[dict, ModelArgs]:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_file}: expected a JSON object, found {type(config).__name__}"
        )
    try:
        args = ModelArgs.from_dict(config)
        for f in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(args, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f} must be a positive integer, found {value!r}")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_file}: {e}") from e
    return config, args


def _read_weights(files: list[Path]) -> dict:
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return weights


def load(
    name_or_path: str | Path,
    *,
    quantize: str | None = None,
    seed: int = 0,
    checkpoint: str = "decode-attention",
    dtype: mx.Dtype = mx.bfloat16,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """A built-in name (see CONFIGS) gives seeded random weights in `dtype`; a folder with
    config.json and *.safetensors (bf16 Hugging Face layout, or MLX's quantized layout) loads
    from disk. quantize="4bit" quantizes like the published MLX 4-bit checkpoints (group 128), "8bit" as
    mlx_lm.convert's 8 bits (group 64).
    progress(done, total) is called as the layers are materialised.

    Raises FileNotFoundError for a missing folder or file and CheckpointError (a ValueError
    naming the file) for a config.json or safetensors file that cannot be read or used."""
    name = str(name_or_path)
    if name in CONFIGS:
        mx.random.seed(seed)
        model = _random_model(CONFIGS[name], checkpoint, dtype)
        _quantize(model, quantize)
        _materialise(model, progress)
        model.fuse_projections()  # decode-attention's fused q/k/v and gate/up (views: no copy kept)
        return model
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if isinstance(name_or_path, str) and "/" not in name and "\\" not in name:
            raise ValueError(
                f"{name!r} is neither a built-in model ({', '.join(CONFIGS)}) nor a folder"
            )
        raise FileNotFoundError(f"{path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (pass the checkpoint's folder)")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    config, args = _read_config(config_file)
    model = Model(args, checkpoint)
    weights = _read_weights(files)
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    stored = config.get("quantization") or config.get("quantization_config")
    if stored:
        try:
            group_size, bits = stored["group_size"], stored["bits"]
        except (TypeError, KeyError) as e:
            raise CheckpointError(f"{config_file}: quantization needs group_size and bits") from e
        nn.quantize(
            model,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda p, _m: f"{p}.scales" in weights,
        )
        model.quantization = {"group_size": group_size, "bits": bits}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"weights in {path} do not match its config.json: {e}") from e
    if not stored:
        _quantize(model, quantize)
    elif quantize not in (None, "none"):
        raise ValueError(f"{path} is already quantized ({stored}); leave quantize unset")
    _materialise(model, progress)
    model.fuse_projections()  # decode-attention's fused q/k/v and gate/up (views: no copy kept)
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


def describe_weights(model: Model) -> str:
    """ "bf16 (no quantisation)" or "4-bit, group 128": what the weights are stored as."""
    q = getattr(model, "quantization", None)
    if q:
        return f"{q['bits']}-bit, group {q['group_size']}"
    dtype = model.model.norm.weight.dtype
    names = {mx.bfloat16: "bf16", mx.float16: "fp16", mx.float32: "fp32"}
    return f"{names.get(dtype, str(dtype))} (no quantisation)"
