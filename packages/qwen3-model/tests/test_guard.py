"""The dispatch guard, both sides, through a real attention layer with a fresh cache."""

import mlx.core as mx
import pytest
import qwen3_model.model as model_module
from qwen3_model import CONFIGS, KVCache
from qwen3_model.model import MAX_CONTEXT, MAX_QUERY, Attention

L_MAX, S_MAX = MAX_QUERY["cpu"], MAX_CONTEXT["cpu"]


@pytest.fixture
def calls(monkeypatch):
    """Record which attention ran, and with what context S, without changing what it computes."""
    seen = []
    custom, readable = (
        model_module.decode_attention_custom,
        model_module.scaled_dot_product_attention,
    )

    def spy(name, fn):
        def wrapped(q, k, v, **kw):
            seen.append((name, k.shape[2]))
            return fn(q, k, v, **kw)

        return wrapped

    monkeypatch.setattr(model_module, "decode_attention_custom", spy("custom", custom))
    monkeypatch.setattr(model_module, "scaled_dot_product_attention", spy("readable", readable))
    step = model_module.attention_step

    def step_spy(q, k, v, q_w, k_w, keys, values, offset, **kw):
        seen.append(("step", offset + q.shape[1]))
        return step(q, k, v, q_w, k_w, keys, values, offset, **kw)

    monkeypatch.setattr(model_module, "attention_step", step_spy)
    return seen


def run_layer(prefix, length, mask=None, checkpoint="decode-attention"):
    """A fresh cache holding `prefix` positions (written directly: their values do not matter to
    the dispatch), then one step of `length` new tokens through a real attention layer."""
    args = CONFIGS["qwen3-tiny"]
    mx.random.seed(0)  # the same weights for every checkpoint
    layer = Attention(args, checkpoint)
    cache = KVCache()
    if prefix:
        shape = (1, args.num_key_value_heads, prefix, args.head_dim)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    x = mx.random.normal((1, length, args.hidden_size), key=mx.random.key(prefix))
    step_mask = mask if mask is not None else ("causal" if length > 1 else None)
    return layer(x, step_mask, cache)


# (prefix, L) -> (path, S): the cases, written against the named limits (chapter: 2, 256;
# here: 8, 16384). Inside the guard a layer with a cache runs the fused step (AttentionStep).
CASES = [
    ((0, 1), ("step", 1)),
    ((29, 2), ("step", 31)),
    ((126, 2), ("step", 128)),
    ((S_MAX - L_MAX, L_MAX), ("step", S_MAX)),
    ((S_MAX, 1), ("readable", S_MAX + 1)),
    ((S_MAX - L_MAX - 1, L_MAX + 1), ("readable", S_MAX)),
    ((0, 2 * L_MAX), ("readable", 2 * L_MAX)),  # a prompt longer than the limit: prefill
]


@pytest.mark.parametrize(("step", "expected"), CASES)
def test_guard(calls, step, expected):
    prefix, length = step
    mx.eval(run_layer(prefix, length))
    assert calls[-1] == expected


def test_without_a_cache_the_kernel_alone(calls):
    args = CONFIGS["qwen3-tiny"]
    layer = Attention(args, "decode-attention")
    mx.eval(layer(mx.random.normal((1, 3, args.hidden_size)), "causal", None))
    assert calls[-1] == ("custom", 3)


def test_explicit_mask_is_always_readable(calls):
    mask = mx.ones((1, 1, 1, 5), dtype=mx.bool_)
    mx.eval(run_layer(4, 1, mask=mask))
    assert calls[-1] == ("readable", 5)


def test_composition_never_dispatches(calls):
    mx.eval(run_layer(10, 1, checkpoint="composition"))
    assert calls[-1] == ("readable", 11)


def test_both_paths_agree_at_the_boundary():
    a = run_layer(S_MAX - 1, 1, checkpoint="decode-attention")
    b = run_layer(S_MAX - 1, 1, checkpoint="composition")
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
