"""attn_kernels.mlx_lm.enable() (fused_step=True, its default): the decode steps of mlx-lm's own
Llama, Mistral (llama.py), Qwen2 and Qwen3 attention run as one attention_step on the KVCache's
buffers, with mlx-lm's greedy tokens and cache growth; every other call runs mlx-lm's
Attention.__call__, and disable() or enable(fused_step=False) puts it back."""

import dataclasses

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import attn_kernels.mlx_lm as kernel
from attn_kernels import attention_step_cache_copies, guard
from attn_kernels.mlx_lm import step
from mlx_lm.models import base, gemma3_text, llama, phi3, qwen2, qwen3, qwen3_moe
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from test_mlx_lm import (  # noqa: F401  (any_head_dim_and_dtype, mlx_matmuls: fixtures)
    ARCHS,
    LAYERS,
    MLX_LM_SDPA,
    any_head_dim_and_dtype,
    greedy,
    max_difference,
    mlx_matmuls,
    prompt_ids,
    teacher_forced,
    tiny_model,
)

MLX_LM_CALLS = {
    a: a.__dict__["__call__"]
    for a in (
        llama.Attention,
        qwen2.Attention,
        qwen3.Attention,
        qwen3_moe.Attention,
        gemma3_text.Attention,
        phi3.Attention,
    )
}
# mistral: mlx-lm loads it through llama.py; qwen3_moe has Qwen3's attention
STEP_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


pytestmark = pytest.mark.usefixtures("mlx_matmuls")


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


def arch_model(arch, dtype=mx.float32, **changes):
    """test_mlx_lm's tiny `arch` with `changes` to its config (head_dim, rope_scaling, ...)."""
    config = ARCHS[arch]
    saved = dict(config)
    config.update(changes)
    try:
        return tiny_model(arch, dtype)
    finally:
        config.clear()
        config.update(saved)


def qwen3_model(dtype=mx.float32, **changes):
    return arch_model("qwen3", dtype, **changes)


def methods_are_mlx_lms() -> bool:
    return all(a.__dict__["__call__"] is call for a, call in MLX_LM_CALLS.items())


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


# (arch, config changes): head dims 64 to 128 (80 and 96 not multiples of 32); Qwen2's q/k/v
# projections carry biases, Llama and Qwen2 have no q/k norm.
GREEDY_CASES = {
    "qwen3-D128": ("qwen3", {}),
    "qwen3-D80": ("qwen3", dict(head_dim=80)),
    "llama-D64": ("llama", {}),
    "llama-D128-theta500000": ("llama", dict(head_dim=128, rope_theta=500000.0)),
    "mistral-D96": ("mistral", {}),
    "qwen2-D80": ("qwen2", {}),
    "qwen3_moe-D128": ("qwen3_moe", {}),
    "phi3-D96": ("phi3", {}),  # one qkv_proj, no GQA
    # rotations given as periods (rope_freqs): Llama 3's scaled frequencies, linear scaling
    "llama-D64-llama3-rope": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,  # every kind of pair at this size
            }
        ),
    ),
    "qwen3-D128-linear-rope": ("qwen3", dict(rope_scaling={"type": "linear", "factor": 2.0})),
    "qwen2-D80-linear-rope": ("qwen2", dict(rope_scaling={"type": "linear", "factor": 3.0})),
}


NEAR_TIE = 2**-3  # two bf16 steps of a logit in [8, 16): what the chains' roundings can flip


def forced(model, prompt, tokens):
    """teacher_forced's logits and the caches they leave."""
    cache = make_prompt_cache(model)
    logits = [model(prompt, cache=cache)[:, -1]]
    logits += [model(mx.array([[t]]), cache=cache)[:, -1] for t in tokens]
    return logits, cache


