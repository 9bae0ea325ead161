"""enable() runs mlx-lm's linear layers (nn.Linear, nn.QuantizedLinear, an embedding's as_linear
as the tied LM head) through decode_linear on the CPU where attn_kernels.guard accepts them:
greedy tokens equal mlx-lm's own in float32, bf16, 4 and 8 bits; the prompt (more than 8 rows),
enable(linear=False), layer subclasses and other formats keep MLX's matmuls; the MLPs' SwiGLU
runs inside down_proj's call; disable() puts the methods back."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")

import attn_kernels.linear
import attn_kernels.mlx_lm as kernel
from attn_kernels import guard
from mlx.utils import tree_flatten
from test_mlx_lm import LAYERS, greedy, max_difference, prompt_ids, teacher_forced, tiny_model

# Per decode step and layer: q, k, v, o, gate, up, down; then the LM head once.
LINEAR_PER_STEP = 7 * LAYERS + 1
VARIANTS = {"float32": (mx.float32, 0), "bfloat16": (mx.bfloat16, 0)}
VARIANTS |= {"4bit": (mx.bfloat16, 4), "8bit": (mx.bfloat16, 8)}


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    kernel.disable()


def tiny(arch: str, variant: str):
    dtype, bits = VARIANTS[variant]
    model = tiny_model(arch, dtype)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        mx.eval(model.parameters())
    return model


def exact_twin(model, arch: str):
    """The model in float32 arithmetic on the weights it holds (codes dequantized): the oracle
    both paths are measured against."""
    twin = tiny_model(arch, mx.float32)
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    layers = dict(model.named_modules())
    weights = []
    for name, p in tree_flatten(model.parameters()):
        owner, leaf = name.rsplit(".", 1)
        layer = layers[owner]
        if isinstance(layer, quantized):
            if leaf != "weight":
                continue
            p = mx.dequantize(p, layer.scales, layer.biases, layer.group_size, layer.bits)
            if "bias" in layer:
                weights.append((f"{owner}.bias", layer.bias.astype(mx.float32)))
        weights.append((name, p.astype(mx.float32)))
    twin.load_weights(weights, strict=True)
    return twin


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_steps_run_decode_linear_as_close_as_mlx(arch, variant):
    """A 12-token prompt (more rows than the guard's 8: MLX's matmuls), then 8 decode steps,
    teacher-forced on mlx-lm's greedy tokens, whose every linear layer runs decode_linear. Their
    logits are no farther from float32 arithmetic on the same weights than mlx-lm's own (ours
    accumulate in float32; x86 rounds x to int8 against 4-bit codes), and their greedy token is
    mlx-lm's wherever the exact logits' top two are farther apart than our error."""
    model = tiny(arch, variant)
    prompt, steps = prompt_ids(12), 8
    theirs, their_logits, _ = greedy(model, prompt, steps)
    assert len(set(theirs)) > steps // 2  # the tokens are not one repeated id
    with kernel.enabled():
        ours = teacher_forced(model, prompt, theirs)
        counts = kernel.calls()
    assert counts["linear"] == steps * LINEAR_PER_STEP
    exact = teacher_forced(exact_twin(model, arch), prompt, theirs)
    our_error = max_difference(ours, exact)
    assert our_error <= 1.25 * max_difference(their_logits, exact) + 1e-4
    for step, (a, e) in enumerate(zip(ours[:-1], exact[:-1], strict=True)):
        top2 = mx.sort(e[0])[-2:]
        if (top2[1] - top2[0]).item() > 2 * our_error:
            assert mx.argmax(a, axis=-1).item() == theirs[step], step
    if variant == "float32":
        with kernel.enabled():
            assert greedy(model, prompt, steps)[0] == theirs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_swiglu_runs_inside_down_proj(arch, monkeypatch):
    """Every decode step's down_proj takes the gate (one op for the SwiGLU and the matmul); the
    prompt's rows (more than the guard's 8) run mlx-lm's swiglu and matmul."""
    gated = []
    original = attn_kernels.linear.decode_linear
    monkeypatch.setattr(
        attn_kernels.linear,
        "decode_linear",
        lambda *a, **k: gated.append(k.get("gate") is not None) or original(*a, **k),
    )
    model = tiny(arch, "float32")
    prompt, steps = prompt_ids(12), 4
    theirs = greedy(model, prompt, steps)[0]
    with kernel.enabled():
        assert greedy(model, prompt, steps)[0] == theirs
    # Per decode step and layer 6 plain calls and 1 gated, then the head.
    assert sum(gated) == steps * LAYERS
    assert len(gated) == steps * LINEAR_PER_STEP


