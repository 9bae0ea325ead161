"""bench-step on the CPU at the tiny config: it runs against the current bench and model APIs,
drives the fused step through mlx-lm's generate_step without copying a cache, and counts graph
nodes by kind."""

import dataclasses
import json

import mlx.core as mx
import pytest
import qwen3_model.model as model_module
from attn_kernels import guard
from llm_eval import step as bench_step


def widen_guard(monkeypatch, head_dim):
    """The guard's limits with the tiny config's head dim (the records measured D=128 only), so
    decode-attention reaches the fused step here."""
    floats = (mx.float32, mx.float16, mx.bfloat16)
    wide = {
        where: dataclasses.replace(lim, head_dims=(*lim.head_dims, head_dim), dtypes=floats)
        for where, lim in guard.LIMITS.items()
    }
    monkeypatch.setattr(guard, "LIMITS", wide)


def test_cpu_smoke_run(tmp_path, monkeypatch):
    widen_guard(monkeypatch, bench_step.qwen3_model.CONFIGS["qwen3-tiny"].head_dim)
    steps, rules = [], []
    step = model_module.attention_step

    def counted(*a, **k):
        steps.append(a[7])
        rules.append(k["owned_caches"])
        return step(*a, **k)

    monkeypatch.setattr(model_module, "attention_step", counted)  # pick() sets it per variant
    monkeypatch.setattr(bench_step, "FUSED_STEP", counted)
    out = tmp_path / "step.json"
    variants = bench_step.VARIANTS
    bench_step.main(
        [
            "--model", "qwen3-tiny", "--device", "cpu", "--workloads", "20+6", "250+9",
            "--rounds", "2", "--anatomy-steps", "3", "--variants", *variants,
            "--json-output", str(out),
        ]
    )  # fmt: skip
    record = json.loads(out.read_text())
    assert record["kind"] == "step-bench" and record["metadata"]["device"]["cpu"]
    assert [(e["input_len"], e["output_len"]) for e in record["results"]] == [(20, 6), (250, 9)]
    assert len(record["execution_order"]) == 4  # rounds x workloads, rotated
    for entry in record["results"]:
        for v in variants:
            rows = entry["samples"][v]
            assert [r["round"] for r in rows] == [0, 1]
            assert all(r["tokens"] == entry["output_len"] and r["decode_tok_s"] > 0 for r in rows)
            assert all(len(r["token_ids"]) == entry["output_len"] for r in rows)
            assert len(entry["anatomy"][v]["eval_ms"]) == 3
        # The pipelined decode (250+9 crosses the cache's 256-position step) copies no cache.
        assert [r["cache_copies"] for r in entry["samples"]["decode-attention"]] == [0, 0]
    # decode-attention ran the fused step at every decode position (steps of the other
    # variants never reach it); 250 + 8 decode steps cross the 256 boundary. The model asks
    # for owned caches; the -mlx-rule variant does not.
    assert set(range(250, 258)) <= set(steps) and set(range(20, 25)) <= set(steps)
    assert set(rules) == {True, False}


def test_bad_workloads(capsys):
    for bad in (["--workloads", "20"], ["--workloads", "20+1"], ["--workloads", "a+b"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)
        assert "--workloads" in capsys.readouterr().err


def test_count_nodes(tmp_path):
    """Nodes by kind in DOT files laid out as cudaGraphDebugDotPrint writes them."""
    dot = tmp_path / "graph_1.dot"
    dot.write_text(
        "digraph dot {\n"
        'subgraph cluster_1 {\nlabel="graph_1" graph[style="dashed"];\n'
        '"graph_1_node_0"[style="solid" shape="octagon" label="0\nKERNEL\nrms_norm"];\n'
        '"graph_1_node_1"[style="solid" shape="octagon" label="1\nKERNEL\ngemv"];\n'
        '"graph_1_node_2"[style="solid" shape="rectangle" label="2\nMEMSET"];\n'
        '"graph_1_node_3"[style="solid" shape="rectangle" label="3\nMEMCPY"];\n'
        '"graph_1_node_4"[style="solid" shape="circle" label="4\nEMPTY"];\n'
        '"graph_1_node_0" -> "graph_1_node_1";\n}\n}\n'
    )
    assert bench_step.count_nodes([dot]) == {"kernel": 2, "memset": 1, "memcpy": 1, "empty": 1}