def margin(logits) -> float:
    """mlx-lm's own top-1 minus top-2 logit."""
    top = mx.sort(logits.astype(mx.float32), axis=-1)[..., -2:]
    return (top[..., 1] - top[..., 0]).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_tokens_match_mlx_lm(case, dtype, steps):
    """A 12-token prompt (mlx-lm's path: past the query limit), then 10 fused steps."""
    arch, changes = GREEDY_CASES[case]
    if arch == "qwen3_moe" and dtype == mx.bfloat16:
        pytest.skip("MLX 0.32's CPU gather_mm (the experts) takes float32 only")
    model = arch_model(arch, dtype, **changes)
    prompt, count = prompt_ids(12), 10
    (theirs, their_logits, their_cache), (ours, our_logits, our_cache), calls = run_both(
        model, prompt, count
    )
    assert len(set(ours)) >= count // 2  # attention matters: the tokens are not one repeated id
    assert steps == [(1, 12 + i, 256) for i in range(count) for _ in range(LAYERS)]
    # The attention function is not reached by fused steps: only the prefill's calls.
    assert calls == {
        "fused": 0,
        "fused_quantized": 0,
        "fused_step": LAYERS * count,
        "mlx_lm": 2,
        "linear": 0,
    }
    if dtype == mx.float32:
        assert ours == theirs
        assert max_difference(our_logits, their_logits) <= 1e-4
        same_caches(our_cache, their_cache, 1e-4)
        return
    # bf16: both chains round, differently (RoPE, norms, attention), by up to ~0.1 on logits of
    # up to ~15. Greedy tokens are identical unless mlx-lm's own choice is a near-tie (llama-D64
    # meets one at token 2: margin 0.0625, one bf16 step), so the fused step runs on mlx-lm's
    # tokens (teacher forcing) and must pick mlx-lm's token at every step that is not one.
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert parted is None or margin(their_logits[parted]) <= NEAR_TIE
    with kernel.enabled():
        forced_logits, forced_cache = forced(model, prompt, theirs)
    for i, (a, b) in enumerate(zip(forced_logits[:count], their_logits[:count], strict=True)):
        if margin(b) > NEAR_TIE:
            assert mx.argmax(a, axis=-1).item() == theirs[i], f"token {i}"
    # No farther from float32 arithmetic on the same weights than mlx-lm's own chain.
    reference = arch_model(arch, dtype, **changes)
    reference.set_dtype(mx.float32)
    exact = teacher_forced(reference, prompt, theirs)
    assert max_difference(forced_logits, exact) <= 1.1 * max_difference(their_logits, exact)
    # Layer 0 sees the same inputs (bf16 roundings of norm and RoPE apart); later layers'
    # inputs carry the attention's rounding, so only their shapes are compared.
    same_caches(forced_cache, their_cache, 2**-6, layers=1)


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
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_generate_step_fused_every_step_without_cache_copies(arch, steps):
    """mlx-lm's own loop (generate_step: its stream, async evaluation): the same tokens, every
    decode step fused, and no cache copied (owned caches: the KVCache holds only the buffers the
    op returned). float32: in bf16 this prompt meets a near-tie at token 5 (margin 0.03, one bf16
    step), which mlx-lm's chain and the fused step round to different sides; float32 arithmetic
    picks the fused step's token there."""
    from mlx_lm.generate import generate_step

    model = arch_model(arch)
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


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("draft_tokens", [2, 5])
def test_speculative_decoding_verifies_through_the_fused_step(draft_tokens, steps):
    """mlx-lm's speculative_generate_step with a draft model (the model's first layer alone, so it
    agrees with the model on some tokens and not on others), float32: the draft's steps (L = 1)
    and the model's verify steps (the drafted tokens and the last accepted one, L = draft_tokens
    + 1, causal, then the cache trimmed back to the accepted ones) run as fused steps; mlx-lm's
    tokens and which of them the draft proposed."""
    from mlx_lm.generate import speculative_generate_step

    model = qwen3_model()
    draft = qwen3_model()
    draft.model.layers = draft.model.layers[:1]
    prompt = prompt_ids(12)[0]

    def run():
        return [
            (int(t), from_draft)
            for t, _, from_draft in speculative_generate_step(
                prompt, model, draft, num_draft_tokens=draft_tokens, max_tokens=16
            )
        ]

    theirs = run()
    with kernel.enabled():
        ours = run()
        calls = kernel.calls()
    assert ours == theirs
    drafted = [from_draft for _, from_draft in ours]
    assert any(drafted) and not all(drafted[1:])  # drafts accepted, and some rejected
    verify = [length for length, _, _ in steps if length == draft_tokens + 1]
    assert verify and len(steps) == calls["fused_step"]
    assert calls["mlx_lm"] == LAYERS + 1  # the two prompts' prefills (12 > 8 positions)


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
    "rope scaling (dynamic NTK: its frequencies follow the offset)": lambda: (
        arch_model(
            "llama", rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=16
        ),
        make_prompt_cache,
    ),
    "norm weights in bf16, projections in float32": lambda: (
        with_norms(qwen3_model(), dtype=mx.bfloat16),
        make_prompt_cache,
    ),
    "eps 0 (the op refuses it)": lambda: (with_norms(qwen3_model(), eps=0.0), make_prompt_cache),
    "llama: traditional rope": lambda: (
        arch_model("llama", rope_traditional=True),
        make_prompt_cache,
    ),
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


