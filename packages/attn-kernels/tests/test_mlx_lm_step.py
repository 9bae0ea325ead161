"""attn_kernels.mlx_lm.enable(fused_step=True): mlx-lm's own Qwen3 decode steps run as one
attention_step on the KVCache's buffers, with mlx-lm's greedy tokens and cache growth; every
other call runs mlx-lm's Attention.__call__, and disable() puts it back."""

import dataclasses

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import attn_kernels.mlx_lm as kernel
from attn_kernels import attention_step_cache_copies, guard
from attn_kernels.mlx_lm import step
from mlx_lm.models import base, qwen3
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from test_mlx_lm import (  # noqa: F401  (any_head_dim_and_dtype: a fixture)
    ARCHS,
    LAYERS,
    MLX_LM_SDPA,
    any_head_dim_and_dtype,
    greedy,
    max_difference,
    prompt_ids,
    teacher_forced,
    tiny_model,
)

MLX_LM_CALL = qwen3.Attention.__dict__["__call__"]
QWEN3 = ARCHS["qwen3"]


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    kernel.disable()


@pytest.fixture
def steps(monkeypatch):
    """(L, offset, capacity) of every attention_step the fused Qwen3 attention computed;
    ("refused", offset) where the op raised ValueError."""
    seen = []
    op = step.attention_step

    def spy(q, k, v, qw, kw, k_cache, v_cache, offset, **options):
        try:
            out = op(q, k, v, qw, kw, k_cache, v_cache, offset, **options)
        except ValueError:
            seen.append(("refused", offset))
            raise
        seen.append((q.shape[1], offset, k_cache.shape[2]))
        return out

    monkeypatch.setattr(step, "attention_step", spy)
    return seen


def qwen3_model(dtype=mx.float32, **changes):
    """test_mlx_lm's tiny qwen3 with `changes` to its config (head_dim, rope_scaling, ...)."""
    saved = dict(QWEN3)
    QWEN3.update(changes)
    try:
        return tiny_model("qwen3", dtype)
    finally:
        QWEN3.clear()
        QWEN3.update(saved)


def run_both(model, prompt, count):
    """Greedy tokens, logits and caches without the kernel, then with enable(fused_step=True)."""
    theirs = greedy(model, prompt, count)
    with kernel.enabled(fused_step=True):
        ours = greedy(model, prompt, count)
        calls = kernel.calls()
    return theirs, ours, calls


