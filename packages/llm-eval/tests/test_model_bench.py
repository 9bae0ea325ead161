import importlib
import io
import json
import statistics

import mlx.core as mx
import pytest
import qwen3_model
from llm_eval import ab_decode, bench, plot, progression
from llm_eval.progress import Progress
from llm_eval.record import validate
from mlx.utils import tree_flatten

TINY = ["--device", "cpu", "--model", "qwen3-tiny", "--bandwidth-gbs", "10"]


def tiny_bench(tmp_path, *flags):
    args = bench.parse_args([*TINY, "--output", str(tmp_path / "b.json"), *flags])
    return args, bench.run(args, Progress(stream=io.StringIO()))


def test_bench_three_models_rotated_every_sample_kept(tmp_path):
    _, record = tiny_bench(tmp_path, "--input-len", "7", "--output-len", "5", "--rounds", "3")
    validate(record)
    assert record["kind"] == "model-bench"
    orders = [tuple(e["order"]) for e in record["execution_order"]]
    assert len(set(orders)) == 3 and {o[0] for o in orders} == set(bench.VARIANTS)
    samples, medians = record["results"]["samples"], record["results"]["medians"]
    assert set(samples) == set(bench.VARIANTS)
    for variant, rows in samples.items():
        assert [r["round"] for r in rows] == [0, 1, 2]
        for r in rows:
            assert r["input_len"] == 7 and r["output_len"] == 5 and len(r["step_s"]) == 4
            assert r["decode_tok_s"] == pytest.approx(4 / r["decode_s"])
            assert r["decode_s"] == pytest.approx(sum(r["step_s"]))
        m = medians[variant]
        assert m["decode_tok_s"] == pytest.approx(
            statistics.median(r["decode_tok_s"] for r in rows)
        )
        assert m["decode_tok_s_min"] == min(r["decode_tok_s"] for r in rows)
        assert m["vs_mlx_lm"] == pytest.approx(
            m["decode_tok_s"] / medians["mlx-lm"]["decode_tok_s"]
        )
    assert medians["mlx-lm"]["rounds_at_or_above_mlx_lm"] == 3
    # The same weights and greedy decoding: every model, every round, the same tokens.
    assert len({tuple(r["tokens"]) for rows in samples.values() for r in rows}) == 1


def test_bench_reads_and_floor_by_hand(tmp_path):
    _, record = tiny_bench(tmp_path, "--input-len", "9", "--output-len", "4", "--rounds", "1")
    a = qwen3_model.CONFIGS["qwen3-tiny"]
    model = qwen3_model.load("qwen3-tiny")
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    kv_per_position = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2  # bf16
    assert record["results"]["weight_bytes"] == weights
    assert record["results"]["kv_bytes_per_position"] == kv_per_position
    for rows in record["results"]["samples"].values():
        r = rows[0]
        read = 3 * weights + (10 + 11 + 12) * kv_per_position  # steps see S = 10, 11, 12
        assert r["read_gbs"] == pytest.approx(read / r["decode_s"] / 1e9)
        assert r["floor_fraction"] == pytest.approx(r["read_gbs"] / 10)


def test_bench_same_tokens_as_mlx_lm_greedy(tmp_path):
    """Cross-check against an unpipelined greedy loop on mlx-lm's model (independent of ours)."""
    from mlx_lm.models.cache import make_prompt_cache

    _, record = tiny_bench(tmp_path, "--input-len", "6", "--output-len", "6", "--rounds", "1")
    model = qwen3_model.load("qwen3-tiny")
    twin = bench.mlx_lm_twin(model)
    prompt = bench.prompt_ids(model.args.vocab_size, 6, mx.random.key(0))
    cache = make_prompt_cache(twin)
    logits = twin(prompt[None], cache=cache)[:, -1]
    tokens = []
    for _ in range(6):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
        logits = twin(token[None], cache=cache)[:, -1]
    assert record["results"]["samples"]["decode-attention"][0]["tokens"] == tokens


