"""Parity with mlx-lm's Qwen3, checkpoint round trips, the KV cache, loading errors."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
import qwen3_model
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3 as mlx_lm_qwen3
from mlx_lm.models.cache import make_prompt_cache
from qwen3_model import CHECKPOINTS, CONFIGS, KVCache, load, make_cache, save

# Logits are O(4) here. float32 agrees to rounding; in bf16 the two attention paths round scores
# and probabilities at different points (ours: bf16 matmul outputs; mlx-lm: mx.fast in float32),
# which moves logits by a few bf16 ulps after two layers (seen: 0.04); the 4-bit model's larger
# activations carry that further (seen: 0.19). Greedy tokens must agree exactly.
LOGIT_ATOL = {"float32": 1e-4, "bfloat16": 0.1, "4bit": 0.25}


def mlx_lm_twin(model):
    """mlx-lm's Qwen3 with exactly our weights (names are the same)."""
    ref = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs(**model.args.to_dict()))
    if getattr(model, "quantization", None):
        nn.quantize(ref, **model.quantization)
    ref.load_weights(list(tree_flatten(model.parameters())), strict=True)
    mx.eval(ref.parameters())
    return ref


def greedy(model, prompt, steps, cache, call):
    logits = [call(model, prompt, cache)[:, -1]]
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        tokens.append(token.item())
        logits.append(call(model, token[None], cache)[:, -1])
    return tokens, logits


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "4bit"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_parity_with_mlx_lm(variant, checkpoint):
    dtype = mx.float32 if variant == "float32" else mx.bfloat16
    quantize = "4bit" if variant == "4bit" else None
    model = load("qwen3-tiny", dtype=dtype, quantize=quantize, checkpoint=checkpoint, seed=3)
    ref = mlx_lm_twin(model)
    prompt = mx.random.randint(10, 990, (1, 32), key=mx.random.key(7))
    ours, our_logits = greedy(model, prompt, 16, make_cache(model), lambda m, t, c: m(t, c))
    theirs, their_logits = greedy(
        ref, prompt, 16, make_prompt_cache(ref), lambda m, t, c: m(t, cache=c)
    )
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert (
            mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= LOGIT_ATOL[variant]
        )


@pytest.mark.parametrize("quantize", [None, "4bit"])
def test_checkpoint_round_trip(tmp_path, quantize):
    model = load("qwen3-tiny", quantize=quantize, seed=5)
    folder = save(model, tmp_path / "ckpt")
    again = load(folder)
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7]])
    assert mx.array_equal(model(tokens), again(tokens)).item()


def test_hf_layout_with_untied_head(tmp_path):
    """An untied checkpoint keeps lm_head; a tied one may carry a stray lm_head.weight."""
    args = CONFIGS["qwen3-tiny"]
    untied = qwen3_model.Model(
        qwen3_model.ModelArgs(**{**args.to_dict(), "tie_word_embeddings": False})
    )
    folder = save(untied, tmp_path / "untied")
    assert "lm_head.weight" in mx.load(str(folder / "model.safetensors"))
    assert "lm_head" in load(folder)
    tokens = mx.array([[5, 17, 99, 3]])
    reloaded = load(folder)
    assert mx.array_equal(reloaded.lm_head.weight, untied.lm_head.weight).item()
    assert mx.array_equal(reloaded(tokens), untied(tokens)).item()
    tied = load("qwen3-tiny")
    folder = save(tied, tmp_path / "tied")
    weights = mx.load(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    stray = load(folder)
    assert "lm_head" not in stray  # the stray copy is dropped: the head stays tied
    assert mx.array_equal(stray(tokens), tied(tokens)).item()


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in model"):
        load("qwen3-99b")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3-tiny"].to_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(tmp_path)
    weights = dict(tree_flatten(load("qwen3-tiny").parameters()))
    weights["model.norm.weight"] = mx.zeros((7,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"do not match its config\.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match="unknown quantize"):
        load("qwen3-tiny", quantize="3bit")
    with pytest.raises(ValueError, match="unknown checkpoint"):
        load("qwen3-tiny", checkpoint="swiglu")


def test_cache_grows_in_steps_and_returns_views():
    cache = KVCache()
    k = mx.zeros((1, 2, 200, 32))
    keys, values = cache.update_and_fetch(k, k)
    assert cache.capacity == 256 and keys.shape[2] == 200 and values.shape[2] == 200
    for s in range(201, 258):
        keys, _ = cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
        assert keys.shape[2] == s
    assert cache.capacity == 512


def test_cache_memory_and_no_per_token_copy():
    model = load("qwen3-tiny", dtype=mx.float32)
    args = model.args
    cache = make_cache(model)
    mx.eval(model(mx.array([list(range(10, 40))]), cache))
    expected = 2 * args.num_hidden_layers * args.num_key_value_heads * 256 * args.head_dim * 4
    assert sum(c.nbytes for c in cache) == expected
    token = mx.array([[5]])
    mx.eval(model(token, cache))
    # A decode step allocates activations, never a copy of the cache (all layers: `expected`).
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for _ in range(8):
        mx.eval(model(token, cache))
    assert mx.get_peak_memory() - before < expected // 4
    assert sum(c.nbytes for c in cache) == expected


def test_batch_with_per_request_padding_mask():
    """Right-padded batch: the explicit mask hides pads; the short request's logits equal a solo run."""
    model = load("qwen3-tiny", dtype=mx.float32, seed=2)
    long = list(range(100, 120))
    short = list(range(300, 314))
    batch = mx.array([long, short + [0] * 6])
    valid = mx.array([[True] * 20, [True] * 14 + [False] * 6])
    causal = mx.tril(mx.ones((20, 20), dtype=mx.bool_))
    mask = causal[None, None] & valid[:, None, None, :]
    logits = model(batch, make_cache(model), mask=mask)
    solo = model(mx.array([short]), make_cache(model))
    assert mx.allclose(logits[1, :14], solo[0], atol=1e-4).item()
    assert mx.allclose(logits[0], model(mx.array([long]), make_cache(model))[0], atol=1e-4).item()
