"""The dispatch guard through a real attention layer with a fresh cache, for every backend's
table (attn_kernels.guard.LIMITS; the kernels themselves run on this machine's CPU)."""

import mlx.core as mx
import pytest
import qwen3_model.model as model_module
from attn_kernels import guard
from attn_kernels.guard import LIMITS, STEP_BACKENDS
from qwen3_model import KVCache, ModelArgs
from qwen3_model.model import Attention

# Qwen3's head dim and dtype (the measured ones), few heads: the guard sees L, S, D, dtype, mask.
ARGS = ModelArgs(256, 1, 512, 4, 2, 128, 1000)
BACKENDS = sorted(LIMITS)


@pytest.fixture
def calls(monkeypatch):
    """Record which attention ran, and with what context S, without changing what it computes."""
    seen = []

    def spy(name, fn):
        def wrapped(q, k, v, **kw):
            seen.append((name, k.shape[2]))
            return fn(q, k, v, **kw)

        return wrapped

    for name, owner, attr in [
        ("custom", model_module, "decode_attention_custom"),
        ("readable", model_module, "scaled_dot_product_attention"),
        ("mx.fast", mx.fast, "scaled_dot_product_attention"),
    ]:
        monkeypatch.setattr(owner, attr, spy(name, getattr(owner, attr)))
    step = model_module.attention_step

    def step_spy(q, k, v, q_w, k_w, keys, values, offset, **kw):
        seen.append(("step", offset + q.shape[1]))
        return step(q, k, v, q_w, k_w, keys, values, offset, **kw)

    monkeypatch.setattr(model_module, "attention_step", step_spy)
    return seen


def run_layer(prefix, length, mask=None, checkpoint="decode-attention", dtype=mx.bfloat16):
    """A fresh cache holding `prefix` positions (written directly: their values do not matter to
    the dispatch), then one step of `length` new tokens through a real attention layer."""
    mx.random.seed(0)  # the same weights for every checkpoint
    layer = Attention(ARGS, checkpoint)
    layer.set_dtype(dtype)
    cache = KVCache()
    if prefix:
        shape = (1, ARGS.num_key_value_heads, prefix, ARGS.head_dim)
        cache.update_and_fetch(
            mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
        )
    x = mx.random.normal((1, length, ARGS.hidden_size), key=mx.random.key(prefix)).astype(dtype)
    step_mask = mask if mask is not None else ("causal" if length > 1 else None)
    return layer(x, step_mask, cache)


def cases(where):
    """(prefix, L) -> (path, S) on both sides of the backend's limits. Inside the guard a layer
    with a cache runs the fused step (AttentionStep) where the backend has one."""
    lim = LIMITS[where]
    lq, ls = lim.max_query, lim.max_context
    inside = "step" if where in STEP_BACKENDS else "custom"
    return [
        ((0, 1), (inside, 1)),
        ((29, 2), (inside, 31)),
        ((ls - lq, lq), (inside, ls)),
        ((ls, 1), ("mx.fast", ls + 1)),
        ((ls - lq - 1, lq + 1), ("mx.fast", ls)),
        ((0, 2 * lq), ("mx.fast", 2 * lq)),  # a prompt longer than the limit: prefill
    ]


def on_backend(monkeypatch, where):
    """The guard's limits and the model's step switch both see `where`."""
    monkeypatch.setattr(guard, "_default_backend", lambda: where)
    monkeypatch.setattr(guard, "backend", lambda: where)


@pytest.mark.parametrize("where", BACKENDS)
def test_guard(calls, monkeypatch, where):
    on_backend(monkeypatch, where)
    for (prefix, length), expected in cases(where):
        mx.eval(run_layer(prefix, length))
        assert calls[-1] == expected, (where, prefix, length)


def test_without_a_cache_the_kernel_alone(calls):
    layer = Attention(ARGS, "decode-attention")
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 3, ARGS.hidden_size)).astype(mx.bfloat16)
    mx.eval(layer(x, "causal", None))
    assert calls[-1] == ("custom", 3)


@pytest.mark.parametrize("where", BACKENDS)
def test_explicit_mask(calls, monkeypatch, where):
    on_backend(monkeypatch, where)
    lim = LIMITS[where]
    mask = mx.ones((1, 1, 1, 5), dtype=mx.bool_)
    mx.eval(run_layer(4, 1, mask=mask))
    assert calls[-1] == ("custom" if lim.max_masked_query >= 1 else "mx.fast", 5)
    if lim.max_masked_context:
        s = lim.max_masked_context + 1
        mx.eval(run_layer(s - 1, 1, mask=mx.ones((1, 1, 1, s), dtype=mx.bool_)))
        assert calls[-1] == ("mx.fast", s)


def test_unmeasured_dtype_falls_back(calls, monkeypatch):
    """float32 on CUDA has no record (the CPU's coverage record admits it)."""
    on_backend(monkeypatch, "cuda")
    mx.eval(run_layer(10, 1, dtype=mx.float32))
    assert calls[-1] == ("mx.fast", 11)
    on_backend(monkeypatch, "cpu")
    mx.eval(run_layer(10, 1, dtype=mx.float32))
    assert calls[-1] == ("step", 11)


def test_composition_never_dispatches(calls):
    mx.eval(run_layer(10, 1, checkpoint="composition"))
    assert calls[-1] == ("readable", 11)


@pytest.mark.parametrize("prefix, length", [(LIMITS["cpu"].max_context - 1, 1), (0, 20)])
def test_every_path_agrees(prefix, length):
    """Inside the guard (fused), outside it (mx.fast) and the composition (readable)."""
    a = run_layer(prefix, length, checkpoint="decode-attention").astype(mx.float32)
    b = run_layer(prefix, length, checkpoint="composition").astype(mx.float32)
    assert mx.allclose(a, b, atol=3e-2, rtol=3e-2).item()