# (arch, window, keep, prompt length, config changes): a sliding window (mlx-lm's
# RotatingKVCache) filled and wrapped during decoding; a prompt longer than the window (its first
# step trims the buffer: mlx-lm's method, once); positions kept at the ring's start (keep: the
# ring turns over the rest); Gemma 3's D 256 with its 1 + weight norms and query scaling.
ROTATING = {
    "qwen3-wraps-while-decoding": ("qwen3", 16, 0, 12, {}),
    "llama-prompt-past-the-window": ("llama", 13, 0, 20, {}),
    "llama-keep-2": ("llama", 9, 2, 6, {}),
    # the window its config names (a larger buffer makes mlx-lm pass a mask: its path)
    "gemma3_text-D256": ("gemma3_text", 8, 0, 6, dict(head_dim=256, query_pre_attn_scalar=256)),
}


def decode_on_rings(model, window, keep, prompt_len, count, fused_step):
    """Greedy tokens, logits (the prompt's, then `count` steps'), the caches and the kernel's call
    counts of `model` with a RotatingKVCache(window, keep) in every layer."""
    cache = [RotatingKVCache(max_size=window, keep=keep) for _ in range(LAYERS)]
    with kernel.enabled(fused_step=fused_step):
        logits = [model(prompt_ids(prompt_len), cache=cache)[:, -1]]
        tokens = []
        for _ in range(count):
            tokens.append(mx.argmax(logits[-1], axis=-1).item())
            logits.append(model(mx.array([[tokens[-1]]]), cache=cache)[:, -1])
        return tokens, logits, cache, kernel.calls()


def same_rings(ours, theirs):
    """same_caches, and every ring's write slot as mlx-lm's."""
    same_caches(ours, theirs, 1e-4)
    assert [c._idx for c in ours] == [c._idx for c in theirs]


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("case", ROTATING)
def test_rotating_cache_decodes_fused_through_the_wrap(case, steps):
    """Every layer's cache a RotatingKVCache: its single-token steps run the fused step, at the
    offset until the window fills, then at the ring's slot with the sequence position (one query
    sees every key of the full ring, as mlx-lm's unmasked call does). Greedy tokens, logits and
    the caches (size, offset, slot, contents) as mlx-lm's."""
    arch, window, keep, prompt_len, changes = ROTATING[case]
    model = arch_model(arch, **changes)
    theirs, their_logits, their_cache, _ = decode_on_rings(
        model, window, keep, prompt_len, 10, False
    )
    ours, our_logits, our_cache, calls = decode_on_rings(model, window, keep, prompt_len, 10, True)
    assert ours == theirs
    assert max_difference(our_logits, their_logits) <= 1e-4
    same_rings(our_cache, their_cache)
    # Each step's slot: the offset until the window fills, then around the ring from `keep`; a
    # prompt past the window leaves its first step to mlx-lm's method (it trims the buffer to
    # the window and writes at `keep`).
    trimmed = prompt_len > window
    slot, slots = keep + 1 if trimmed else prompt_len, []
    for _ in range(10 - trimmed):
        slot = keep if slot == window else slot
        slots.append(slot)
        slot += 1
    expected = [(1, s, window) for s in slots]
    assert steps == [s for s in expected for _ in range(LAYERS)]
    assert calls["fused_step"] == len(expected) * LAYERS


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_a_window_smaller_than_the_ring_keeps_mlx_lms_masked_step(steps):
    """gemma3_text's sliding window (8) inside a larger RotatingKVCache (11): once the window is
    full mlx-lm masks the ring's oldest positions, so those steps of the sliding layer run
    mlx-lm's method; the global layer's steps stay fused. Tokens, logits and caches as mlx-lm's."""
    model = arch_model("gemma3_text")
    _, their_logits, their_cache, _ = decode_on_rings(model, 11, 0, 6, 8, False)
    _, our_logits, our_cache, calls = decode_on_rings(model, 11, 0, 6, 8, True)
    assert max_difference(our_logits, their_logits) <= 1e-4
    same_rings(our_cache, their_cache)
    # (L, slot, capacity) of each fused step: both layers while the sliding one's offset is
    # below its window (6 and 7), then the global layer's alone, around its ring from offset 11.
    both = [(1, p, 11) for p in (6, 7) for _ in range(LAYERS)]
    assert steps == both + [(1, p % 11, 11) for p in range(8, 14)]
    assert calls["fused_step"] == len(steps)


