"""bench-coverage: a small sweep's record, the region rule, and the guard's regions against the
record they name."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from attn_kernels import guard
from llm_eval import coverage, plot

RESULTS = Path(__file__).resolve().parents[3] / "benchmark_results"
# Per backend: the coverage records the guard's further shapes come from (one sweep, in parts).
RECORDS = {
    "cpu": ["cpu-2core-attention-coverage-mlx-0.32.4.json"],
    "cuda": [f"h100-attention-coverage-chained-D{d}-mlx-0.32.4.json" for d in coverage.HEAD_DIMS],
}


def test_small_sweep(tmp_path):
    out = tmp_path / "coverage.json"
    coverage.main(["--head-dim", "80", "--head-dim", "64", "--dtype", "float16", "--group", "2",
                   "--group", "1", "--query-length", "3", "--query-length", "1", "--context", "70",
                   "--context", "35", "--heads", "4", "--schedule", "split-mma",
                   "--calls-per-eval", "3", "--chain", "--json-output", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    assert record["kind"] == "coverage-sweep" and record["config"]["schedule"] == "split-mma"
    assert record["config"]["calls_per_eval"] == 3 and record["config"]["chain"] is True
    assert record["config"]["mx_fast_masks"] == {"1": "none", "2-8": "causal"}
    assert "(chained calls)" in coverage.format_tables(record)
    assert coverage.parse_args([]).chain is False  # a CPU sweep's calls are independent by default
    points = record["results"]
    assert len(points) == 2 * 2 * 2 * 2  # D x group x L x S
    p = points[coverage.point_key(80, "float16", 1, 3, 70)]
    assert p["passes"] == 2 and 0 <= p["passes_won"] <= 2
    assert p["ratio"] == pytest.approx(p["mx_fast_us"] / p["ours_us"])
    assert len(p["samples_us"]["custom"]) == len(p["samples_us"]["mlx"]) == 4
    assert {(r["head_dim"], r["dtype"]) for r in record["regions"]} == {
        (64, "float16"),
        (80, "float16"),
    }
    chart = plot.plot(out)  # one panel per (D, dtype)
    assert chart.suffix == ".png" and chart.stat().st_size > 0
    both = plot.plot_coverage_together([out, out], tmp_path / "both.png")  # a sweep in parts
    assert both.stat().st_size > 0
    not_coverage = tmp_path / "other.json"
    not_coverage.write_text(json.dumps({"kind": "operator-sweep", "results": {}}))
    with pytest.raises(ValueError, match="coverage"):
        plot.plot_coverage_together([out, not_coverage], tmp_path / "x.png")


def point(d, length, context, won, group=1, dtype="bfloat16"):
    return {
        "head_dim": d,
        "dtype": dtype,
        "group": group,
        "query_length": length,
        "context": context,
        "passes_won": 2 if won else 1,
        "passes": 2,
        "ratio": 1.5 if won else 0.5,
    }


def test_region_rule():
    """Per swept L, the longest run of contexts where no group lost: a lost point at (L=8,
    S=16384) in one group ends L = 8's run at 1024 and leaves L = 1 and 4 whole; a lost smallest
    point moves a start up; a tie (a lost pass, medians within TIE) is not a loss; a start at the
    smallest swept S reaches down to S = 1; of two runs as long, the one reaching further."""
    grid = [(q, s) for q in (1, 4, 8) for s in (128, 1024, 16384)]
    points = {}
    for g in (1, 4):
        for q, s in grid:
            lost = g == 4 and (q, s) == (8, 16384)
            points[f"a{g}{q}{s}"] = point(64, q, s, not lost, group=g)
            points[f"b{g}{q}{s}"] = point(96, q, s, s != 128 or q > 1, group=g)
            tied = point(80, q, s, False, group=g)
            tied["ratio"] = 1 - coverage.TIE / 2 if s == 128 else 1.5
            points[f"c{g}{q}{s}"] = tied
            points[f"d{g}{q}{s}"] = point(128, q, s, s != 1024, group=g)
    regions = coverage.derive_regions(points)
    assert [regions[(64, "bfloat16", q)] for q in (1, 4, 8)] == [(1, 16384), (1, 16384), (1, 1024)]
    assert [regions[(96, "bfloat16", q)] for q in (1, 4, 8)] == [
        (1024, 16384), (1, 16384), (1, 16384)]  # fmt: skip
    assert regions[(80, "bfloat16", 8)] == (1, 16384)
    assert regions[(128, "bfloat16", 1)] == (16384, 16384)
    for p in points.values():
        p["ratio"], p["passes_won"] = 0.5, 0
    assert coverage.derive_regions(points)[(64, "bfloat16", 1)] == (0, 0)


def test_bad_arguments(capsys):
    for argv, named in (
        (["--group", "3"], "--group"),
        (["--iterations", "3"], "--iterations"),
        (["--head-dim", "300"], "--head-dim"),
        (["--query-length", "9", "--context", "8"], "--query-length"),
        (["--schedule", "fast"], "--schedule"),
        (["--calls-per-eval", "0"], "--calls-per-eval"),
    ):
        with pytest.raises(SystemExit):
            coverage.parse_args(argv)
        assert named in capsys.readouterr().err


@pytest.mark.parametrize("backend", sorted(RECORDS))
def test_guard_regions_are_the_records(backend):
    """Every further shape of the backend's guard is a region its coverage records derive, and
    every region they derive (except the reference shape's own) is in the guard."""
    points = {}
    for name in RECORDS[backend]:
        record = json.loads((RESULTS / name).read_text())
        points.update(record["results"])
        # mx.fast with mask "causal" at L = 1 (the sweeps before 969841e) runs slower on CUDA than
        # mlx-lm's None from S = 8192 (raw/h100-attention-L1-mask-none-vs-causal.txt); on CPUs
        # the two time the same
        assert backend == "cpu" or "mx_fast_masks" in record["config"], name
    derived = coverage.derive_regions(points)
    assert guard.SWEPT_QUERY_LENGTHS == coverage.QUERY_LENGTHS  # the rows' lengths are the sweep's
    limits = guard.LIMITS[backend]
    reference = {(d, t) for d in limits.head_dims for t in limits.dtypes}
    expected = {
        (d, getattr(mx, t), q, lo, hi)
        for (d, t, q), (lo, hi) in derived.items()
        if (d, getattr(mx, t)) not in reference and hi > 0
    }
    assert set(limits.shapes) == expected