def test_bench_main_prints_the_story_and_writes_a_record(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmark_results").mkdir()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # the nearest benchmark_results/ above is used
    flags = [*TINY, "--input-len", "5", "--output-len", "3", "--rounds", "2"]
    bench.main(flags)
    out = capsys.readouterr()
    printed = " ".join(out.out.split())  # the report wraps long lines
    assert "random (seed 0), in the shape of the published qwen3-tiny config" in printed
    assert "bf16 (no quantisation)" in out.out
    for name in ("| decode-attention |", "| composition |", "| mlx-lm (its generate_step) |"):
        assert name in out.out
    assert "vs mlx-lm" in out.out and "of read floor" in out.out
    assert "loading qwen3-tiny" in out.err and "warm-up" in out.err and "round 2/2" in out.err
    assert "\r" not in out.err  # piped: plain lines
    records = sorted((tmp_path / "benchmark_results").glob("*.json"))
    assert [p.name for p in records] == [
        f"cpu-{__import__('os').cpu_count()}core-qwen3-tiny-bf16-bench-5+3-mlx-{mx.__version__}.json"
    ]
    validate(json.loads(records[0].read_text()))
    bench.main(flags)  # a second run never replaces the first
    names = sorted(p.name for p in (tmp_path / "benchmark_results").glob("*.json"))
    assert names == sorted([records[0].name, records[0].name.replace(".json", "-2.json")])
    assert str(tmp_path / "benchmark_results") in capsys.readouterr().out


def test_bench_4bit_is_named(tmp_path, capsys):
    bench.main(
        [
            *TINY,
            "--quantize",
            "4bit",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--rounds",
            "1",
            "--variant",
            "decode-attention",
            "--output",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "4-bit, group 128" in out and "vs mlx-lm" not in out
    assert len(list(tmp_path.glob("*-4bit-bench-4+2-*.json"))) == 1


def test_bench_output_refuses_to_overwrite(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text("{}")
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--output", str(path)])
    assert "exists; pass --overwrite" in capsys.readouterr().err
    bench.main(
        [
            *TINY,
            "--output",
            str(path),
            "--overwrite",
            "--input-len",
            "3",
            "--output-len",
            "2",
            "--rounds",
            "1",
            "--variant",
            "composition",
        ]
    )
    validate(json.loads(path.read_text()))


def test_bench_weights_folder_and_broken_files(tmp_path, capsys):
    folder = qwen3_model.save(qwen3_model.load("qwen3-tiny", seed=1), tmp_path / "ckpt")
    flags = [
        "--device",
        "cpu",
        "--weights",
        str(folder),
        "--input-len",
        "3",
        "--output-len",
        "2",
        "--rounds",
        "1",
        "--no-record",
        "--bandwidth-gbs",
        "10",
    ]
    bench.main(flags)
    printed = " ".join(capsys.readouterr().out.split())  # the report wraps long lines
    assert f"{folder} (config.json + 1 safetensors file(s))" in printed
    (folder / "config.json").write_text("{oops")
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    assert "config.json: not readable JSON" in str(e.value.code)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--weights", str(tmp_path / "none")])
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--output-len", "1"], "decode needs a second token"),
        (["--model", "qwen3-99b"], "unknown 'qwen3-99b'"),
        (["--model", "qwen3-tiny", "--weights", "x"], "not both"),
        (["--input-len", "0"], "--input-len must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--variant", "mlx"], "invalid choice"),
        (["--bandwidth-gbs", "-5"], "--bandwidth-gbs: must be > 0, got -5"),
    ],
)
def test_bench_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "parse, flags, message",
    [
        (ab_decode.parse_args, ["--model", "qwen3-tin"], "--model: unknown 'qwen3-tin'"),
        (ab_decode.parse_args, ["--model", "qwen3-tiny", "--weights", "x"], "not both"),
        (ab_decode.parse_args, ["--output-len", "1"], "--output-len must be >= 2"),
        (
            progression.parse_args,
            ["--model", "qwen3-tin", "--input-len", "8", "--output-len", "5"],
            "--model: invalid choice: 'qwen3-tin'",
        ),
        (
            progression.parse_args,
            ["--input-len", "-8", "--output-len", "5"],
            "--input-len: must be >= 1, got -8",
        ),
    ],
)
def test_ab_decode_and_progression_check_before_running(parse, flags, message, capsys):
    """Refused when parsed, in one line, not by a traceback from the runs they start."""
    with pytest.raises(SystemExit):
        parse(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_plot_names_what_it_cannot_chart(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "none.json")])
    assert "no such file" in capsys.readouterr().err
    text = tmp_path / "notes.md"
    text.write_text("# not a record")
    with pytest.raises(SystemExit) as e:
        plot.main([str(text)])
    assert "no chart written" in str(e.value.code)
    assert f"skipped {text}: not a JSON record" in capsys.readouterr().out


