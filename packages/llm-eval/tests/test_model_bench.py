import json
import statistics

import mlx.core as mx
import pytest
from llm_eval import ab_decode, bench, plot, progression
from llm_eval.record import validate


def test_bench_tiny_model():
    args = bench.parse_args(
        [
            "--device",
            "cpu",
            "--model",
            "qwen3-tiny",
            "--num-seqs",
            "2",
            "--min-input-len",
            "5",
            "--max-input-len",
            "9",
            "--min-output-len",
            "3",
            "--max-output-len",
            "4",
            "--warmup",
            "1",
            "--bandwidth-gbs",
            "10",
        ]
    )
    record = bench.run(args)
    validate(record)
    requests = record["results"]["requests"]
    assert len(requests) == 2
    for r in requests:
        assert 5 <= r["input_len"] <= 9 and 3 <= r["output_len"] <= 4
        assert len(r["step_s"]) == r["output_len"] - 1
        assert r["decode_tok_s"] == pytest.approx((r["output_len"] - 1) / r["decode_s"])
    s = record["results"]["summary"]
    assert s["weight_read_limit_tok_s"] == pytest.approx(10e9 / s["weight_bytes"])


def test_bench_mlx_lm_checkpoint_runs():
    """The mlx-lm checkpoint times mlx-lm's own Qwen3 (with our weights: the same logits as our
    composition checkpoint) and records every request it ran."""
    flags = ["--device", "cpu", "--model", "qwen3-tiny", "--min-input-len", "4"]
    flags += ["--min-output-len", "3", "--warmup", "0", "--bandwidth-gbs", "10"]
    args = bench.parse_args([*flags, "--checkpoint", "mlx-lm"])
    twin, twin_cache = bench.build(args)
    assert type(twin).__module__ == "mlx_lm.models.qwen3"
    ours, our_cache = bench.build(bench.parse_args([*flags, "--checkpoint", "composition"]))
    prompt = bench.prompt_ids(ours.args.vocab_size, 4, mx.random.key(1))
    a = bench.forward(twin, prompt, twin_cache(twin), last_only=False)
    b = bench.forward(ours, prompt, our_cache(ours), last_only=False)
    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=0.1).item()
    record = bench.run(args)
    validate(record)
    assert record["config"]["checkpoint"] == "mlx-lm"
    [request] = record["results"]["requests"]
    assert (request["input_len"], request["output_len"], len(request["step_s"])) == (4, 3, 2)
    assert record["results"]["summary"]["decode_tok_s"] == pytest.approx(2 / request["decode_s"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--min-output-len", "1"], "decode needs a second token"),
        (["--model", "qwen3-99b"], "unknown 'qwen3-99b'"),
        (["--model", "qwen3-tiny", "--weights", "x"], "not both"),
        (["--min-input-len", "9", "--max-input-len", "3"], "min <= max"),
    ],
)
def test_bench_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


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
            "--json-output",
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


def test_ab_decode_one_process_rotated(tmp_path, capsys):
    out = tmp_path / "ab.json"
    ab_decode.main(
        [
            "--device",
            "cpu",
            "--model",
            "qwen3-tiny",
            "--rounds",
            "3",
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
    orders = [tuple(e["order"]) for e in record["execution_order"]]
    assert len(set(orders)) == 3 and {o[0] for o in orders} == set(ab_decode.VARIANTS)
    for variant, samples in record["results"]["samples"].items():
        assert [s["round"] for s in samples] == [0, 1, 2]
        assert len(samples[0]["step_s"]) == 2  # output_len - 1 decode steps
        assert record["results"]["medians"][variant]["decode_tok_s"] == pytest.approx(
            statistics.median(s["decode_tok_s"] for s in samples)
        )
    assert "(3/3)" in capsys.readouterr().out  # mlx-lm against itself
    assert plot.plot(out).exists()
    with pytest.raises(SystemExit):
        ab_decode.parse_args(["--output-len", "1"])
