"""The quantized KV cache option: mlx-lm's layout, parity with mlx-lm's kv_bits decoding, and the
quantized guard (fused op where measured, else the dequantised cache through mx.fast; the
composition checkpoint's readable path)."""

import dataclasses

import mlx.core as mx
import pytest
import qwen3_model.model as model_module
from attn_kernels import guard
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from qwen3_model import CHECKPOINTS, CONFIGS, QuantizedKVCache, load, make_cache
from qwen3_model.model import Attention
from test_model import greedy, mlx_lm_twin

GROUP = 32  # qwen3-tiny's head_dim


@pytest.mark.parametrize("bits", [4, 8])
def test_state_is_mlx_lm_layout(bits):
    ours, theirs = QuantizedKVCache(GROUP, bits), MlxLmQuantizedKVCache(GROUP, bits)
    for length in (5, 300, 1):  # crosses a capacity step
        k, v = (mx.random.normal((1, 2, length, 64)).astype(mx.bfloat16) for _ in range(2))
        ours_kv, theirs_kv = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
    for a_triple, b_triple in zip(ours_kv, theirs_kv, strict=True):
        for a, b in zip(a_triple, b_triple, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert mx.array_equal(a, b).item()
    assert ours.offset == theirs.offset == 306
    assert ours.capacity == 512  # two steps of 256


@pytest.fixture(autouse=True)
def tiny_head_dim_in_the_guard(monkeypatch):
    """The guard's measured region (D=128 bf16) widened to the tiny config's head dim and every
    float dtype, so these tests reach the quantized op (the limits are test_guard's subject)."""
    wide = {
        where: dataclasses.replace(
            lim,
            head_dims=(*lim.head_dims, CONFIGS["qwen3-tiny"].head_dim),
            dtypes=(mx.float32, mx.float16, mx.bfloat16),
        )
        for where, lim in guard.LIMITS.items()
    }
    monkeypatch.setattr(guard, "LIMITS", wide)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_parity_with_mlx_lm_kv_bits(bits, checkpoint):
    """Greedy decoding with a quantized cache against mlx-lm's model with its QuantizedKVCache
    (same weights, same bits and group size): the same tokens, logits within the bf16 bound of
    test_model plus the two paths' different roundings of the quantized attention."""
    model = load("qwen3-tiny", dtype=mx.bfloat16, checkpoint=checkpoint, seed=3)
    ref = mlx_lm_twin(model)
    prompt = mx.random.randint(10, 990, (1, 32), key=mx.random.key(7))
    cache = make_cache(model, kv_bits=bits, kv_group_size=GROUP)
    ours, our_logits = greedy(model, prompt, 12, cache, lambda m, t, c: m(t, c))
    ref_cache = [MlxLmQuantizedKVCache(GROUP, bits) for _ in ref.layers]
    theirs, their_logits = greedy(ref, prompt, 12, ref_cache, lambda m, t, c: m(t, cache=c))
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= 0.15


def test_bad_settings():
    with pytest.raises(ValueError, match="kv_bits must be 4 or 8, got 3"):
        QuantizedKVCache(64, 3)
    with pytest.raises(ValueError, match="kv_group_size 64 does not divide head_dim 32"):
        QuantizedKVCache(64, 8).update_and_fetch(*(mx.zeros((1, 2, 1, 32)),) * 2)


@pytest.fixture
def calls(monkeypatch):
    seen = []
    fused, readable, fast = (
        model_module.decode_attention_quantized,
        model_module.scaled_dot_product_attention,
        mx.fast.scaled_dot_product_attention,
    )

    def spy(name, fn):
        def wrapped(q, k, v, **kw):
            seen.append((name, (k[0] if isinstance(k, tuple) else k).shape[2]))
            return fn(q, k, v, **kw)

        return wrapped

    monkeypatch.setattr(model_module, "decode_attention_quantized", spy("fused", fused))
    monkeypatch.setattr(model_module, "scaled_dot_product_attention", spy("readable", readable))
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy("mx.fast", fast))
    return seen


def step(prefix, length, checkpoint="decode-attention"):
    args = CONFIGS["qwen3-tiny"]
    layer = Attention(args, checkpoint)
    layer.fused_step = False  # the attention op's guard (the step's: test_quantized_step_*)
    cache = QuantizedKVCache(GROUP, 4)
    if prefix:
        shape = (1, args.num_key_value_heads, prefix, args.head_dim)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    x = mx.random.normal((1, length, args.hidden_size))
    mx.eval(layer(x, "causal" if length > 1 else None, cache))


def test_quantized_guard(calls):
    l_max, s_max = guard.QUANTIZED_LIMITS["cpu"]
    step(10, 1)
    step(s_max - 1, 1)
    step(s_max, 1)  # S = s_max + 1: past the measured contexts
    step(10, l_max + 1)  # several tokens: prefill
    step(10, 1, checkpoint="composition")
    assert calls == [
        ("fused", 11),
        ("fused", s_max),
        ("mx.fast", s_max + 1),
        ("mx.fast", 10 + l_max + 1),
        ("readable", 11),
    ]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_step_parity_with_mlx_lm(bits, monkeypatch):
    """Head dim 64 (a multiple of 64, as the GPUs' quantized step takes): decode steps go through
    attention_step_quantized (one per layer and step), greedy decoding gives mlx-lm's tokens with
    its QuantizedKVCache, and the logits stay within a few bf16 roundings of our unfused path
    (mx.quantize and decode_attention_quantized) on the same weights; against mlx-lm both paths
    differ alike (its bf16 roundings of the scores), up to ~0.23 here at 4 bits."""
    args = dataclasses.replace(CONFIGS["qwen3-tiny"], head_dim=64)
    monkeypatch.setitem(CONFIGS, "qwen3-tiny-d64", args)
    wide = {
        where: dataclasses.replace(lim, head_dims=(*lim.head_dims, 64))
        for where, lim in guard.LIMITS.items()
    }
    monkeypatch.setattr(guard, "LIMITS", wide)
    steps = []
    fused_step = model_module.attention_step_quantized

    def counted(*a, **kw):
        steps.append(a[7])  # the offset
        return fused_step(*a, **kw)

    monkeypatch.setattr(model_module, "attention_step_quantized", counted)
    model = load("qwen3-tiny-d64", dtype=mx.bfloat16, seed=5)
    ref = mlx_lm_twin(model)
    prompt = mx.random.randint(10, 990, (1, 32), key=mx.random.key(9))

    def decode(fused_step):
        for layer in model.layers:
            layer.self_attn.fused_step = fused_step
        cache = make_cache(model, kv_bits=bits, kv_group_size=64)
        return greedy(model, prompt, 12, cache, lambda m, t, c: m(t, c))

    ours, our_logits = decode(True)
    # every decode step after the 32-token prefill, each layer
    assert steps == [o for o in range(32, 44) for _ in range(args.num_hidden_layers)]
    unfused, unfused_logits = decode(False)
    assert len(steps) == 12 * args.num_hidden_layers  # the unfused run took no step
    ref_cache = [MlxLmQuantizedKVCache(64, bits) for _ in ref.layers]
    theirs, _ = greedy(ref, prompt, 12, ref_cache, lambda m, t, c: m(t, cache=c))
    assert ours == unfused == theirs
    for a, b in zip(our_logits, unfused_logits, strict=True):
        assert mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= 0.08