def test_outside_the_guard_no_fused_step(steps):
    """The guard's own table: head dims no record covers (48, in float32 and bf16) and contexts
    past the largest measured run mlx-lm's method, bit-equal."""
    models = (
        qwen3_model(head_dim=48),
        qwen3_model(mx.bfloat16, head_dim=48),
        arch_model("llama", mx.bfloat16, head_dim=48),
    )
    for model in models:
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


def replaced() -> set[str]:
    """The mlx-lm modules whose Attention.__call__ is not mlx-lm's own."""
    return {a.__module__ for a, call in MLX_LM_CALLS.items() if a.__dict__["__call__"] is not call}


def test_enable_disable_restore_the_method():
    everything = {
        f"mlx_lm.models.{m}"
        for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3")
    }
    assert not kernel.fused_step_enabled() and methods_are_mlx_lms()
    kernel.enable()  # the default: the fused step in every STEP_MODELS class
    kernel.enable()  # idempotent
    assert kernel.fused_step_enabled() and replaced() == everything
    assert set(step.STEP_MODELS) == {m.rsplit(".", 1)[1] for m in everything}
    kernel.enable(fused_step=False)  # mlx-lm's methods again, the function still ours
    assert methods_are_mlx_lms() and not kernel.fused_step_enabled()
    assert base.scaled_dot_product_attention is kernel.scaled_dot_product_attention
    kernel.enable()
    assert replaced() == everything
    kernel.disable()
    assert methods_are_mlx_lms()
    assert base.scaled_dot_product_attention is MLX_LM_SDPA
    assert not kernel.fused_step_enabled()


def test_context_manager_restores_the_state_before():
    with kernel.enabled():
        assert kernel.fused_step_enabled()
        with kernel.enabled(fused_step=False):
            assert not kernel.fused_step_enabled() and methods_are_mlx_lms()
        assert kernel.fused_step_enabled()
    assert not kernel.is_enabled() and not kernel.fused_step_enabled()
    assert methods_are_mlx_lms()
    kernel.enable(fused_step=False)
    with kernel.enabled():
        assert kernel.fused_step_enabled()
    assert kernel.is_enabled() and not kernel.fused_step_enabled() and methods_are_mlx_lms()


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


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("arch", STEP_ARCHS)
def test_explicit_mask_array_runs_mlx_lm(arch, steps):
    """A decode call with a mask array (batched generation's padding, sliding windows) runs
    mlx-lm's method, bit-equal to it; the same call with mask None is fused."""
    model = arch_model(arch)
    attention = model.model.layers[0].self_attn
    prefill = mx.random.normal((1, 10, model.args.hidden_size), key=mx.random.key(2))
    x = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(3))
    mask = mx.arange(11) % 3 > 0
    outputs = []
    for fused_step in (False, True):
        cache = KVCache()
        with kernel.enabled(fused_step=fused_step):
            attention(prefill, "causal", cache)
            outputs.append(attention(x, mask, cache))
            outputs.append(attention(x, None, cache))
    assert mx.array_equal(outputs[0], outputs[2]).item()
    assert [s[:2] for s in steps] == [(1, 11)]
    assert mx.allclose(outputs[1], outputs[3], atol=1e-4, rtol=1e-4).item()


# On CUDA, inside the guard's own region (bf16, D=128).
CUDA_CASES = {
    "qwen3": ("qwen3", dict(head_dim=128)),
    "llama": ("llama", dict(head_dim=128, rope_theta=500000.0)),
    "qwen2": ("qwen2", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)),
}


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("case", CUDA_CASES)
def test_fused_step_on_cuda(case, steps):
    """Every decode step through the step op's CUDA kernels (with q/k norms for Qwen3, without
    for Llama and Qwen2), and its logits no farther from float32 arithmetic than mlx-lm's
    chain."""
    mx.set_default_device(mx.gpu)
    arch, changes = CUDA_CASES[case]
    model = arch_model(arch, mx.bfloat16, **changes)
    prompt, count = prompt_ids(12), 10
    (theirs, their_logits, _), (ours, our_logits, _), calls = run_both(model, prompt, count)
    reference = arch_model(arch, mx.bfloat16, **changes)
    reference.set_dtype(mx.float32)
    # Each run against float32 arithmetic on its own tokens (a bf16 near-tie may part them).
    our_error = max_difference(our_logits, teacher_forced(reference, prompt, ours))
    their_error = max_difference(their_logits, teacher_forced(reference, prompt, theirs))
    assert our_error <= 1.1 * their_error
    assert calls["fused_step"] == LAYERS * count
    assert steps == [(1, 12 + i, 256) for i in range(count) for _ in range(LAYERS)]