def test_progress_plain_when_piped_live_on_a_terminal():
    piped = io.StringIO()
    p = Progress(2, stream=piped)
    p.update("transient")
    p.say("loading")
    p.step("a")
    p.step("b")
    lines = piped.getvalue().splitlines()
    assert lines[0] == "loading" and "1/2 a" in lines[1] and "2/2 b" in lines[2]
    assert "transient" not in piped.getvalue() and "\r" not in piped.getvalue()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    p = Progress(2, stream=tty)
    p.update("layer 1/3")
    p.step("a")
    p.close()
    text = tty.getvalue()
    assert text.startswith("\r\x1b[Klayer 1/3\r\x1b[K[") and text.endswith("\n")
    assert text.count("\n") == 1


def test_progression_orders_balance_positions():
    variants = ["composition", "decode-attention", "mlx-lm"]
    orders = [tuple(progression.variant_order(variants, rep)) for rep in range(6)]
    assert len(set(orders)) == 6  # every order once
    for v in variants:
        assert sorted(o.index(v) for o in orders) == [0, 0, 1, 1, 2, 2]


def test_progression_fresh_processes_alternate_and_plot(tmp_path, capsys):
    with pytest.raises(SystemExit):
        progression.parse_args(["--input-len", "4", "--output-len", "3", "--repeats", "1"])
    args = progression.parse_args(
        [
            "--device",
            "cpu",
            "--model",
            "qwen3-tiny",
            "--variant",
            "composition",
            "--variant",
            "decode-attention",
            "--repeats",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--warmup",
            "0",
            "--output",
            str(tmp_path / "p.json"),
        ]
    )
    record = progression.run(args)
    validate(record)
    orders = [e["order"] for e in record["execution_order"]]
    assert orders == [["composition", "decode-attention"], ["decode-attention", "composition"]]
    for variant, samples in record["results"]["samples"].items():
        assert [s["repeat"] for s in samples] == [0, 1]
        assert record["results"]["medians"][variant]["decode_tok_s"] == pytest.approx(
            statistics.median(s["decode_tok_s"] for s in samples)
        )
    assert "decode vs composition" in progression.format_table(record)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(record))
    assert plot.plot(path).stat().st_size > 1000


