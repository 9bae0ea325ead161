import collections
import json
import sys

import mlx.core as mx
import numpy as np
import pytest
from llm_eval import operators, plot
from llm_eval.record import collect_metadata, validate, write_record


def small_run(tmp_path, *extra):
    args = operators.parse_args(
        [
            "--device",
            "cpu",
            "--context",
            "9",
            "--context",
            "40",
            "--query-length",
            "2",
            "--heads",
            "4",
            "--gqa-ratio",
            "2",
            "--head-dim",
            "16",
            "--attention-mask",
            "causal",
            "--warmup",
            "1",
            "--iterations",
            "6",
            "--context-repeats",
            "2",
            "--bandwidth-gbs",
            "10",
            "--json-output",
            str(tmp_path / "r.json"),
            *extra,
        ]
    )
    return args, operators.run(args)


def test_every_order_equally_often_and_passes_alternate(tmp_path):
    _, record = small_run(tmp_path)
    orders = collections.Counter(tuple(e["order"]) for e in record["execution_order"])
    assert len(orders) == 6 and set(orders.values()) == {4}  # 6 orders x 2 shapes x 2 passes / 6
    shapes = [e["shape"] for e in record["execution_order"]]
    assert shapes[0] == "S=9,L=2" and shapes[-1] == "S=9,L=2"  # forward, then reverse


def test_medians_come_from_kept_samples(tmp_path):
    _, record = small_run(tmp_path)
    for entry in record["results"].values():
        for name, samples in entry["samples_us"].items():
            assert len(samples) == 12
            ordered = sorted(samples)
            assert entry["summary"][name]["median_us"] == pytest.approx(
                (ordered[5] + ordered[6]) / 2
            )
            assert entry["summary"][name]["floor_fraction"] == pytest.approx(
                entry["floor_us"] / entry["summary"][name]["median_us"]
            )


def test_record_round_trip_and_no_overwrite(tmp_path):
    args, record = small_run(tmp_path)
    path = write_record(record, args.json_output)
    loaded = json.loads(path.read_text())
    validate(loaded)
    assert loaded["results"].keys() == record["results"].keys()
    assert loaded["metadata"]["versions"]["mlx"]
    with pytest.raises(FileExistsError):
        write_record(record, path)
    with pytest.raises(SystemExit):
        operators.parse_args(["--json-output", str(path)])
    write_record(record, path, force=True)
    assert plot.plot(path).stat().st_size > 1000


def test_custom_kernel_allocates_no_score_rows(tmp_path):
    args = operators.parse_args(
        [
            "--device",
            "cpu",
            "--context",
            "8192",
            "--query-length",
            "8",
            "--attention-mask",
            "causal",
            "--warmup",
            "0",
            "--iterations",
            "6",
            "--bandwidth-gbs",
            "10",
        ]
    )
    record = operators.run(args)
    peak = record["results"]["S=8192,L=8"]["peak_extra_bytes"]
    scores = 32 * 8 * 8192 * 4
    assert peak["readable"] >= scores
    assert peak["custom"] < scores // 8


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--iterations", "4"], "multiple of 6"),
        (["--implementations", "custom,fast"], "unknown 'fast'"),
        (["--heads", "30", "--gqa-ratio", "4"], "not a multiple"),
        (["--attention-mask", "causal", "--context", "4", "--query-length", "8"], "causal"),
        (["--context", "0"], "positive"),
        (["--head-dim", "300"], "--head-dim must be in 1..256"),
        (["--bandwidth-gbs", "-1"], "--bandwidth-gbs: must be > 0"),
    ],
)
def test_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit):
        operators.parse_args(flags)
    assert message in capsys.readouterr().err


def test_record_validation_rejects_missing_keys():
    with pytest.raises(ValueError, match="lacks"):
        validate({"schema_version": 1})


def test_named_commit_wins_over_the_checkouts_git(monkeypatch):
    # The device machine's copy of the tree carries a stale .git: the caller's name must win.
    monkeypatch.setenv("LLM_EVAL_GIT_SHA", "0123abc")
    monkeypatch.setenv("LLM_EVAL_GIT_DIRTY", "")
    meta = collect_metadata("cpu")
    assert meta["git_sha"] == "0123abc" and meta["git_dirty"] is False
    for value, dirty in (("0", False), ("1", True)):  # tools/gpu.sh's documented values
        monkeypatch.setenv("LLM_EVAL_GIT_DIRTY", value)
        assert collect_metadata("cpu")["git_dirty"] is dirty
    monkeypatch.delenv("LLM_EVAL_GIT_SHA")
    assert collect_metadata("cpu")["git_sha"] != "0123abc"