def test_swiglu_mlps_are_mlx_lm_s_and_come_back():
    """The MLPs enable() replaces are still mlx-lm's `down_proj(swiglu(gate_proj(x),
    up_proj(x)))` (a changed mlx-lm fails here, not in a model), and disable() restores them."""
    classes = [importlib.import_module(f"mlx_lm.models.{m}").MLP for m in kernel.SWIGLU_MLPS]
    methods = [cls.__call__ for cls in classes]
    assert all(kernel.swiglu_mlp(cls) for cls in classes)
    kernel.enable()
    assert all(cls.__call__.__wrapped__ is m for cls, m in zip(classes, methods, strict=True))
    kernel.enable(linear=False)
    assert [cls.__call__ for cls in classes] == methods
    kernel.enable()
    kernel.disable()
    assert [cls.__call__ for cls in classes] == methods

    class Other(nn.Module):
        def __call__(self, x):
            return self.down_proj(x)

    assert not kernel.swiglu_mlp(Other)


def test_linear_false_and_disable_keep_mlx_matmuls():
    model = tiny("qwen3", "bfloat16")
    prompt = prompt_ids(12)
    theirs, their_logits, _ = greedy(model, prompt, 4)
    methods = (nn.Linear.__call__, nn.QuantizedLinear.__call__, nn.Embedding.as_linear)
    with kernel.enabled(fused_step=False, linear=False):
        ours = greedy(model, prompt, 4)[0]
        assert kernel.calls()["linear"] == 0 and not kernel.linear_enabled()
        assert nn.Linear.__call__ is methods[0]
    assert ours == theirs
    kernel.enable()
    assert kernel.linear_enabled() and nn.Linear.__call__ is not methods[0]
    kernel.enable(linear=False)  # an enabled kernel gives the methods back (the fold stays)
    assert not kernel.linear_enabled()
    assert (nn.Linear.__call__, nn.Embedding.as_linear) == (methods[0], methods[2])
    assert nn.QuantizedLinear.__call__.__wrapped__ is methods[1]
    kernel.enable()
    kernel.disable()
    assert (nn.Linear.__call__, nn.QuantizedLinear.__call__, nn.Embedding.as_linear) == methods
    # MLX's own again: bit for bit.
    again, again_logits, _ = greedy(model, prompt, 4)
    assert again == theirs and max_difference(again_logits, their_logits) == 0


@pytest.mark.parametrize(
    ("table", "value", "routing"),
    [("LINEAR_LIMITS", (0, ()), "off"), ("LINEAR_MIN_ROWS", 2, "batches")],
    ids=["no-limits", "limits-from-2-rows"],
)
def test_no_routing_by_default_where_one_row_keeps_mlx(monkeypatch, table, value, routing):
    """enable() installs the routing for every call only where the default device's backend runs
    decode_linear for one row: not where it has no linear limits, and where they start at 2 rows
    (CUDA: a single request's decode would pay the Python for nothing) only inside mlx-lm's
    batched decode steps; linear=True installs it for every call (verify steps)."""
    monkeypatch.setitem(getattr(guard, table), "cpu", value)
    mlx_call = nn.Linear.__call__
    kernel.enable()
    assert kernel.linear_routing() == routing and not kernel.linear_enabled()
    assert nn.Linear.__call__ is mlx_call
    kernel.disable()
    assert kernel.linear_routing() == "off"
    kernel.enable(linear=True)
    assert kernel.linear_enabled() and kernel.linear_routing() == "all"
    if table == "LINEAR_MIN_ROWS":
        layer = nn.QuantizedLinear(64, 24, group_size=64, bits=4)
        layer.set_dtype(mx.bfloat16)
        mx.eval(layer(mx.zeros((1, 64), mx.bfloat16)), layer(mx.zeros((2, 64), mx.bfloat16)))
        assert kernel.calls()["linear"] == 1  # the 2-row call only


def test_batch_routing_covers_batched_decode_steps_alone(monkeypatch):
    """With limits from 2 rows (CUDA's, set on the CPU), enable()'s default routes the linear
    layers inside mlx-lm's batched decode steps only: batch_generate's tokens equal mlx-lm's own
    (float32) with routed calls counted; a single request's decode and the layers outside a step
    keep MLX's matmuls; enabled() restores the routing it found; a bad `linear` changes nothing."""
    from mlx_lm.generate import GenerationBatch, batch_generate
    from test_mlx_lm_batch import Tokenizer, prompts

    monkeypatch.setitem(guard.LINEAR_MIN_ROWS, "cpu", 2)
    model = tiny("qwen3", "float32")
    batch = prompts([5, 17, 3, 40, 9])
    options = dict(max_tokens=[8, 5, 9, 6, 7], return_token_ids=True, completion_batch_size=3)
    theirs = batch_generate(model, Tokenizer(), batch, **options).token_ids
    mlx_calls, step = (nn.Linear.__call__, nn.QuantizedLinear.__call__), GenerationBatch.next
    with kernel.enabled(fused_step=False):
        assert kernel.linear_routing() == "batches" and GenerationBatch.next is not step
        ours = batch_generate(model, Tokenizer(), batch, **options).token_ids
        routed = kernel.calls()["linear"]
        greedy(model, prompt_ids(12), 4)  # one row: no routed call
        assert kernel.calls()["linear"] == routed > 0
        assert not kernel.linear_enabled() and nn.Linear.__call__ is mlx_calls[0]
        with kernel.enabled(linear=True):
            assert kernel.linear_routing() == "all"
        assert kernel.linear_routing() == "batches"
    assert ours == theirs
    assert GenerationBatch.next is step and kernel.linear_routing() == "off"
    assert (nn.Linear.__call__, nn.QuantizedLinear.__call__) == mlx_calls
    with pytest.raises(ValueError, match="linear must be"):
        kernel.enable(linear="sometimes")
    assert not kernel.is_enabled()


