"""attn_kernels.mlx_lm: mlx-lm models decode through the fused op with the same greedy tokens as
mlx-lm's own attention, every other call goes to mlx-lm's function untouched, and disable() puts
every name back. The attention function's path is tested here with enable(fused_step=False) (the
fused step of llama, qwen2 and qwen3, enable()'s default, takes their decode steps before they
reach it: test_mlx_lm_step.py)."""

import dataclasses
import importlib
import math
import subprocess
import sys

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import attn_kernels.mlx_lm as kernel
from attn_kernels import guard
from attn_kernels.attention import FLOAT_DTYPES, MAX_HEAD_DIM
from mlx.utils import tree_flatten
from mlx_lm.models import base
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import MODEL_REMAPPING

MLX_LM_SDPA = base.scaled_dot_product_attention
MAX_QUERY = guard.LIMITS["cpu"].max_query

# Tiny configs of mlx-lm architectures, head dims 64 to 256 (80 and 96 not multiples of 32).
# "mistral" loads through llama.py as mlx-lm's loader maps it; gemma3_text's even layers use a
# RotatingKVCache of 8 positions (a sliding window).
ARCHS = {
    "llama": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2),  # D 64
    "mistral": dict(hidden_size=192, num_attention_heads=8, num_key_value_heads=2, head_dim=96),
    "qwen2": dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=2),  # D 80
    "qwen3": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen3_moe": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        rope_theta=1e6,
    ),
    "phi3": dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2),  # D 96, no GQA
    "gemma": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256),
    "gemma3_text": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=48,
    ),
}
LAYERS, VOCAB = 2, 512


