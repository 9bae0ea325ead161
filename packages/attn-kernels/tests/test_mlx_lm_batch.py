"""attn_kernels.mlx_lm.enable() under mlx-lm's continuous batching (BatchGenerator, which
batch_generate and mlx_lm.server run): every batched decode step of llama, qwen2 and qwen3 runs as
one attention_step over mlx-lm's BatchKVCache (each row from its own left padding, at its own RoPE
position), while requests join and leave; each request's greedy tokens are mlx-lm's own."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import attn_kernels.mlx_lm as kernel
from attn_kernels import attention_step_cache_copies
from attn_kernels.mlx_lm import step
from mlx_lm.generate import BatchGenerator, batch_generate
from test_mlx_lm import VOCAB, any_head_dim_and_dtype, mlx_matmuls, tiny_model  # noqa: F401
from test_mlx_lm_step import arch_model

pytestmark = pytest.mark.usefixtures("any_head_dim_and_dtype", "mlx_matmuls")


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    kernel.disable()


class Tokenizer:
    """What batch_generate asks of a tokenizer: no end-of-sequence ids, ids as text."""

    eos_token_ids: list[int] = []  # noqa: RUF012

    def decode(self, ids):
        return " ".join(map(str, ids))


def prompts(lengths, seed=0):
    return [
        mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed * 1000 + n)).tolist()
        for n in lengths
    ]


@pytest.fixture
def batched_steps(monkeypatch):
    """(batch size, write index) of every attention_step the fused batch path ran."""
    seen = []
    op = step.attention_step

    def spy(q, k, v, qw, kw, k_cache, v_cache, offset, **options):
        if options.get("starts") is not None:
            seen.append((q.shape[0], offset))
        return op(q, k, v, qw, kw, k_cache, v_cache, offset, **options)

    monkeypatch.setattr(step, "attention_step", spy)
    return seen


def both(model, run):
    """run() without the kernel, then with enable(); the second's calls."""
    theirs = run()
    with kernel.enabled():
        ours = run()
        calls = kernel.calls()
    return theirs, ours, calls


# (arch, config changes): D 128 with q/k norm (Qwen3), D 64 (Llama), D 80 with q/k/v biases
# (Qwen2).
ARCH_CASES = {"qwen3": ("qwen3", {}), "llama": ("llama", {}), "qwen2": ("qwen2", {})}


@pytest.mark.parametrize("case", ARCH_CASES)
def test_batch_generate_tokens_match_mlx_lm(case, batched_steps):
    """Seven requests of 3 to 40 prompt tokens and 6 to 15 new ones through three slots (two
    prefilled at a time): requests join as others finish; every decode step fused."""
    arch, changes = ARCH_CASES[case]
    model = arch_model(arch, **changes)
    options = dict(
        max_tokens=[12, 7, 15, 9, 11, 6, 13],
        return_token_ids=True,
        completion_batch_size=3,
        prefill_batch_size=2,
    )
    batch = prompts([5, 17, 3, 40, 9, 12, 26])
    theirs, ours, calls = both(
        model, lambda: batch_generate(model, Tokenizer(), batch, **options).token_ids
    )
    assert ours == theirs
    assert [len(t) for t in ours] == options["max_tokens"]
    assert len({t for tokens in ours for t in tokens}) > 20  # attention moves the tokens
    layers = len(model.layers)
    assert calls["fused_step"] == len(batched_steps) > 0
    assert calls["fused_step"] % layers == 0
    assert {b for b, _ in batched_steps} >= {2, 3}  # rows join and leave the batch
    assert calls["mlx_lm"] == 0 or calls["fused"] == 0  # prefill alone took mlx-lm's path


def test_requests_join_and_leave_a_running_batch():
    """BatchGenerator driven as mlx_lm.server drives it: requests inserted while others decode,
    one removed mid-way; each request's tokens as without the kernel."""
    model = tiny_model("qwen3")

    def run():
        gen = BatchGenerator(model, max_tokens=10, completion_batch_size=4, prefill_batch_size=2)
        tokens = {}
        uids = gen.insert(prompts([6, 21, 4]), max_tokens=[10, 8, 12])
        for uid in uids:
            tokens[uid] = []
        for i in range(30):
            if i == 3:
                for uid in gen.insert(prompts([13, 2], seed=1), max_tokens=[9, 11]):
                    tokens[uid] = []
            if i == 6:
                gen.remove([uids[1]])
            responses = gen.next_generated()
            if not responses and i > 6:
                break
            for r in responses:
                tokens[r.uid].append(r.token)
        gen.close()
        return tokens

    theirs, ours, calls = both(model, run)
    assert ours == theirs
    assert calls["fused_step"] > 0
    assert len(ours[1]) < 8  # removed before it finished