def test_ab_decode_four_variants_rotated(tmp_path, capsys):
    out = tmp_path / "ab.json"
    ab_decode.main(
        [
            "--device",
            "cpu",
            "--model",
            "qwen3-tiny",
            "--rounds",
            "4",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--json-output",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    validate(record)
    assert record["kind"] == "ab-decode"
    orders = [tuple(e["order"]) for e in record["execution_order"]]
    assert len(set(orders)) == 4 and {o[0] for o in orders} == set(ab_decode.DEFAULT_VARIANTS)
    samples = record["results"]["samples"]
    assert set(samples) == set(ab_decode.DEFAULT_VARIANTS)
    for variant, rows in samples.items():
        assert [s["round"] for s in rows] == [0, 1, 2, 3]
        assert len(rows[0]["step_s"]) == 2  # output_len - 1 decode steps
        assert record["results"]["medians"][variant]["decode_tok_s"] == pytest.approx(
            statistics.median(s["decode_tok_s"] for s in rows)
        )
    # mlx-lm's model gives the same tokens in its loop and ours, and so does ours.
    assert len({tuple(r["tokens"]) for rows in samples.values() for r in rows}) == 1
    printed = capsys.readouterr().out
    assert "| mlx-lm (its generate_step) | " in printed and "1.000x (4/4)" in printed
    assert "| mlx-lm model, our loop |" in printed
    assert plot.plot(out).exists()
    with pytest.raises(SystemExit):
        ab_decode.parse_args(["--output-len", "1"])


def test_timed_takes_count_tokens_and_closes_the_loop():
    closed = []

    def loop():
        try:
            for token in range(10):
                yield token, None
        finally:
            closed.append(True)

    sample = bench.timed(loop(), prompt_len=6, count=4)
    assert sample["tokens"] == [0, 1, 2, 3] and closed == [True]
    assert len(sample["step_s"]) == 3 and sample["output_len"] == 4
    assert sample["decode_tok_s"] == pytest.approx(3 / sample["decode_s"])


def test_timed_reads_the_prefill_peak_and_the_decode_peak_apart():
    """A loop that holds 64 MiB only until its first token and 16 MiB once, later: the first
    peak sees the 64 MiB, the second only the 16."""
    mx.set_default_device(mx.cpu)
    mib = 2**20

    def loop():
        big = mx.zeros((64 * mib // 4,), mx.float32)
        mx.eval(big)
        del big
        yield 0, None
        for token in range(1, 4):
            if token == 2:
                small = mx.ones((16 * mib // 4,), mx.float32)
                mx.eval(small)
                del small
            yield token, None

    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    sample = bench.timed(loop(), prompt_len=6, count=4)
    prefill, decode = sample["prefill_peak_memory_bytes"], sample["decode_peak_memory_bytes"]
    assert prefill - base >= 64 * mib
    assert 16 * mib <= decode - base < 64 * mib
    assert sample["peak_memory_bytes"] == prefill


def test_our_loops_queue_one_step_past_the_tokens_taken(monkeypatch):
    """Equal structure with mlx-lm's generate_step, which always queues one step more."""
    asked = []
    real = bench.generate_step

    def spy(prompt, model, **kw):
        asked.append(kw["max_tokens"])
        return real(prompt, model, **kw)

    monkeypatch.setattr(bench, "generate_step", spy)
    mx.set_default_device(mx.cpu)
    models = bench.Models(qwen3_model.load("qwen3-tiny"))
    prompt = bench.prompt_ids(1000, 5, mx.random.key(0))
    for variant in ("decode-attention", "composition", "mlx-lm-our-loop"):
        assert len(models.request(variant, prompt, 4)["tokens"]) == 4
    assert asked == [5, 5, 5]


def test_unfused_variant_runs_decode_attention_per_layer():
    """decode-attention-unfused switches the fused step off for its request (and decode-attention
    back on), with the same greedy tokens."""
    mx.set_default_device(mx.cpu)
    models = bench.Models(qwen3_model.load("qwen3-tiny"))
    prompt = bench.prompt_ids(1000, 5, mx.random.key(0))
    tokens = {}
    for variant in ("decode-attention-unfused", "decode-attention"):
        tokens[variant] = models.request(variant, prompt, 4)["tokens"]
        steps = {layer.self_attn.fused_step for layer in models.model.layers}
        assert steps == {variant == "decode-attention"}, variant
    assert tokens["decode-attention-unfused"] == tokens["decode-attention"]
    args = ab_decode.parse_args(["--variants", "decode-attention-unfused,mlx-lm"])
    assert ab_decode.bench_args(args).variant == ["decode-attention-unfused", "mlx-lm"]


@pytest.mark.parametrize("load, busy", [(0.0, False), (99.0, True)])
def test_bench_says_when_the_machine_was_busy(tmp_path, monkeypatch, load, busy):
    monkeypatch.setattr(bench, "load_average", lambda: load)
    _, record = tiny_bench(tmp_path, "--input-len", "3", "--output-len", "2", "--rounds", "1")
    assert record["results"]["load_average"] == {"start": load, "end": load}
    report = " ".join(bench.format_report(record).split())
    assert ("load average was 99.0–99.0" in report) == busy


def test_ab_decode_variants_subset():
    args = ab_decode.parse_args(["--variants", "decode-attention,mlx-lm"])
    assert ab_decode.bench_args(args).variant == ["decode-attention", "mlx-lm"]
    for bad in ("decode-attention,composition", "mlx-lm,nope"):
        with pytest.raises(SystemExit):
            ab_decode.parse_args(["--variants", bad])


@pytest.mark.parametrize(
    "module, required",
    [
        ("bench", ["--device", "cpu"]),
        ("ab_decode", ["--device", "cpu"]),
        ("progression", ["--device", "cpu", "--input-len", "4", "--output-len", "3"]),
        ("serve", ["--device", "cpu"]),
        ("linear", []),
        ("operators", []),
        ("coverage", []),
        ("step", []),
        ("host_cost", []),
    ],
)
def test_record_flags_have_one_spelling_everywhere(module, required, tmp_path):
    """--output / --json-output name the record, --force / --overwrite replace it, in every
    entry point that writes one (each tool had one pair of the two)."""
    parse = importlib.import_module(f"llm_eval.{module}").parse_args
    path = tmp_path / "record.json"
    one = vars(parse([*required, "--output", str(path), "--force"]))
    other = vars(parse([*required, "--json-output", str(path), "--overwrite"]))
    assert one == other and str(path) in map(str, one.values()) and True in one.values()