def tiny_model(arch: str, dtype=mx.float32, seed: int = 1):
    """Seeded random weights, 2-D ones scaled so attention moves the greedy tokens."""
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(arch, arch)}")
    config = dict(
        model_type=arch,
        num_hidden_layers=LAYERS,
        intermediate_size=256,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        **ARCHS[arch],
    )
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    weights = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.split(key, i + 2)[-1]
        if p.ndim == 2:
            p = mx.random.normal(p.shape, key=k) * 2.0 / p.shape[-1] ** 0.5
        elif name.endswith("bias"):
            p = mx.random.normal(p.shape, key=k) * 0.1
        weights.append((name, p.astype(dtype)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def greedy(model, prompt, steps, cache=None):
    cache = make_prompt_cache(model) if cache is None else cache
    logits = [model(prompt, cache=cache)[:, -1]]
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        tokens.append(token.item())
        logits.append(model(token[None], cache=cache)[:, -1])
    return tokens, logits, cache


def make_quantized_cache(bits: int) -> list:
    """A QuantizedKVCache of group 32 (every test head dim's) a layer."""
    return [QuantizedKVCache(group_size=32, bits=bits) for _ in range(LAYERS)]


@pytest.fixture
def fused_calls(monkeypatch):
    """Shapes (L, S) of every call the fused op computed."""
    seen = []
    op = kernel.decode_attention_custom

    def spy(q, k, v, **kw):
        out = op(q, k, v, **kw)
        seen.append((q.shape[2], k.shape[2]))
        return out

    monkeypatch.setattr(kernel, "decode_attention_custom", spy)
    return seen


@pytest.fixture
def any_head_dim_and_dtype(monkeypatch):
    """The guard widened to every head dim and float dtype the kernel takes and batches of up to
    64 rows (its records cover D=128 bf16): the kernel's results inside mlx-lm on shapes the
    guard leaves to mx.fast."""
    wide = dataclasses.replace(
        guard.LIMITS["cpu"],
        head_dims=tuple(range(1, MAX_HEAD_DIM + 1)),
        dtypes=FLOAT_DTYPES,
        max_batch=64,
    )
    monkeypatch.setitem(guard.LIMITS, "cpu", wide)


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    kernel.disable()


@pytest.fixture
def mlx_matmuls(monkeypatch):
    """The guard's linear limits emptied: enable() leaves every linear layer to MLX, so the tests
    of attention compare attention alone (test_mlx_lm_linear.py tests the linear layers)."""
    monkeypatch.setitem(guard.LINEAR_LIMITS, "cpu", (0, ()))


pytestmark = pytest.mark.usefixtures("mlx_matmuls")


def prompt_ids(length, seed=5):
    return mx.random.randint(0, VOCAB, (1, length), key=mx.random.key(seed))


def teacher_forced(model, prompt, tokens):
    """The logits greedy() saw, for a given token sequence."""
    cache = make_prompt_cache(model)
    logits = [model(prompt, cache=cache)[:, -1]]
    logits += [model(mx.array([[t]]), cache=cache)[:, -1] for t in tokens]
    return logits


def max_difference(ours, theirs):
    return max(
        mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        for a, b in zip(ours, theirs, strict=True)
    )


def bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def assert_same_until_a_near_tie(ours, theirs, their_logits):
    """bf16 paths round differently: their greedy tokens may part, but only where mlx-lm's own
    logits put our choice within 2 bf16 steps of its own (a tie either rounding may break)."""
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if parted is not None:
        logits = their_logits[parted][0].astype(mx.float32)
        theirs_value, ours_value = logits[theirs[parted]].item(), logits[ours[parted]].item()
        assert theirs_value - ours_value <= 2 * bf16_ulp(theirs_value), (parted, ours, theirs)


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gemma3_text"])
def test_greedy_tokens_match_mlx_lm(arch, dtype, fused_calls):
    """A 12-token prompt (past the query limit: mlx-lm's path), then 10 decode steps (fused).
    float32: mlx-lm's tokens and logits. bf16: its tokens until a near tie, and logits (teacher-
    forced on its tokens) no farther from float32 arithmetic on the same weights than its own."""
    if arch == "qwen3_moe" and dtype == mx.bfloat16:
        pytest.skip("MLX 0.32's CPU gather_mm (the experts) takes float32 only")
    model = tiny_model(arch, dtype)
    prompt, steps = prompt_ids(12), 10
    theirs, their_logits, _ = greedy(model, prompt, steps)
    with kernel.enabled(fused_step=False):
        ours, our_logits, _ = greedy(model, prompt, steps)
        counts, ran_fused = kernel.calls(), list(fused_calls)
        ours_forced = teacher_forced(model, prompt, theirs)
    assert len(set(ours)) >= steps // 2  # attention matters: the tokens are not one repeated id
    if dtype == mx.float32:
        assert ours == theirs
        assert max_difference(our_logits, their_logits) <= 1e-4
    else:
        # Both paths round differently in bf16 (the kernel accumulates in float32, mx.fast's CPU
        # path rounds scores and probabilities to bf16), by up to ~0.2 on logits of up to ~15
        # here.
        assert_same_until_a_near_tie(ours, theirs, their_logits)
        reference = tiny_model(arch, dtype)
        reference.set_dtype(mx.float32)
        exact = teacher_forced(reference, prompt, theirs)
        assert max_difference(ours_forced, exact) <= 1.25 * max_difference(their_logits, exact)
    decode = [(1, 12 + i) for i in range(1, steps + 1) for _ in range(LAYERS)]
    assert ran_fused == decode
    assert counts == {
        "fused": len(decode),
        "fused_quantized": 0,
        "fused_step": 0,
        "mlx_lm": LAYERS,
        "linear": 0,
    }


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_short_prefill_is_causal_and_fused(fused_calls):
    """A prompt within the query limit runs fused with mask "causal" (bottom-right aligned, as
    mx.fast's), and so do the decode steps after it."""
    length = MAX_QUERY
    model = tiny_model("qwen3")
    theirs, their_logits, _ = greedy(model, prompt_ids(length), 6)
    with kernel.enabled(fused_step=False):
        ours, our_logits, _ = greedy(model, prompt_ids(length), 6)
    assert ours == theirs
    assert max_difference(our_logits, their_logits) <= 1e-4
    assert fused_calls[:LAYERS] == [(length, length)] * LAYERS
    assert len(fused_calls) == LAYERS * 7


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_sliding_window_layers_stay_fused_once_the_rotating_cache_wraps(fused_calls):
    """gemma3_text: layer 0 keeps 8 positions in a RotatingKVCache, layer 1 a KVCache. A 5-token
    prompt (layer 0: the attention op, causal; layer 1: the fused step), then 10 steps, both
    layers' through the fused step (layer 0's over its whole window once the ring is full: one
    query sees every key, in whatever order the buffer holds them; Gemma's 1 + weight q/k norms,
    its query scaling). Tokens and logits match mlx-lm's."""
    model = tiny_model("gemma3_text")
    theirs, their_logits, _ = greedy(model, prompt_ids(5), 10)
    with kernel.enabled():
        ours, our_logits, cache = greedy(model, prompt_ids(5), 10)
        counts = kernel.calls()
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache]
    assert ours == theirs
    assert max_difference(our_logits, their_logits) <= 1e-4
    assert fused_calls == [(5, 5)]  # layer 0's prompt
    assert counts == {
        "fused": 1,
        "fused_quantized": 0,
        "fused_step": 21,  # layer 1's prompt (L <= 8), then both layers' 10 steps
        "mlx_lm": 0,
        "linear": 0,
    }


# Each architecture in the dtype of its published MLX checkpoints (bf16; Qwen3-MoE in float32:
# MLX's CPU gather_mm, its experts, takes float32 only), with the head dims of the models people
# run: Llama-3.2-1B's 64, Phi-3's 96 without GQA, Gemma-3's 256 with its query scaling and
# sliding-window layers.
PUBLISHED = {
    "llama-D64": ("llama", mx.bfloat16, {}),
    "mistral-D96": ("mistral", mx.bfloat16, {}),
    "qwen2-D80": ("qwen2", mx.bfloat16, {}),
    "qwen3-D128": ("qwen3", mx.bfloat16, {}),
    "qwen3_moe-D128": ("qwen3_moe", mx.float32, {}),
    "gemma-D256": ("gemma", mx.bfloat16, {}),
    "gemma3_text-D256": ("gemma3_text", mx.bfloat16, dict(head_dim=256, query_pre_attn_scalar=256)),
    "phi3-D96": ("phi3", mx.bfloat16, {}),
}


@pytest.mark.parametrize("case", PUBLISHED)
def test_architectures_decode_fused_under_the_guards_own_table(case, monkeypatch):
    """enable() as a user gets it (the fused step where the architecture has it) with the guard
    as recorded: a 12-token prompt (mlx-lm's path: past the query limit), then 10 decode steps,
    each layer's fused (gemma3_text's sliding layer through the attention op over its wrapped
    window); mlx-lm's greedy tokens (bf16: until a near tie)."""
    arch, dtype, changes = PUBLISHED[case]
    monkeypatch.setitem(ARCHS, arch, {**ARCHS[arch], **changes})
    model = tiny_model(arch, dtype)
    prompt, steps = prompt_ids(12), 10
    theirs, their_logits, _ = greedy(model, prompt, steps)
    with kernel.enabled():
        ours, _, _ = greedy(model, prompt, steps)
        counts = kernel.calls()
    if dtype == mx.float32:
        assert ours == theirs
    else:
        assert_same_until_a_near_tie(ours, theirs, their_logits)
    assert counts["fused"] + counts["fused_step"] == LAYERS * steps
    assert counts["mlx_lm"] == LAYERS  # the prefill


@pytest.mark.parametrize("bits", [4, 8])
def test_phi3_quantized_cache_under_the_guards_own_table(bits):
    """Phi-3 (D 96, no GQA, bf16) with a QuantizedKVCache of group 32 (the only group that
    divides 96), the guard as recorded: each decode step through attention_step_quantized on the
    cache's codes. Its tokens are test_quantized_cache_greedy_tokens_match_mlx_lm's (float32:
    mlx-lm's quantized path rounds its scaled queries and scores to bf16, which parts bf16 tokens
    far from a tie) and test_mlx_lm_step's."""
    if guard.backend() != "cpu":
        pytest.skip("D 96 over a quantized cache is measured on the CPU only")
    model = tiny_model("phi3", mx.bfloat16)
    with kernel.enabled():
        tokens, _, _ = greedy(model, prompt_ids(12), 10, make_quantized_cache(bits))
        counts = kernel.calls()
    assert len(tokens) == 10
    assert counts["fused_step"] == LAYERS * 10 and counts["fused_quantized"] == 0
    assert counts["mlx_lm"] == LAYERS  # the prefill


@pytest.mark.parametrize(
    "arch, dtype, fused",
    [("qwen3", mx.bfloat16, True), ("gemma3_text", mx.bfloat16, False)],
)
def test_the_guard_decides_head_dim_and_dtype(arch, dtype, fused, fused_calls):
    """With the guard's own table: qwen3 (D=128) in bf16 decodes fused; gemma3_text's tiny D=48,
    a head dim no record covers, runs mlx-lm's attention on every call."""
    model = tiny_model(arch, dtype)
    prompt = prompt_ids(12)
    theirs, their_logits, _ = greedy(model, prompt, 6)
    with kernel.enabled(fused_step=False):
        ours, our_logits, _ = greedy(model, prompt, 6)
        counts = kernel.calls()
    assert ours == theirs
    if fused:
        assert len(fused_calls) == counts["fused"] == LAYERS * 6
    else:
        assert fused_calls == []
        assert counts == {
            "fused": 0,
            "fused_quantized": 0,
            "fused_step": 0,
            "mlx_lm": LAYERS * 7,
            "linear": 0,
        }
        assert max_difference(our_logits, their_logits) == 0


def test_generate_step_decodes_through_the_kernel(fused_calls):
    """mlx-lm's own generation loop (generate_step: its stream, async evaluation, cache)."""
    from mlx_lm.generate import generate_step

    model = tiny_model("qwen3", mx.bfloat16)
    prompt = prompt_ids(20)[0]
    theirs = [t for t, _ in generate_step(prompt, model, max_tokens=8)]
    with kernel.enabled(fused_step=False):
        ours = [t for t, _ in generate_step(prompt, model, max_tokens=8)]
    assert ours == theirs
    assert len(fused_calls) >= LAYERS * 8
    assert all(length == 1 for length, _ in fused_calls)


def qkv(length, context, d=64, dv=None, hq=4, hkv=2, dtype=mx.float32):
    keys = mx.random.split(mx.random.key(length * 1000 + context), 3)
    q = mx.random.normal((1, hq, length, d), key=keys[0]).astype(dtype)
    k = mx.random.normal((1, hkv, context, d), key=keys[1]).astype(dtype)
    v = mx.random.normal((1, hkv, context, dv or d), key=keys[2]).astype(dtype)
    return q, k, v


def wrapped_rotating_cache():
    cache = RotatingKVCache(max_size=4)
    for s in range(6):
        k = mx.random.normal((1, 2, 1, 64), key=mx.random.key(s))
        cache.update_and_fetch(k, k)
    return cache


def mixed(q, k, v):
    return q, k.astype(mx.bfloat16), v.astype(mx.bfloat16)


def quantized(q, k, v, bits=8):
    cache = QuantizedKVCache(group_size=32, bits=bits)
    keys, values = cache.update_and_fetch(k, v)
    return q, keys, values, cache


# Calls that must reach mlx-lm's function with their arguments as given.
FALLBACKS = {
    "query longer than the limit": lambda: (*qkv(MAX_QUERY + 1, 40), None, "causal", None),
    "explicit boolean mask": lambda: (*qkv(1, 40), None, mx.arange(40) % 3 > 0, None),
    "explicit additive mask": lambda: (*qkv(2, 40), None, mx.zeros((2, 40)), None),
    "attention sinks": lambda: (*qkv(1, 40), None, None, mx.zeros((4,))),
    # past every backend's measured query length over a quantized cache (the CPU's: 8)
    "quantized cache, nine query tokens": lambda: (*quantized(*qkv(9, 40)), "causal", None),
    "value head dim differs": lambda: (*qkv(1, 40, d=64, dv=32), None, None, None),
    "head dim above the kernel's": lambda: (*qkv(1, 40, d=320), None, None, None),
    "mixed dtypes": lambda: (*mixed(*qkv(1, 40)), None, None, None),
    "rotating cache once wrapped, two query tokens": lambda: (
        *qkv(2, 4),
        wrapped_rotating_cache(),
        "causal",
        None,
    ),
}


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("case", FALLBACKS)
def test_unsupported_calls_go_to_mlx_lm_unchanged(case, fused_calls):
    q, k, v, cache, mask, sinks = FALLBACKS[case]()  # built twice: mlx-lm scales q in place
    expected = MLX_LM_SDPA(q, k, v, cache, scale=0.125, mask=mask, sinks=sinks)
    q, k, v, cache, mask, sinks = FALLBACKS[case]()
    kernel.enable()
    out = base.scaled_dot_product_attention(q, k, v, cache, scale=0.125, mask=mask, sinks=sinks)
    assert fused_calls == []
    assert kernel.calls() == {
        "fused": 0,
        "fused_quantized": 0,
        "fused_step": 0,
        "mlx_lm": 1,
        "linear": 0,
    }
    assert out.dtype == expected.dtype and mx.array_equal(out, expected).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize(
    "length, context, mask, dtype",
    [
        (1, 1, None, mx.float32),
        (1, 77, None, mx.bfloat16),
        (3, 50, "causal", mx.float16),
        (MAX_QUERY, 300, "causal", mx.float32),
    ],
)
def test_supported_calls_match_mlx_lm(length, context, mask, dtype, fused_calls):
    from conftest import TOLERANCE

    q, k, v = qkv(length, context, d=96, hq=8, hkv=2, dtype=dtype)
    cache = KVCache()
    k, v = cache.update_and_fetch(k, v)
    expected = MLX_LM_SDPA(q, k, v, cache, scale=0.1, mask=mask)
    with kernel.enabled():
        out = base.scaled_dot_product_attention(q, k, v, cache, scale=0.1, mask=mask)
    assert fused_calls == [(length, context)]
    tol = {name: 2 * bound for name, bound in TOLERANCE[dtype].items()}
    assert out.dtype == dtype and mx.allclose(out, expected, **tol).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
def test_one_query_over_a_wrapped_rotating_cache_matches_mlx_lm(fused_calls):
    """A sliding window past its size: the buffer holds the window's keys out of order, which one
    query's softmax sum does not see (mlx-lm's own call attends the buffer unmasked too)."""
    from conftest import TOLERANCE

    cache = RotatingKVCache(max_size=7)
    for s in range(12):  # wrapped at offset 8
        k = mx.random.normal((1, 2, 1, 64), key=mx.random.key(s))
        keys, values = cache.update_and_fetch(k, 2 * k + 1)
    q = qkv(1, 7)[0]
    expected = MLX_LM_SDPA(q, keys, values, cache, scale=0.125, mask=None)
    with kernel.enabled():
        out = base.scaled_dot_product_attention(q, keys, values, cache, scale=0.125, mask=None)
    assert fused_calls == [(1, 7)]
    assert mx.allclose(out, expected, **TOLERANCE[mx.float32]).item()


def holders(fn):
    return {
        name
        for name, module in list(sys.modules.items())
        if name != kernel.__name__
        and isinstance(getattr(module, "__dict__", None), dict)
        and module.__dict__.get(kernel.NAME) is fn
    }


def test_enable_and_disable_rebind_every_name(monkeypatch):
    import mlx_lm.models.llama  # noqa: F401  (loaded before enable)

    late = "mlx_lm.models.starcoder2"
    monkeypatch.delitem(sys.modules, late, raising=False)
    before = holders(MLX_LM_SDPA)
    assert {"mlx_lm.models.base", "mlx_lm.models.llama"} <= before

    kernel.enable()
    kernel.enable()  # idempotent
    assert holders(MLX_LM_SDPA) == set()
    assert holders(kernel.scaled_dot_product_attention) == before
    late_module = importlib.import_module(late)  # imported while enabled: takes ours from base
    assert late_module.scaled_dot_product_attention is kernel.scaled_dot_product_attention

    kernel.disable()
    kernel.disable()  # idempotent
    assert holders(kernel.scaled_dot_product_attention) == set()
    assert holders(MLX_LM_SDPA) == before | {late}
    assert base.scaled_dot_product_attention is MLX_LM_SDPA


def test_context_manager_nests_and_restores():
    with kernel.enabled():
        assert base.scaled_dot_product_attention is kernel.scaled_dot_product_attention
        with kernel.enabled():
            assert kernel.is_enabled()
        assert kernel.is_enabled()  # the inner block found it enabled and leaves it so
    assert not kernel.is_enabled()
    assert base.scaled_dot_product_attention is MLX_LM_SDPA

    kernel.enable()
    with kernel.enabled():
        pass
    assert kernel.is_enabled()


def test_a_stray_reference_after_disable_runs_mlx_lm(fused_calls):
    with kernel.enabled():
        stray = base.scaled_dot_product_attention
    q, k, v = qkv(1, 30)
    out = stray(q, k, v, None, scale=0.125, mask=None)
    assert fused_calls == []
    assert mx.array_equal(out, MLX_LM_SDPA(q, k, v, None, scale=0.125, mask=None)).item()


def test_imports_without_mlx_lm():
    code = (
        "import sys; sys.modules['mlx_lm'] = None\n"
        "import attn_kernels, attn_kernels.mlx_lm as k\n"
        "try:\n    k.enable()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs mlx-lm" in out.stdout


def test_command_help_and_errors(capsys):
    from attn_kernels.mlx_lm.__main__ import main

    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main([]) == 2
    assert "a command is needed" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "unknown command 'serve'" in capsys.readouterr().err


def test_command_generates_with_the_kernel(tmp_path, capsys):
    """`python -m attn_kernels.mlx_lm generate` on a local folder: mlx-lm loads the model and a
    word-level tokenizer made here, generates, and every decode step ran fused."""
    import json

    from attn_kernels.mlx_lm.__main__ import main
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("qwen3", mx.bfloat16)  # D=128 bf16: inside the guard's measured region
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = dict(model_type="qwen3", num_hidden_layers=LAYERS, intermediate_size=256)
    config.update(rms_norm_eps=1e-5, vocab_size=VOCAB, **ARCHS["qwen3"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(str(tmp_path))

    prompt = " ".join(f"w{i}" for i in range(3, 15))  # 12 tokens: prefill runs mlx-lm's path
    argv = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-tokens", "5"]
    assert main([*argv, "--ignore-chat-template"]) == 0
    out, err = capsys.readouterr()
    assert "Generation: 5 tokens" in out
    # The last prompt token and 5 more steps (generate_step computes one token ahead) as fused
    # steps (qwen3: enable()'s default); the 11-token prefill through mlx-lm's attention.
    expected = (
        f"{LAYERS * 6} fused steps, 0 fused, 0 fused over a quantized cache, {LAYERS} through "
        "mlx-lm's"
    )
    assert f"attention calls: {expected} attention" in err
    assert not kernel.is_enabled()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("length", [1, 4])
def test_quantized_cache_decode_through_the_quantized_op(bits, length, monkeypatch):
    """A QuantizedKVCache decode step (L = 1, or 4 causal tokens: a verify step) inside the
    guard's quantized region runs decode_attention_quantized on the cache's triples as they are,
    and agrees with mlx-lm's quantized path on the same codes."""
    mask = None if length == 1 else "causal"
    if not guard.use_fused_quantized(length, 300, mask):
        pytest.skip(f"L = {length} is outside this backend's measured quantized region")
    seen = []
    op = kernel.decode_attention_quantized
    monkeypatch.setattr(
        kernel, "decode_attention_quantized", lambda *a, **k: seen.append(k) or op(*a, **k)
    )
    q, k, v, cache = quantized(*qkv(length, 300, d=128, dtype=mx.bfloat16), bits=bits)
    expected = MLX_LM_SDPA(q, k, v, cache, scale=0.1, mask=mask)
    q, k, v, cache = quantized(*qkv(length, 300, d=128, dtype=mx.bfloat16), bits=bits)  # scaled
    with kernel.enabled():
        out = base.scaled_dot_product_attention(q, k, v, cache, scale=0.1, mask=mask)
        counts = kernel.calls()
    assert counts == {"fused": 0, "fused_quantized": 1, "fused_step": 0, "mlx_lm": 0, "linear": 0}
    assert [(s["group_size"], s["bits"]) for s in seen] == [(32, bits)]
    assert out.dtype == mx.bfloat16
    assert mx.allclose(out, expected, atol=0.1, rtol=0.05).item()


@pytest.mark.usefixtures("any_head_dim_and_dtype")
@pytest.mark.parametrize("arch, bits", [("qwen3", 8), ("phi3", 8), ("phi3", 4)])
def test_quantized_cache_greedy_tokens_match_mlx_lm(arch, bits):
    """mlx-lm's qwen3 (D 128) and phi3 (D 96, no GQA) with a QuantizedKVCache: the same greedy
    tokens with and without the kernel, the decode steps through the quantized op (the attention
    function's path: fused_step=False; with the fused step qwen3's take attention_step_quantized,
    test_mlx_lm_step)."""
    model = tiny_model(arch)
    prompt, steps = prompt_ids(12), 8

    def run():
        cache = make_quantized_cache(bits)
        token, tokens = model(prompt, cache=cache)[:, -1].argmax(-1), []
        for _ in range(steps):
            tokens.append(token.item())
            token = model(token[None], cache=cache)[:, -1].argmax(-1)
        return tokens

    theirs = run()
    with kernel.enabled(fused_step=False):
        ours = run()
        counts = kernel.calls()
    assert ours == theirs
    assert counts == {
        "fused": 0,
        "fused_quantized": LAYERS * steps,
        "fused_step": 0,
        "mlx_lm": LAYERS,
        "linear": 0,
    }
