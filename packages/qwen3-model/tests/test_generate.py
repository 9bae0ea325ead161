"""generate_step (pipelined) against an unpipelined loop and mlx-lm's generate_step,
stream_generate/generate with a checkpoint's tokenizer, sampling, and the CLI's errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from qwen3_model import (
    CHECKPOINTS,
    CONFIGS,
    Tokenizer,
    generate,
    generate_step,
    load,
    make_cache,
    make_sampler,
    save,
    stream_generate,
)
from qwen3_model.generate import apply_top_p, main
from test_model import mlx_lm_twin


def unpipelined(model, prompt, steps):
    """The readable loop: one forward and one synchronisation per token, nothing queued ahead."""
    cache = make_cache(model)
    logits = model(prompt[None], cache)[:, -1]
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
        logits = model(token[None], cache)[:, -1]
    return tokens


def word_tokenizer(vocab_size):
    """A word-level tokenizer over w0..w{vocab-1}, as a checkpoint's tokenizer.json would be."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = HFTokenizer(WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer


@pytest.fixture
def checkpoint(tmp_path):
    folder = save(load("qwen3-tiny", seed=4), tmp_path / "ckpt")
    word_tokenizer(CONFIGS["qwen3-tiny"].vocab_size).save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("checkpoint_name", CHECKPOINTS)
@pytest.mark.parametrize("prompt_len", [1, 2, 13, 37])
def test_pipelined_equals_unpipelined(checkpoint_name, prompt_len):
    model = load("qwen3-tiny", dtype=mx.float32, checkpoint=checkpoint_name, seed=1)
    prompt = mx.random.randint(10, 990, (prompt_len,), key=mx.random.key(prompt_len))
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=19)]
    assert ours == unpipelined(model, prompt, 19)


def test_prefill_in_chunks_equals_one_chunk():
    model = load("qwen3-tiny", dtype=mx.float32, seed=2)
    prompt = mx.random.randint(10, 990, (41,), key=mx.random.key(0))
    whole = [t for t, _ in generate_step(prompt, model, max_tokens=9)]
    chunked = [t for t, _ in generate_step(prompt, model, max_tokens=9, prefill_step_size=8)]
    assert chunked == whole


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "4bit"])
def test_same_tokens_as_mlx_lm_generate_step(variant):
    dtype = mx.float32 if variant == "float32" else mx.bfloat16
    quantize = "4bit" if variant == "4bit" else None
    model = load("qwen3-tiny", dtype=dtype, quantize=quantize, seed=3)
    ref = mlx_lm_twin(model)
    prompt = mx.random.randint(10, 990, (29,), key=mx.random.key(5))
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=24)]
    theirs = [
        t
        for t, _ in mlx_lm_generate_step(
            prompt, ref, max_tokens=24, prompt_cache=make_prompt_cache(ref)
        )
    ]
    assert ours == theirs


def test_logprobs_are_normalised_and_match_the_token():
    model = load("qwen3-tiny", dtype=mx.float32, seed=1)
    prompt = mx.array([5, 6, 7])
    for token, logprobs in generate_step(prompt, model, max_tokens=4):
        assert logprobs.shape == (CONFIGS["qwen3-tiny"].vocab_size,)
        assert abs(mx.logsumexp(logprobs).item()) < 1e-5
        assert mx.argmax(logprobs).item() == token


def test_stream_generate_text_tokens_and_speeds():
    model = load("qwen3-tiny", dtype=mx.float32, seed=4)
    tokenizer = word_tokenizer(model.args.vocab_size)
    prompt = "w5 w6 w7 w123"
    expected = [t for t, _ in generate_step(mx.array([5, 6, 7, 123]), model, max_tokens=6)]
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=6))
    assert [r.token for r in responses] == expected
    assert "".join(r.text for r in responses) == tokenizer.decode(expected)
    assert [r.generation_tokens for r in responses] == [1, 2, 3, 4, 5, 6]
    assert [r.finish_reason for r in responses] == [None] * 5 + ["length"]
    assert all(r.prompt_tokens == 4 for r in responses)
    assert responses[0].generation_tps == 0.0 and responses[-1].generation_tps > 0
    assert generate(model, tokenizer, prompt, max_tokens=6) == tokenizer.decode(expected)