# (arch, group size, bits) of mlx-lm's QuantizedKVCache whose decode steps take the quantized step.
QUANTIZED_STEP_CASES = {
    "qwen3-D128-g32-8bit": ("qwen3", 32, 8),
    "qwen3-D128-g64-4bit": ("qwen3", 64, 4),
    "llama-D64-g64-4bit": ("llama", 64, 4),
    # D 96 takes group 32 only; the CPU's step takes it (the GPUs' take multiples of 64)
    "mistral-D96-g32-8bit": ("mistral", 32, 8),
    "phi3-D96-g32-4bit": ("phi3", 32, 4),
}


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("case", QUANTIZED_STEP_CASES)
def test_quantized_cache_decodes_through_the_quantized_step(case):
    """With mlx-lm's QuantizedKVCache (float32) every decode step runs attention_step_quantized
    (none reaches the attention function), the cache grows as mlx-lm's, layer 0's values are
    quantized to mlx-lm's codes bit for bit, and tokens and logits are mlx-lm's."""
    arch, group_size, bits = QUANTIZED_STEP_CASES[case]
    model = arch_model(arch)
    prompt, count = prompt_ids(12), 10

    def run(fused):
        cache = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(LAYERS)]
        with kernel.enabled(fused_step=fused):
            logits = [model(prompt, cache=cache)[:, -1]]
            tokens = []
            for _ in range(count):
                tokens.append(mx.argmax(logits[-1], axis=-1).item())
                logits.append(model(mx.array([[tokens[-1]]]), cache=cache)[:, -1])
            return tokens, logits, cache, kernel.calls()

    theirs, their_logits, their_cache, their_calls = run(False)
    ours, our_logits, our_cache, calls = run(True)
    assert their_calls["fused_step"] == 0
    assert calls == {
        "fused": 0,
        "fused_quantized": 0,
        "fused_step": LAYERS * count,
        "mlx_lm": 2,
        "linear": 0,
    }
    assert ours == theirs and len(set(ours)) > count // 2
    assert max_difference(our_logits, their_logits) <= 1e-3
    for a, b in zip(our_cache, their_cache, strict=True):
        assert a.offset == b.offset
        assert [x.shape for x in (*a.keys, *a.values)] == [x.shape for x in (*b.keys, *b.values)]
    for x, y in zip(our_cache[0].values, their_cache[0].values, strict=True):
        assert mx.array_equal(x[..., : 12 + count, :], y[..., : 12 + count, :]).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_quantized_cache_verify_step_through_the_quantized_step():
    """Four tokens at once after the prompt (speculative decoding's verify step) with mlx-lm's
    QuantizedKVCache, where the guard's quantized region takes them (the CPU's: L <= 8): one
    attention_step_quantized per layer, every position's logits and the cache as mlx-lm's."""
    model = arch_model("qwen3")
    prompt, draft = prompt_ids(12), prompt_ids(4, seed=9)
    head_dim = model.args.head_dim
    if not guard.use_step_quantized(4, 16, head_dim, "causal", group_size=64):
        pytest.skip("four tokens are outside this backend's measured quantized region")

    def run(enabled):
        cache = [QuantizedKVCache(group_size=64, bits=4) for _ in range(LAYERS)]
        if not enabled:
            model(prompt, cache=cache)
            return model(draft, cache=cache), cache, None
        with kernel.enabled():
            model(prompt, cache=cache)
            logits = model(draft, cache=cache)
            return logits, cache, kernel.calls()

    theirs, their_cache, _ = run(False)
    ours, our_cache, calls = run(True)
    assert calls["fused_step"] == LAYERS and calls["mlx_lm"] == LAYERS  # the prompt: mlx-lm's
    assert max_difference([ours], [theirs]) <= 1e-3
    assert [c.offset for c in our_cache] == [c.offset for c in their_cache] == [16] * LAYERS