def test_what_the_guard_leaves_keeps_mlx_matmuls(monkeypatch):
    """Rows past the guard's limit, a format it has no record for (f16 codes), a subclass of
    nn.Linear (its forward may differ), a non-affine quantization and a GPU backend's limits."""
    x = mx.random.normal((1, 64)).astype(mx.bfloat16)
    calls = []
    original = attn_kernels.linear.decode_linear
    monkeypatch.setattr(
        attn_kernels.linear, "decode_linear", lambda *a, **k: calls.append(1) or original(*a, **k)
    )

    class Scaled(nn.Linear):
        pass

    dense = nn.Linear(64, 24, bias=True)
    dense.set_dtype(mx.bfloat16)
    with kernel.enabled():
        rows = guard.LINEAR_LIMITS["cpu"][0]
        mx.eval(dense(mx.zeros((rows, 64), mx.bfloat16)), dense(x))
        assert kernel.calls()["linear"] == 2 and len(calls) == 2
        mx.eval(dense(mx.zeros((rows + 1, 64), mx.bfloat16)))  # too many rows
        mx.eval(dense(x.astype(mx.float32)))  # x and the weights differ in dtype
        scaled = Scaled(64, 24)
        scaled.set_dtype(mx.bfloat16)
        mx.eval(scaled(x))
        half = nn.QuantizedLinear(64, 24, group_size=64, bits=4)
        half.set_dtype(mx.float16)
        mx.eval(half(x.astype(mx.float16)))  # f16 codes: no record
        fp = nn.QuantizedLinear(64, 24, group_size=32, bits=4, mode="mxfp4")
        mx.eval(fp(x))
        monkeypatch.setitem(guard.LINEAR_LIMITS, "cpu", guard.LINEAR_LIMITS["metal"])
        mx.eval(dense(x))
        assert kernel.calls()["linear"] == 2 and len(calls) == 2


def test_rows_the_backend_leaves_skip_the_guard_s_question(monkeypatch):
    """With limits of 2-4 rows (CUDA's shape, set here on the CPU), a wrapped layer's call of 1 or
    5 rows goes to MLX's matmul without the full question (the layer's arrays, the formats); 2
    and 4 rows ask it and run decode_linear, MLX's result within the int8 rounding of x (x86's
    4-bit path)."""
    monkeypatch.setitem(guard.LINEAR_MIN_ROWS, "cpu", 2)
    monkeypatch.setitem(guard.LINEAR_LIMITS, "cpu", (4, guard.LINEAR_LIMITS["cpu"][1]))
    asked, use = [], guard.use_linear
    monkeypatch.setattr(guard, "use_linear", lambda *a, **k: asked.append(a[0]) or use(*a, **k))
    layer = nn.QuantizedLinear(64, 24, group_size=32, bits=4)
    layer.set_dtype(mx.bfloat16)
    with kernel.enabled(linear=True):  # by default not installed where limits start at 2 rows
        for rows in (1, 2, 4, 5):
            x = mx.random.normal((rows, 1, 64), key=mx.random.key(rows)).astype(mx.bfloat16)
            got = layer(x).astype(mx.float32)
            expected = nn.QuantizedLinear.__call__.__wrapped__(layer, x).astype(mx.float32)
            assert mx.allclose(got, expected, rtol=2**-6, atol=2**-5).item()
        assert asked == [2, 4] and kernel.calls()["linear"] == 2


def test_routed_layer_equals_mlx_on_odd_widths():
    """A routed bf16 layer with a bias on widths that are not multiples of the vector width: the
    float64 result of the same rounded inputs within bf16 rounding (what nn.Linear computes)."""
    import numpy as np

    layer = nn.Linear(100, 37, bias=True)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((3, 1, 100), key=mx.random.key(4)).astype(mx.bfloat16)
    with kernel.enabled():
        got = layer(x)
        assert kernel.calls()["linear"] == 1
    f64 = [np.array(a.astype(mx.float32), dtype=np.float64) for a in (x, layer.weight, layer.bias)]
    expected = f64[0] @ f64[1].T + f64[2]
    err = np.abs(np.array(got.astype(mx.float32)) - expected)
    assert (err <= 2**-7 * np.abs(expected) + 1e-4).all()