def test_chained_calls_feed_each_output_to_the_next_query():
    seen = []

    def fn(q, k, v):
        seen.append(q)
        return q + k

    operators.time_sample(fn, (mx.zeros((2,)), mx.ones((2,)), None), 3, chain=True)
    assert [x[0].item() for x in seen] == [0.0, 1.0, 2.0]
    seen.clear()
    operators.time_sample(fn, (mx.zeros((2,)), mx.ones((2,)), None), 3)
    assert [x[0].item() for x in seen] == [0.0, 0.0, 0.0]


def test_warmup_runs_the_timed_batch(tmp_path, monkeypatch):
    """Warm-up samples are the timed eval (same calls per eval, same chaining), so the first timed
    sample of a shape does not pay for building that batch's graph."""
    seen = []
    real = operators.time_sample

    def spy(fn, args, calls, chain=False):
        seen.append((calls, chain))
        return real(fn, args, calls, chain)

    monkeypatch.setattr(operators, "time_sample", spy)
    _, record = small_run(tmp_path, "--calls-per-eval", "3", "--chain", "--warmup", "2")
    implementations = len(record["config"]["implementations"])
    timed = sum(len(e["order"]) for e in record["execution_order"])
    warmups = 2 * implementations * 2 * 2  # per implementation, shape (2) and pass (2)
    assert len(seen) == timed + warmups
    assert set(seen) == {(3, True)}


def test_fresh_inputs_time_first_and_repeat_use(tmp_path, monkeypatch):
    """Every first-use call reads buffers no call read before; the repeat-use call, the same."""
    seen = []
    real = operators.time_one_call

    def spy(fn, args):
        seen.append(tuple(id(a) for a in args))
        return real(fn, args)

    monkeypatch.setattr(operators, "time_one_call", spy)
    args, record = small_run(tmp_path, "--fresh-inputs", "--implementations", "custom,mlx")
    assert args.calls_per_eval == 1
    per_shape = 2 * 6  # implementations x iterations
    for i in range(0, len(seen), 2 * per_shape):  # one shape and pass: first use, repeat use
        first, repeat = seen[i : i + per_shape], seen[i + per_shape : i + 2 * per_shape]
        assert len(set(first)) == per_shape  # no buffer set used twice on first use
        assert sorted(first) == sorted(repeat)  # each used once more
    for entry in record["results"].values():
        for name in ("custom", "mlx"):
            s = entry["summary"][name]
            assert len(entry["samples_us"][name]) == len(entry["repeat_samples_us"][name]) == 12
            assert s["first_over_repeat"] == pytest.approx(
                s["median_us"] / s["repeat_use"]["median_us"]
            )
    assert "repeat-use" in operators.format_table(record)


def test_fresh_inputs_refuse_chain(tmp_path):
    with pytest.raises(SystemExit):
        small_run(tmp_path, "--fresh-inputs", "--chain")


def test_torch_peer_matches_the_readable_path():
    torch = pytest.importorskip("torch")
    q, k, v, mask = operators.make_shape(40, 2, 4, 2, 16, "causal", mx.bfloat16, 0)
    readable = operators.implementation("readable", 0.25, mask)(q, k, v).astype(mx.float32)
    for name in ("torch", "torch-float32"):
        out = operators.implementation(name, 0.25, mask, (q, k, v), "bfloat16")(q, k, v)
        assert isinstance(out, torch.Tensor)
        assert (
            operators.peak_bytes(operators.implementation(name, 0.25, mask, (q, k, v)), ()) is None
        )
        np.testing.assert_allclose(out.float().numpy(), np.array(readable), atol=3e-2, rtol=2e-2)


def test_torch_peer_without_torch_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(SystemExit):
        operators.parse_args(["--device", "cpu", "--implementations", "custom,torch"])
    assert "llm-eval[torch]" in capsys.readouterr().err


def test_ragged_rows_time_the_same_attention_three_ways(tmp_path):
    """--batch --ragged: the fused op reads each row's range, the readable path and mx.fast the
    mask those ranges stand for; all three compute the same rows, and the record counts the rows'
    own positions."""
    args, record = small_run(tmp_path, "--batch", "5", "--ragged")
    for context in (9, 40):
        starts = operators.ragged_starts(5, context, 2, args.seed)
        lengths = context - np.array(starts)
        assert lengths[0] == context and (lengths >= max(context // 4, 2)).all()
        entry = record["results"][f"S={context},L=2"]
        assert entry["valid_positions"] == lengths.sum()
        q, k, v, causal = operators.make_shape(context, 2, 4, 2, 16, "causal", mx.float32, 0, 5)
        mask = operators.range_mask(5, 2, context, starts, None, True)
        outs = {
            name: operators.implementation(
                name, 0.25, mask, (q, k, v), "float32", (starts, causal)
            )(q, k, v)
            for name in ("custom", "readable", "mlx")
        }
        for name in ("custom", "mlx"):
            np.testing.assert_allclose(
                np.array(outs[name]), np.array(outs["readable"]), rtol=1e-4, atol=1e-5
            )
    with pytest.raises(SystemExit):
        operators.parse_args(["--ragged", "--attention-mask", "explicit"])
