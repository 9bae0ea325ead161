"""bench under mlx.launch: 2 ranks over the ring backend on localhost (tensor parallel)."""

import io
from pathlib import Path

import qwen3_model
from llm_eval import bench
from llm_eval.progress import Progress
from mlx.utils import tree_flatten
from qwen3_model.distributed import launch

WORKER = str(Path(__file__).with_name("bench_rank_worker.py"))


def test_bench_two_ranks_every_rank_timed_same_tokens():
    flags = ["--device", "cpu", "--model", "qwen3-tiny", "--bandwidth-gbs", "10"]
    flags += ["--input-len", "9", "--output-len", "6", "--rounds", "2", "--no-record"]
    ranks = launch([WORKER, *flags], n=2, timeout=300)
    full = qwen3_model.load("qwen3-tiny")
    full_bytes = sum(v.nbytes for _, v in tree_flatten(full.parameters()))
    for r in ranks:
        assert r["ranks"] == 2
        assert [p["rank"] for p in r["per_rank"]] == [0, 1]
        for p in r["per_rank"]:  # every rank's timing of every sample, gathered on every rank
            for v in r["tokens"]:
                assert len(p[v]["decode_tok_s"]) == 2 and min(p[v]["decode_tok_s"]) > 0
        # Sharded: a rank holds its slice of the projections (embeddings and norms whole).
        assert r["weight_bytes"] < full_bytes
        # The same greedy tokens from every sharded model and round, and on both ranks.
        assert len({tuple(t) for rows in r["tokens"].values() for t in rows}) == 1
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    # ... and the unsharded model's greedy tokens (bf16: the tiny model has no near-ties here).
    one = bench.run(bench.parse_args(flags), Progress(stream=io.StringIO()))
    unsharded = {tuple(r["tokens"]) for rows in one["results"]["samples"].values() for r in rows}
    assert unsharded == {tuple(ranks[0]["tokens"]["decode-attention"][0])}