def same_caches(ours, theirs, tol, layers=LAYERS):
    """Same capacity (growth as mlx-lm's) and offset in every layer; the written positions of the
    first `layers` layers agree within tol (absolute and relative)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.keys.shape == b.keys.shape and a.offset == b.offset
        for x, y in ((a.keys, b.keys), (a.values, b.values)) if i < layers else ():
            x, y = (t[..., : a.offset, :].astype(mx.float32) for t in (x, y))
            assert mx.allclose(x, y, atol=tol, rtol=tol).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_greedy_tokens_match_mlx_lm(head_dim, dtype, steps):
    """A 12-token prompt (mlx-lm's path: past the query limit), then 10 fused steps."""
    model = qwen3_model(dtype, head_dim=head_dim)
    prompt, count = prompt_ids(12), 10
    (theirs, their_logits, their_cache), (ours, our_logits, our_cache), calls = run_both(
        model, prompt, count
    )
    assert ours == theirs
    assert len(set(ours)) > count // 2  # attention matters: the tokens are not one repeated id
    if dtype == mx.float32:
        assert max_difference(our_logits, their_logits) <= 1e-4
        same_caches(our_cache, their_cache, 1e-4)
    else:
        # Both round in bf16, differently; the fused step must be no farther from float32
        # arithmetic on the same weights than mlx-lm's own chain.
        reference = qwen3_model(dtype, head_dim=head_dim)
        reference.set_dtype(mx.float32)
        exact = teacher_forced(reference, prompt, theirs)
        assert max_difference(our_logits, exact) <= 1.1 * max_difference(their_logits, exact)
        # Layer 0 sees the same inputs (bf16 roundings of norm and RoPE apart); later layers'
        # inputs carry the attention's rounding, so only their shapes are compared.
        same_caches(our_cache, their_cache, 2**-6, layers=1)
    assert steps == [(1, 12 + i, 256) for i in range(count) for _ in range(LAYERS)]
    # The attention function is not reached by fused steps: only the prefill's calls.
    assert calls == {"fused": 0, "fused_quantized": 0, "fused_step": LAYERS * count, "mlx_lm": 2}


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_growth_across_256_from_a_short_prompt(steps):
    """An 8-token prompt (a fused causal step into an empty cache: the first 256 positions),
    then 252 steps: the step at offset 256 grows the cache to 512 by concatenation, as mlx-lm's
    KVCache does. Tokens, logits and caches as mlx-lm's, every call fused."""
    model = qwen3_model()
    count = 252
    (theirs, their_logits, their_cache), (ours, our_logits, our_cache), calls = run_both(
        model, prompt_ids(8), count
    )
    assert ours == theirs
    assert max_difference(our_logits, their_logits) <= 1e-4
    same_caches(our_cache, their_cache, 1e-4)
    assert our_cache[0].keys.shape[2] == 512
    expected = [(8, 0, 256)] * LAYERS
    expected += [
        (1, s, 256 if s < 256 else 512) for s in range(8, 8 + count) for _ in range(LAYERS)
    ]
    assert steps == expected
    assert calls["fused_step"] == len(expected) and calls["mlx_lm"] == 0


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_multi_token_steps_cross_a_boundary_off_the_step(steps):
    """3-token causal steps from offset 251: the one at 254 needs 257 positions, so the cache
    (256, 254 written) is cut to 254 and extended by 256, mlx-lm's branch for an offset that is
    not a multiple of the step. Logits and caches as mlx-lm's."""
    model = qwen3_model()
    prompt = prompt_ids(251)
    chunks = [prompt_ids(3, seed=s) for s in range(3)]

    def run():
        cache = make_prompt_cache(model)
        logits = [model(prompt, cache=cache)]
        logits += [model(c, cache=cache) for c in chunks]
        return logits, cache

    their_logits, their_cache = run()
    with kernel.enabled(fused_step=True):
        our_logits, our_cache = run()
    assert max_difference(our_logits, their_logits) <= 1e-4
    same_caches(our_cache, their_cache, 1e-4)
    assert our_cache[0].keys.shape[2] == 254 + 256
    assert steps == [
        (3, s, c) for s, c in ((251, 256), (254, 510), (257, 510)) for _ in range(LAYERS)
    ]


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_generate_step_fused_every_step_without_cache_copies(steps):
    """mlx-lm's own loop (generate_step: its stream, async evaluation): the same tokens, every
    decode step fused, and no cache copied (owned caches: the KVCache holds only the buffers the
    op returned). float32: in bf16 this prompt meets a near-tie at token 5 (margin 0.03, one bf16
    step), which mlx-lm's chain and the fused step round to different sides; float32 arithmetic
    picks the fused step's token there."""
    from mlx_lm.generate import generate_step

    model = qwen3_model()
    prompt = prompt_ids(20)[0]
    theirs = [t for t, _ in generate_step(prompt, model, max_tokens=8)]
    copies = attention_step_cache_copies()
    with kernel.enabled(fused_step=True):
        ours = [t for t, _ in generate_step(prompt, model, max_tokens=8)]
        calls = kernel.calls()
    assert ours == theirs
    assert attention_step_cache_copies() == copies
    assert len(steps) == calls["fused_step"] >= LAYERS * 8
    assert all(length == 1 for length, _, _ in steps)


def with_norms(model, dtype=None, eps=None):
    """The q/k norms' weights in `dtype`, or their eps set to `eps`."""
    for layer in model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if dtype is not None:
                norm.weight = norm.weight.astype(dtype)
            if eps is not None:
                norm.eps = eps
    return model


# (model, fresh caches for it) where every call must run mlx-lm's method.
FALLBACKS = {
    "rope scaling (linear)": lambda: (
        qwen3_model(rope_scaling={"type": "linear", "factor": 2.0}),
        make_prompt_cache,
    ),
    "quantized cache": lambda: (
        qwen3_model(),
        lambda _: [QuantizedKVCache(group_size=32, bits=8) for _ in range(LAYERS)],
    ),
    "rotating cache": lambda: (
        qwen3_model(),
        lambda _: [RotatingKVCache(max_size=64) for _ in range(LAYERS)],
    ),
    "norm weights in bf16, projections in float32": lambda: (
        with_norms(qwen3_model(), dtype=mx.bfloat16),
        make_prompt_cache,
    ),
    "eps 0 (the op refuses it)": lambda: (with_norms(qwen3_model(), eps=0.0), make_prompt_cache),
}


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("case", FALLBACKS)
def test_unsupported_steps_run_mlx_lm_unchanged(case, steps):
    """Tokens, logits and attention calls as with enable() alone (the attention function's own
    routing still applies), and no fused step."""
    model, caches = FALLBACKS[case]()

    def run(fused_step):
        cache = caches(model)
        with kernel.enabled(fused_step=fused_step):
            logits = [model(prompt_ids(12), cache=cache)[:, -1]]
            tokens = []
            for _ in range(6):
                tokens.append(mx.argmax(logits[-1], axis=-1).item())
                logits.append(model(mx.array([[tokens[-1]]]), cache=cache)[:, -1])
            return tokens, logits, kernel.calls()

    plain_tokens, plain_logits, plain_calls = run(False)
    tokens, logits, calls = run(True)
    refused = [("refused", s) for s in range(12, 18) for _ in range(LAYERS)]
    assert steps == (refused if "refuses" in case else []) and calls["fused_step"] == 0
    assert tokens == plain_tokens and calls == plain_calls
    assert max_difference(logits, plain_logits) == 0


def test_outside_the_guard_no_fused_step(steps):
    """The guard's own table: float32 (records: bf16) and D=64 run mlx-lm's method, bit-equal."""
    for model in (qwen3_model(), qwen3_model(mx.bfloat16, head_dim=64)):
        (theirs, their_logits, _), (ours, our_logits, _), calls = run_both(model, prompt_ids(12), 4)
        assert ours == theirs and max_difference(our_logits, their_logits) == 0
        assert calls["fused_step"] == 0
    assert steps == []


def test_off_a_step_backend(steps, monkeypatch):
    """A backend without a step kernel (Metal's table): no fused step even inside use_fused."""
    monkeypatch.setattr(guard, "_default_backend", lambda: "metal")
    wide = dataclasses.replace(guard.LIMITS["metal"], max_query=8, max_context=1 << 20)
    monkeypatch.setitem(guard.LIMITS, "metal", wide)
    model = qwen3_model(mx.bfloat16)
    assert guard.use_fused(1, 20, 128, None, dtype=mx.bfloat16)
    with kernel.enabled(fused_step=True):
        greedy(model, prompt_ids(12), 3)
    assert steps == []


def test_enable_disable_restore_the_method():
    assert not kernel.fused_step_enabled()
    kernel.enable()
    assert qwen3.Attention.__dict__["__call__"] is MLX_LM_CALL  # the default leaves it alone
    kernel.enable(fused_step=True)
    kernel.enable(fused_step=True)  # idempotent
    assert kernel.fused_step_enabled()
    assert qwen3.Attention.__dict__["__call__"] is not MLX_LM_CALL
    kernel.enable()  # enabled without the step: mlx-lm's method again, the function still ours
    assert qwen3.Attention.__dict__["__call__"] is MLX_LM_CALL
    assert base.scaled_dot_product_attention is kernel.scaled_dot_product_attention
    kernel.enable(fused_step=True)
    kernel.disable()
    assert qwen3.Attention.__dict__["__call__"] is MLX_LM_CALL
    assert base.scaled_dot_product_attention is MLX_LM_SDPA
    assert not kernel.fused_step_enabled()


def test_context_manager_restores_the_state_before():
    with kernel.enabled(fused_step=True):
        assert kernel.fused_step_enabled()
        with kernel.enabled():
            assert not kernel.fused_step_enabled()
        assert kernel.fused_step_enabled()
    assert not kernel.is_enabled() and not kernel.fused_step_enabled()
    assert qwen3.Attention.__dict__["__call__"] is MLX_LM_CALL
    kernel.enable()
    with kernel.enabled(fused_step=True):
        pass
    assert kernel.is_enabled() and not kernel.fused_step_enabled()


def test_plain_kv_cache_only():
    """A KVCache subclass (its update may differ) is not the plain cache the step grows."""

    class Subclass(KVCache):
        pass

    model = qwen3_model(mx.bfloat16)
    with kernel.enabled(fused_step=True):
        cache = [Subclass() for _ in range(LAYERS)]
        model(prompt_ids(12), cache=cache)
        model(mx.array([[3]]), cache=cache)
        assert kernel.calls()["fused_step"] == 0


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_mask_none_with_several_queries_is_not_causal(steps):
    """mlx-lm's method with mask=None and L > 1 lets every query see every key; the fused step is
    causal, so such a call must run mlx-lm's method (bit-equal), while L = 1 with None is fused."""
    model = qwen3_model()
    attention = model.model.layers[0].self_attn
    prefill = mx.random.normal((1, 10, model.args.hidden_size), key=mx.random.key(2))
    x = mx.random.normal((1, 4, model.args.hidden_size), key=mx.random.key(3))
    outputs = []
    for fused_step in (False, True):
        cache = KVCache()
        with kernel.enabled(fused_step=fused_step):
            attention(prefill, "causal", cache)
            outputs.append(attention(x, None, cache))
            outputs.append(attention(x[:, :1], None, cache))
    assert mx.array_equal(outputs[0], outputs[2]).item()
    assert [s[:2] for s in steps] == [(1, 14)]
    assert mx.allclose(outputs[1], outputs[3], atol=1e-4, rtol=1e-4).item()


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_fused_step_on_cuda(steps):
    """On CUDA, inside the guard's own region (bf16, D=128): every decode step through the step
    op's CUDA kernels, and its logits no farther from float32 arithmetic than mlx-lm's chain."""
    mx.set_default_device(mx.gpu)
    model = qwen3_model(mx.bfloat16, head_dim=128)
    prompt, count = prompt_ids(12), 10
    (theirs, their_logits, _), (ours, our_logits, _), calls = run_both(model, prompt, count)
    reference = qwen3_model(mx.bfloat16, head_dim=128)
    reference.set_dtype(mx.float32)
    # Each run against float32 arithmetic on its own tokens (a bf16 near-tie may part them).
    our_error = max_difference(our_logits, teacher_forced(reference, prompt, ours))
    their_error = max_difference(their_logits, teacher_forced(reference, prompt, theirs))
    assert our_error <= 1.1 * their_error
    assert calls["fused_step"] == LAYERS * count
    assert steps == [(1, 12 + i, 256) for i in range(count) for _ in range(LAYERS)]