def test_stream_generate_stops_at_an_end_token():
    model = load("qwen3-tiny", dtype=mx.float32, seed=4)
    expected = [t for t, _ in generate_step(mx.array([5, 6, 7]), model, max_tokens=8)]
    stop = expected[3]
    first = expected.index(stop)  # the stop token may already come earlier
    tokenizer = Tokenizer(word_tokenizer(model.args.vocab_size), eos_token_ids=[stop])
    responses = list(stream_generate(model, tokenizer, [5, 6, 7], max_tokens=8))
    assert len(responses) == first + 1
    assert responses[-1].finish_reason == "stop" and responses[-1].token == stop
    assert "".join(r.text for r in responses) == tokenizer.decode(expected[:first])


def test_greedy_and_zero_temperature():
    logprobs = mx.log(mx.softmax(mx.random.normal((3, 50), key=mx.random.key(1)), axis=-1))
    best = mx.argmax(logprobs, axis=-1)
    assert mx.array_equal(make_sampler(0.0)(logprobs), best).item()
    # A nucleus smaller than the top token's probability keeps only the top token.
    assert mx.array_equal(make_sampler(1.0, top_p=1e-6)(logprobs), best).item()


def test_top_p_keeps_the_nucleus():
    """Against numpy: the smallest set of most likely tokens whose mass reaches top_p."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 37)).astype(np.float32) * 2
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for top_p in (0.1, 0.5, 0.9, 0.999):
        kept = np.isfinite(np.array(apply_top_p(mx.array(logprobs), top_p)))
        for row, mask in zip(logprobs, kept, strict=True):
            order = np.argsort(-row)
            mass = np.cumsum(np.exp(row[order]))
            count = int(np.searchsorted(mass, top_p * mass[-1]) + 1)
            assert set(np.flatnonzero(mask)) == set(order[:count])


def test_sampling_frequencies_match_tempered_nucleus():
    """20000 draws at temp 0.7, top-p 0.8 against the renormalised tempered nucleus (numpy)."""
    logits = np.array([2.0, 1.5, 1.0, 0.3, -0.5, -1.0, -3.0], dtype=np.float32)
    logprobs = logits - np.log(np.exp(logits).sum())
    order = np.argsort(-logprobs)
    mass = np.cumsum(np.exp(logprobs[order]))
    nucleus = order[: int(np.searchsorted(mass, 0.8) + 1)]
    weights = np.zeros_like(logprobs)
    weights[nucleus] = np.exp(logprobs[nucleus] / 0.7)
    expected = weights / weights.sum()
    mx.random.seed(11)
    draws = make_sampler(0.7, 0.8)(mx.broadcast_to(mx.array(logprobs), (20000, len(logits))))
    observed = np.bincount(np.array(draws), minlength=len(logits)) / 20000
    assert np.abs(observed - expected).max() < 0.015
    assert observed[expected == 0].sum() == 0


def test_seed_repeats_sampled_text():
    model = load("qwen3-tiny", dtype=mx.float32, seed=4)
    prompt = mx.array([5, 6, 7])

    def sampled(seed):
        mx.random.seed(seed)
        steps = generate_step(prompt, model, max_tokens=12, sampler=make_sampler(1.5))
        return [t for t, _ in steps]

    assert sampled(3) == sampled(3)
    # Another seed draws another sequence (12 draws at temp 1.5 over 1000 tokens: a repeat would
    # mean the seed is ignored).
    assert sampled(4) != sampled(3)


def test_bad_sampler_and_step_arguments():
    with pytest.raises(ValueError, match="temp"):
        make_sampler(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        make_sampler(1.0, top_p=0.0)
    model = load("qwen3-tiny")
    with pytest.raises(ValueError, match="1-D"):
        next(generate_step(mx.array([[1, 2]]), model))
    with pytest.raises(ValueError, match="max_tokens"):
        next(generate_step(mx.array([1, 2]), model, max_tokens=0))


def test_cli_streams_text_and_reports_speeds(checkpoint, capsys):
    main(["--weights", str(checkpoint), "--prompt", "w5 w6 w7", "--max-tokens", "4"])
    out = capsys.readouterr().out.splitlines()
    words = out[1].split()
    assert len(words) == 4 and all(w.startswith("w") for w in words)
    assert out[3].startswith("Prompt: 3 tokens, ")
    assert out[4].startswith("Generation: 4 tokens, ") and out[4].endswith("tokens-per-sec")


def test_cli_sampling_with_a_seed_repeats(checkpoint, capsys):
    argv = ["--weights", str(checkpoint), "-p", "w5 w6", "-m", "6", "--temp", "1.5"]
    main([*argv, "--top-p", "0.9", "--seed", "7"])
    first = capsys.readouterr().out.splitlines()[1]
    main([*argv, "--top-p", "0.9", "--seed", "7"])
    assert capsys.readouterr().out.splitlines()[1] == first


def test_cli_usage_marks_weights_required(capsys):
    with pytest.raises(SystemExit):
        main(["--prompt", "hi"])
    err = capsys.readouterr().err
    assert err.startswith("usage: generate [-h] --weights DIR --prompt TEXT [--max-tokens N]")
    assert "required: --weights" in err and "nothing is downloaded" in err


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err + str(exit_info.value.code)
    assert "Traceback" not in err
    return err


def test_cli_missing_folder_says_so(tmp_path, capsys):
    err = one_line_error(["--weights", str(tmp_path / "nowhere"), "--prompt", "x"], capsys)
    assert "nowhere: no such folder" in err and "tokenizer" not in err
    (tmp_path / "file").write_text("x")
    err = one_line_error(["--weights", str(tmp_path / "file"), "--prompt", "x"], capsys)
    assert "not a folder" in err
    # a built-in config's name is bench's, not a checkpoint: said so
    err = one_line_error(["--weights", "qwen3-tiny", "--prompt", "x"], capsys)
    assert "generate needs a checkpoint folder" in err


def test_cli_empty_prompt(checkpoint, capsys):
    err = one_line_error(["--weights", str(checkpoint), "--prompt", ""], capsys)
    assert "--prompt is empty" in err


def test_cli_missing_tokenizer(tmp_path, capsys):
    folder = save(load("qwen3-tiny"), tmp_path / "ckpt")
    err = one_line_error(["--weights", str(folder), "--prompt", "x"], capsys)
    assert f"{folder} has no tokenizer.json" in err


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("config.json", "{not json", "config.json: not readable JSON"),
        ("config.json", "[1, 2]", "config.json: expected a JSON object"),
        ("config.json", json.dumps({"hidden_size": 8}), "config.json: config.json lacks"),
        ("model.safetensors", "garbage", "model.safetensors: not a readable safetensors"),
        ("tokenizer.json", "{not json", "tokenizer.json: not a readable tokenizer"),
    ],
)
def test_cli_corrupt_file_is_one_line_naming_it(checkpoint, capsys, file, content, message):
    (checkpoint / file).write_text(content)
    err = one_line_error(["--weights", str(checkpoint), "--prompt", "w1"], capsys)
    assert message in err
    assert str(checkpoint / file) in err
    assert len(err.strip().splitlines()) == 1


def test_cli_truncated_safetensors(checkpoint, capsys):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = one_line_error(["--weights", str(checkpoint), "--prompt", "w1"], capsys)
    assert f"{checkpoint / 'model.safetensors'}: not a readable safetensors" in err


def test_cli_config_with_a_bad_value(checkpoint, capsys):
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_attention_heads"] = "four"
    (checkpoint / "config.json").write_text(json.dumps(config))
    err = one_line_error(["--weights", str(checkpoint), "--prompt", "w1"], capsys)
    assert "config.json: num_attention_heads must be a positive integer" in err


def test_load_progress_reports_every_layer():
    seen = []
    model = load("qwen3-tiny", progress=lambda done, total: seen.append((done, total)))
    layers = model.args.num_hidden_layers
    assert seen == [(i, layers + 1) for i in range(1, layers + 2)]
    assert len(tree_flatten(model.parameters())) > 0


def test_folders_may_start_with_home(checkpoint, monkeypatch):
    monkeypatch.setenv("HOME", str(checkpoint.parent))
    assert load(f"~/{checkpoint.name}").args == CONFIGS["qwen3-tiny"]
    assert Tokenizer.from_folder(f"~/{checkpoint.name}").encode("w3 w4") == [3, 4]


def test_cli_prompt_from_stdin(checkpoint, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w6 w7"))
    main(["--weights", str(checkpoint), "--prompt", "-", "--max-tokens", "2"])
    assert capsys.readouterr().out.splitlines()[3].startswith("Prompt: 3 tokens, ")
