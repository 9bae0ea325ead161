"""The host-side probes and the quantized-cache accuracy on the CPU, at small sizes: each runs,
keeps every sample in its record, and refuses bad arguments naming them."""

import json

import pytest
from llm_eval import accuracy, eval_overhead, host_cost


def record(path):
    r = json.loads(path.read_text())
    assert r["metadata"]["device"]["cpu"] and r["execution_order"]
    return r


def test_host_cost_op(tmp_path):
    out = tmp_path / "op.json"
    host_cost.main(["--device", "cpu", "--context", "3", "--context", "40", "--rounds", "6",
                    "--calls", "2", "--evals", "1", "--heads", "6", "--gqa-ratio", "3",
                    "--head-dim", "64", "--json-output", str(out)])  # fmt: skip
    r = record(out)
    assert r["kind"] == "host-cost" and set(r["results"]) == {"S=3", "S=40"}
    for part in ("build", "dispatch", "eval"):
        timings = r["results"]["S=40"][part]
        assert {"custom", "mlx", "add", "custom-donated"} <= set(timings)
        assert all(len(t["samples_us"]) == 6 and t["median_us"] > 0 for t in timings.values())
    # Every implementation in every position of the rotated rounds.
    orders = [e["order"] for e in r["execution_order"] if e["context"] == 3]
    assert {o[0] for o in orders} == set(r["results"]["S=3"]["build"])


def test_host_cost_mlx_lm_attention(tmp_path):
    out = tmp_path / "module.json"
    host_cost.main(["--device", "cpu", "--level", "mlx-lm-attention", "--context", "37",
                    "--rounds", "3", "--calls", "2", "--json-output", str(out)])  # fmt: skip
    r = record(out)
    assert r["kind"] == "mlx-lm-step-host-cost"
    assert set(r["results"]) == {"mlx-lm", "mlx-lm+kernel-attention-only", "mlx-lm+kernel"}
    assert all(len(t["samples_us"]) == 3 for t in r["results"].values())
    # The kernel variants took their paths in the warm-up; mlx-lm alone did not count any.
    warm = r["config"]["warmup_calls"]
    assert warm["mlx-lm"] is None and warm["mlx-lm+kernel"]["fused_step"] > 0


def test_host_cost_mlx_lm_linear(tmp_path):
    out = tmp_path / "linear.json"
    host_cost.main(["--device", "cpu", "--level", "mlx-lm-linear", "--linear-shape", "40x192",
                    "--rounds", "2", "--calls", "5", "--json-output", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["kind"] == "mlx-lm-linear-host-cost" and r["config"]["shape"] == [40, 192]
    assert all(len(r["results"][v]["samples_us"]) == 2 for v in ("mlx-lm", "mlx-lm+kernel"))
    warm = r["config"]["warmup_calls"]
    assert warm["mlx-lm"] is None and warm["mlx-lm+kernel"]["linear"] > 0


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--rounds", "0"], "--rounds"),
        (["--heads", "6", "--gqa-ratio", "4"], "--heads"),
        (["--level", "mlx-lm-attention", "--context", "5", "--context", "6"], "--context"),
        (["--level", "mlx-lm-attention", "--old-wrapper", "HEAD"], "--old-wrapper"),
        (["--level", "mlx-lm-linear", "--linear-shape", "40x100"], "--linear-shape"),
        (["--level", "mlx-lm-linear", "--linear-shape", "forty"], "--linear-shape"),
        (["--linear-shape", "40x192"], "--linear-shape: only with"),
    ],
)
def test_host_cost_bad_arguments(argv, named, capsys):
    with pytest.raises(SystemExit):
        host_cost.parse_args(argv)
    assert named in capsys.readouterr().err


def test_eval_overhead(tmp_path):
    out = tmp_path / "eval.json"
    eval_overhead.main(["--rounds", "2", "--block", "2", "--context", "70", "--calls", "1",
                        "--calls", "3", "--spin-us", "0", "--json-output", str(out)])  # fmt: skip
    r = record(out)
    assert r["kind"] == "cpu-eval-overhead"
    names = set(r["results"])
    assert {"synchronize", "add x1", "add x8"} <= names and len(names) == 5
    calls = r["results"]["custom S=70 x3 auto spin=0"]
    assert calls["calls"] == 3 and len(calls["samples_us"]) == 2 and calls["floor_fraction"] > 0


def test_eval_overhead_bad_arguments(capsys):
    for argv, named in ((["--block", "1"], "--block"), (["--units-per-thread", "99"], "--units")):
        with pytest.raises(SystemExit):
            eval_overhead.main(argv)
        assert named in capsys.readouterr().err


def test_accuracy_against_float64(tmp_path):
    """Our quantized attention is as faithful to the codes as mlx-lm's: its error against float64
    attention over the dequantized codes is a bf16 rounding, far below the quantization's."""
    out = tmp_path / "accuracy.json"
    accuracy.main(["--bits", "4", "--group-size", "32", "--context", "45", "--json-output",
                   str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    rows = r["results"]
    assert [(x["context"], x["query_length"]) for x in rows] == [(45, 1), (45, 4)]
    for row in rows:
        ours, theirs = row["custom-quantized"], row["mlx-lm-quantized"]
        assert ours["rms_error_vs_codes"] < 0.1 * ours["rms_error"]
        assert ours["rms_error_vs_codes"] <= 2 * theirs["rms_error_vs_codes"] + 1e-3
        assert 0 < ours["rms_error"] < 0.2 * ours["rms_output"]


def test_accuracy_bad_context(capsys):
    with pytest.raises(SystemExit):
        accuracy.main(["--context", "3"])
    assert "--context" in capsys.readouterr().err
