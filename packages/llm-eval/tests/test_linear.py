"""bench-linear on small shapes on the CPU: every (shape, format, rows) case times ours and MLX's
matmul with every sample kept and the orders rotated, the record validates, and bad arguments
are refused before anything runs."""

import json

import mlx.core as mx
import pytest
from llm_eval import linear
from llm_eval.record import validate


def test_small_shapes_record(tmp_path, capsys):
    out = tmp_path / "linear.json"
    argv = ["--shape", "40x64", "--shape", "24x96", "--format", "bf16", "--format", "q4"]
    argv += ["--format", "q8", "--rows", "1", "--rows", "3", "--group-size", "32"]
    linear.main([*argv, "--iterations", "4", "--weights-mb", "1", "--output", str(out)])
    record = json.loads(out.read_text())
    validate(record)
    cases = record["results"]["cases"]
    assert len(cases) == 2 * 3 * 2
    for name, case in cases.items():
        assert set(case["samples_us"]) == {"ours", "mlx"}, name
        assert all(len(s) == 4 for s in case["samples_us"].values())
        assert case["copies"] >= 2
        summary = case["summary"]
        assert summary["ours"]["vs_ours"] == 1.0 and summary["mlx"]["gbs"] > 0
        assert summary["ours"]["floor_fraction"] > 0
    orders = [tuple(o["order"]) for o in record["execution_order"]]
    assert set(orders) == {("ours", "mlx"), ("mlx", "ours")}  # rotated within each case
    table = capsys.readouterr().out
    assert "| 40x64 | 40 x 64 | q4 | 3 |" in table and f"wrote {out}" in table


def test_torch_peer(tmp_path):
    """With PyTorch installed: torch.nn.functional.linear timed on the dense formats (its copies
    of the weights made before any timing), no samples where it has no kernel (4-bit)."""
    pytest.importorskip("torch")
    out = tmp_path / "linear.json"
    argv = ["--shape", "40x64", "--format", "bf16", "--format", "q4", "--rows", "2"]
    linear.main(
        [*argv, "--implementations", "ours,torch", "--iterations", "2", "--output", str(out)]
    )
    cases = json.loads(out.read_text())["results"]["cases"]
    assert len(cases["40x64,bf16,M=2"]["samples_us"]["torch"]) == 2
    assert cases["40x64,q4,M=2"]["samples_us"]["torch"] == []
    assert "torch" not in cases["40x64,q4,M=2"]["summary"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "40by64"], "expected NxK"),
        (["--shape", "0x64"], "must be positive"),
        (["--model", "qwen3-0.6b", "--shape", "8x64"], "not both"),
        (["--shape", "8x48", "--format", "q4"], "must divide every K"),
        (["--iterations", "3"], "multiple of 2"),
        (["--implementations", "ours,numpy"], "unknown ['numpy']"),
        (["--rows", "0"], "--rows must be >= 1"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        linear.parse_args(argv)
    assert message in capsys.readouterr().err


def test_chained_calls_wait_for_each_other():
    """A GPU sample's calls (here on the CPU): each call's x is computed from the previous
    output, so a kernel reads it (a NaN there reaches x: mx.depends, which CUDA's graph does not
    order by, would pass x through), with x's values otherwise (the calls' own arithmetic)."""
    copies = [linear.Weights(24, 64, "q4", 32, mx.random.key(i)) for i in range(3)]
    x = mx.random.normal((2, 64)).astype(mx.bfloat16)
    assert linear.time_call(copies, "ours", x) > 0
    assert linear.time_glue(3, x) > 0
    previous = copies[0].caller("mlx", x)(x)
    chained = linear.chained_input(x, previous)
    assert chained.dtype == x.dtype and mx.array_equal(chained, x).item()
    poisoned = linear.chained_input(x, mx.full(previous.shape, float("nan"), previous.dtype))
    assert mx.isnan(poisoned).all().item()
    for w in copies:
        got, expected = w.caller("ours", chained)(chained), w.caller("ours", x)(x)
        assert mx.array_equal(got, expected).item()