@pytest.mark.parametrize("max_kv_size", [64, 12], ids=["no-wrap", "wraps"])
def test_rotating_batch_cache_until_it_wraps(max_kv_size, batched_steps):
    """max_kv_size gives each request a RotatingKVCache, merged into mlx-lm's
    BatchRotatingKVCache: decode steps are fused until the cache wraps (a 12-position cache from
    a 9-token prompt: four steps), mlx-lm's method after; tokens as mlx-lm's either way. The
    three prompts are prefilled together (mlx-lm's attention, once per layer); ten tokens take
    eleven decode steps (the generator computes one step ahead)."""
    model = tiny_model("qwen3")
    batch = prompts([9, 5, 7])
    options = dict(max_tokens=10, return_token_ids=True, max_kv_size=max_kv_size)
    theirs, ours, calls = both(
        model, lambda: batch_generate(model, Tokenizer(), batch, **options).token_ids
    )
    assert ours == theirs
    layers = len(model.layers)
    assert calls["fused_step"] == len(batched_steps)
    if max_kv_size == 64:
        assert calls == dict(
            fused=0, fused_quantized=0, fused_step=11 * layers, mlx_lm=layers, linear=0
        )
    else:
        assert calls["fused_step"] == 4 * layers
        assert calls["mlx_lm"] == layers + 7 * layers


def test_decode_steps_update_the_batch_cache_in_place():
    """The op copies no cache, even where mlx-lm re-lays the batch cache out: three rows with
    left paddings 17, 12 and 0 finish at different steps, the unpadded one first, so
    BatchKVCache.filter drops rows and shifts the rest left (views of its gathered buffers); the
    fused step writes MLX's contiguous copies of them in place (step.own_layout). Tokens as
    mlx-lm's."""
    model = tiny_model("qwen3")
    batch = prompts([3, 8, 20])
    options = dict(max_tokens=[40, 25, 6], return_token_ids=True, completion_batch_size=3)
    before = attention_step_cache_copies()
    theirs, ours, calls = both(
        model, lambda: batch_generate(model, Tokenizer(), batch, **options).token_ids
    )
    assert ours == theirs
    assert calls["fused_step"] >= 39 * len(model.layers)
    assert attention_step_cache_copies() == before


def test_quantized_layers_fold_a_decode_steps_rows():
    """enable() runs mlx.nn's quantized layers on (B, 1, K) as (1, B, K) (MLX's CUDA quantized
    matmul takes each batch item as a GEMM of its own): the same numbers, the methods back after
    disable()."""
    import mlx.nn as nn

    layer = nn.QuantizedLinear(256, 96, bias=True, group_size=64, bits=4)
    embedding = nn.QuantizedEmbedding(96, 256, group_size=64, bits=4)
    x = mx.random.normal((5, 1, 256))
    expected = (layer(x), embedding.as_linear(x))
    originals = (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear)
    with kernel.enabled():
        assert nn.QuantizedLinear.__call__ is not originals[0]
        got = (layer(x), embedding.as_linear(x), layer(x[:1]), layer(x[:, 0]))
    assert (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear) == originals
    for a, b in zip(got[:2], expected, strict=True):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
    assert mx.allclose(got[2], expected[0][:1], atol=1e-5).item()  # one row: as it is
    assert mx.allclose(got[3], expected[0][:, 0], atol=1e-5).item()  # 2-D: as it is


def test_batch_generate_with_a_quantized_model():
    """A 4-bit model (its decode steps' rows folded in the quantized layers, attention fused):
    every request's tokens as without the kernel."""
    import mlx.nn as nn

    model = tiny_model("qwen3")
    nn.quantize(model, group_size=64, bits=4)
    batch = prompts([6, 19, 3, 11], seed=5)
    options = dict(max_tokens=9, return_token_ids=True, completion_batch_size=3)
    theirs, ours, calls = both(
        model, lambda: batch_generate(model, Tokenizer(), batch, **options).token_ids
    )
    assert ours == theirs
    assert calls["fused_step"] > 0
