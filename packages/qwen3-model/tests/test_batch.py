"""Batched generation (qwen3_model.batch): batch_generate and BatchGenerator against each prompt
generated alone (generate_step), greedy, float32; requests joining and leaving, stop tokens,
per-request samplers and max_tokens, the fused step with per-row offsets and the unfused batch
path, and bad inputs."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from qwen3_model import BatchGenerator, batch_generate, generate_step, load
from qwen3_model import model as model_module
from test_generate import word_tokenizer
from test_model import widen_guard


def lively(checkpoint="decode-attention", seed=1):
    """The tiny model with its matrices scaled up, so that attention moves the greedy tokens
    (at load's scale most prompts repeat one token)."""
    model = load("qwen3-tiny", dtype=mx.float32, checkpoint=checkpoint, seed=seed)
    model.load_weights(
        [(k, v * 3.0 if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    )
    model.fuse_projections()
    return model


def prompts(lengths, seed=0):
    return [
        mx.random.randint(10, 990, (n,), key=mx.random.key(seed * 100 + n)).tolist()
        for n in lengths
    ]


def alone(model, prompt, max_tokens):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


@pytest.fixture
def row_steps(monkeypatch):
    """(batch rows, per-row offsets) of every attention_step the model ran on a batch cache. The
    generator passes them as an array it advances on the device, with their largest as
    max_offset (read back here, which the generator never does)."""
    seen = []
    op = model_module.attention_step

    def spy(*args, **kwargs):
        if isinstance(args[7], mx.array):
            offsets = args[7].tolist()
            assert kwargs["max_offset"] == max(offsets)
            seen.append((args[0].shape[0], offsets))
        return op(*args, **kwargs)

    monkeypatch.setattr(model_module, "attention_step", spy)
    return seen


LENGTHS = [5, 17, 1, 40, 9, 12, 26]
MAX_TOKENS = [12, 7, 15, 9, 11, 6, 13]


@pytest.mark.parametrize("checkpoint", ["decode-attention", "composition"])
def test_each_prompt_gets_its_tokens_alone(checkpoint, monkeypatch, row_steps):
    """Seven prompts (1 to 40 tokens) through three rows: each prompt's greedy tokens are what
    generate_step gives it alone; with decode-attention every decode step is one fused step per
    layer with each row at its own offset."""
    widen_guard(monkeypatch)
    model = lively(checkpoint)
    batch = prompts(LENGTHS)
    result = batch_generate(model, batch, max_tokens=MAX_TOKENS, slots=3)
    assert result.token_ids == [alone(model, p, m) for p, m in zip(batch, MAX_TOKENS, strict=True)]
    assert result.finish_reasons == ["length"] * len(batch)
    assert len({t for tokens in result.token_ids for t in tokens}) > 30
    if checkpoint == "composition":
        assert row_steps == []
        return
    assert row_steps and all(rows == 3 for rows, _ in row_steps)
    # rows at different offsets in one step (requests joined at different times)
    assert any(len(set(offsets)) == 3 for _, offsets in row_steps)


def test_outside_the_guard_the_unfused_rows(row_steps):
    """The guard's records cover D=128 bf16: the tiny float32 model takes the unfused batch path
    (RoPE at each row's offset, per-row writes, mx.fast over each row's range); same tokens."""
    model = lively()
    batch = prompts(LENGTHS[:4], seed=1)
    result = batch_generate(model, batch, max_tokens=8, slots=2)
    assert result.token_ids == [alone(model, p, 8) for p in batch]
    assert row_steps == []


def test_stop_tokens_samplers_and_text(monkeypatch):
    """A stop token ends its request (left out, as mlx-lm does), a request's own sampler picks its
    tokens, and a tokenizer gives the texts; the other requests are unaffected."""
    widen_guard(monkeypatch)
    model = lively()
    batch = prompts([6, 11, 8], seed=2)
    expected = [alone(model, p, 10) for p in batch]
    stop = expected[0][4]
    first_stop = expected[0].index(stop)
    fixed = lambda logprobs: mx.full(logprobs.shape[:-1], 7, mx.uint32)  # noqa: E731
    tokenizer = word_tokenizer(model.args.vocab_size)
    gen = BatchGenerator(model, slots=3, max_tokens=10)
    uids = gen.insert(batch, samplers=[None, None, fixed], stop_tokens=[[stop], None, None])
    tokens, reasons = {u: [] for u in uids}, {}
    while responses := gen.next():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason:
                reasons[r.uid] = r.finish_reason
    assert tokens[uids[0]] == expected[0][: first_stop + 1] and reasons[uids[0]] == "stop"
    assert tokens[uids[1]] == expected[1] and reasons[uids[1]] == "length"
    assert tokens[uids[2]] == [7] * 10
    result = batch_generate(model, batch[1:], max_tokens=10, tokenizer=tokenizer)
    assert result.texts == [tokenizer.decode(t) for t in expected[1:]]


def test_requests_join_and_leave_a_running_generator(monkeypatch):
    """Requests inserted while others decode and one removed mid-way, as a server feeds it: every
    other request's tokens as generated alone; freed rows are reused."""
    widen_guard(monkeypatch)
    model = lively()
    first, later = prompts([7, 19, 4], seed=3), prompts([13, 2], seed=4)
    gen = BatchGenerator(model, slots=3, max_tokens=9)
    uids = gen.insert(first)
    tokens = {u: [] for u in uids}
    for i in range(40):
        if i == 2:
            for u in gen.insert(later):
                tokens[u] = []
        if i == 4:
            gen.remove([uids[1]])
        responses = gen.next()
        if not responses:
            break
        for r in responses:
            tokens[r.uid].append(r.token)
    expected = [alone(model, p, 9) for p in first + later]
    for uid, want in zip(tokens, expected, strict=True):
        if uid == uids[1]:
            assert tokens[uid] == want[: len(tokens[uid])] and len(tokens[uid]) < 9
        else:
            assert tokens[uid] == want, uid
    assert gen.active == 0 and gen.pending == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda g: g.insert([[]]), "prompt 0 is empty"),
        (
            lambda g: g.insert([[1], [2]], max_tokens=[3]),
            r"max_tokens must have one entry per prompt \(2\)",
        ),
        (lambda g: g.insert([[1]], max_tokens=0), "max_tokens must be >= 1"),
    ],
)
def test_bad_requests(call, message):
    gen = BatchGenerator(lively(), slots=2)
    with pytest.raises(ValueError, match=message):
        call(gen)


def test_bad_generator_settings():
    model = lively()
    with pytest.raises(ValueError, match="slots must be >= 1"):
        BatchGenerator(model, slots=0)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        batch_generate(model, [[1, 2]], max_tokens=2, slots=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        BatchGenerator(model, max_tokens=0)
