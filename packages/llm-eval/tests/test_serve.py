"""bench-serve on a tiny config on the CPU: every variant serves the whole mix each round, the
kernel variant's decode steps go through the fused step, the numbers follow from the samples
kept, and the record validates."""

import json

import pytest
import qwen3_model
from llm_eval import serve
from llm_eval.record import validate
from qwen3_model.configs import ModelArgs

# Head dim 128: the guard's measured region, so that enable() fuses the batch's decode steps.
TINY = ModelArgs(128, 2, 256, 4, 2, 128, 512)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(qwen3_model.CONFIGS, "tiny128", TINY)


def run(tmp_path, *extra):
    out = tmp_path / "serve.json"
    argv = ["--model", "tiny128", "--quantize", "none", "--device", "cpu", "--requests", "5"]
    argv += ["--prompt-min", "3", "--prompt-max", "21", "--new-tokens", "4", "--rounds", "2"]
    serve.main([*argv, "--bandwidth-gbs", "10", "--output", str(out), *extra])
    record = json.loads(out.read_text())
    validate(record)
    return record


def test_every_variant_serves_the_mix(tmp_path, tiny, capsys):
    record = run(tmp_path, "--slots", "2", "--slots", "5")
    lengths = record["config"]["prompt_lengths"]
    assert len(lengths) == 5 and all(3 <= n <= 21 for n in lengths) and len(set(lengths)) > 1
    assert [(o["slots"], o["order"]) for o in record["execution_order"]] == [
        (2, serve.VARIANTS),
        (2, serve.VARIANTS[1:] + serve.VARIANTS[:1]),
        (5, serve.VARIANTS),
        (5, serve.VARIANTS[1:] + serve.VARIANTS[:1]),
    ]
    for slots in (2, 5):
        series = record["results"]["series"][f"slots={slots}"]
        for variant, samples in series["samples"].items():
            assert len(samples) == 2
            for s in samples:
                assert [len(t) for t in s["tokens"]] == [4] * 5
                emitted = [c["emitted"] for c in s["calls"]]
                assert sum(emitted) == s["generated"] == 20 and max(emitted) <= slots
                decode = [c for c in s["calls"] if c["emitted"] and not c["prefilled"]]
                decode_s = sum(c["seconds"] for c in decode)
                tokens = sum(c["emitted"] for c in decode)
                assert s["decode_tok_s"] == pytest.approx(tokens / decode_s)
                assert s["mean_step_ms"] == pytest.approx(decode_s / len(decode) * 1e3)
                assert s["floor_fraction"] > 0 and s["ttft_ms_p50"] <= s["ttft_ms_p99"]
                # Every generated token after the first of a request comes from a decode step;
                # the kernel's are fused, one per layer (a call may prefill and decode at once).
                if variant == serve.MLX_LM_KERNEL:
                    assert s["fused_steps"] >= 2 * (tokens // slots)
                    assert s["fused_steps"] % 2 == 0
                else:
                    assert s["fused_steps"] is None
                assert s["cache_copies"] == 0  # decode steps write the caches in place
                assert all(c["active_gb"] > 0 and c["cache_gb"] >= 0 for c in s["calls"])
                waits = [c["waited_s"] for c in s["calls"]]
                if variant == serve.OURS:  # parts of each call: the reads' wait, build, encode
                    parts = [c["waited_s"] + c["built_s"] + c["encoded_s"] for c in s["calls"]]
                    assert all(
                        0 <= p <= c["seconds"] for p, c in zip(parts, s["calls"], strict=True)
                    )
                    assert min(c[k] for c in s["calls"] for k in ("built_s", "encoded_s")) >= 0
                    assert sum(waits) > 0 and sum(c["built_s"] for c in s["calls"]) > 0
                else:
                    assert waits == [None] * len(waits)
        summary = series["summary"]
        assert summary[serve.MLX_LM]["vs_mlx_lm"] == 1.0
        # float32 would tie every token; bf16 may part at near-ties, so only counted here.
        assert all(0 <= n <= 5 for n in summary[serve.OURS]["same_tokens_as_mlx_lm"])
    out = capsys.readouterr().out
    assert "| 5 | ours |" in out and "wrote" in out


def test_on_request_variants(tmp_path, tiny):
    """ours-linear-all-rows serves the mix token for token with ours (on a CPU the same kernels
    run), and mlx-lm's generator under enable(linear=False) runs its fused steps (counted)."""
    variants = [
        serve.MLX_LM_KERNEL,
        serve.MLX_LM_ATTENTION,
        serve.MLX_LM_KERNEL_ALL_ROWS,
        serve.OURS,
        serve.OURS_LINEAR_ALL_ROWS,
    ]
    argv = ["--slots", "3", "--rounds", "1", *[a for v in variants for a in ("--variant", v)]]
    series = run(tmp_path, *argv)["results"]["series"]["slots=3"]
    for variant in variants:
        (sample,) = series["samples"][variant]
        assert sample["generated"] == 20
        if variant in serve.KERNEL_VARIANTS:
            assert sample["fused_steps"] > 0
    tokens = {v: series["samples"][v][0]["tokens"] for v in variants}
    assert tokens[serve.OURS_LINEAR_ALL_ROWS] == tokens[serve.OURS]
    assert tokens[serve.MLX_LM_KERNEL_ALL_ROWS] == tokens[serve.MLX_LM_KERNEL]


def test_anatomy_names_each_part(tmp_path, tiny):
    record = run(tmp_path, "--slots", "3", "--variant", "ours", "--anatomy", "--context", "40")
    parts = record["results"]["series"]["slots=3"]["anatomy"]
    assert parts["context"] == 42  # the context asked, plus half the new tokens
    for key in ("step_ms", "step_unfolded_ms", "host_build_ms", "attention_ms"):
        assert parts[key] > 0
    assert parts["attention_unfolded_ms"] > 0 and parts["attention_op_ms"] > 0
    for key in ("sync_build_ms", "sync_encode_ms", "sync_wait_ms", "pipelined_step_ms"):
        assert parts[key] >= 0
    assert parts["cache_copies"] == 0  # the steps update their caches in place
    for name in ("qkv", "o_proj", "gate_up", "down"):  # chained over the layers, glue taken off
        assert set(parts[f"{name}_ms"]) == {
            "rows_as_batch",
            "rows_as_positions",
            "ours",
            "bf16_weights",
        }
    assert set(parts["lm_head_ms"]) == {"rows_as_batch", "rows_as_positions"}
    ops = parts["graph_ops"]  # one AttentionStep a layer; the total counts every primitive
    assert ops["AttentionStep"] == record["model_config"]["num_hidden_layers"]
    assert ops["total"] == sum(v for k, v in ops.items() if k != "total")
    assert list(record["results"]["series"]["slots=3"]["samples"]) == ["ours"]


def test_anatomy_only_skips_the_serving_runs(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "7")
    record = run(
        tmp_path, "--slots", "2", "--anatomy-only", "--context", "20", "--quantize", "4bit"
    )
    series = record["results"]["series"]["slots=2"]
    assert series["samples"] == {} and series["anatomy"]["pipelined_step_ms"] > 0
    assert "ours" in series["anatomy"]["down_ms"]  # decode_linear_quantized on the 4-bit layers
    assert record["config"]["mlx_environment"]["MLX_MAX_OPS_PER_BUFFER"] == "7"
    assert "anatomy, 2 rows" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "qwen3-huge"], "--model: unknown 'qwen3-huge'"),
        (["--slots", "0"], "--slots: must be >= 1, got 0"),
        (["--prompt-min", "9", "--prompt-max", "3"], "--prompt-min 9 is above --prompt-max 3"),
        (["--new-tokens", "1"], "--new-tokens: must be >= 2, got 1"),
        # 0 is refused, not taken for "the default"
        (["--new-tokens", "0"], "--new-tokens: must be >= 2, got 0"),
        (["--requests", "0"], "--requests: must be >= 1, got 0"),
        (["--prompt-max", "0"], "--prompt-max: must be >= 1, got 0"),
        (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["--anatomy-only", "--context", "-5"], "--context: must be >= 1, got -5"),
        (["--bandwidth-gbs", "0"], "--bandwidth-gbs: must be > 0, got 0"),
        (["--requests", "x"], "--requests: invalid integer value: 'x'"),
        (["--kernel-trace"], "--kernel-trace: needs MLX's CUDA backend"),
        (["--kernel-trace", "--trace-steps", "0"], "--trace-steps: must be >= 1, got 0"),
    ],
)
def test_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_linear_all_rows_raises_the_guards_row_limit_for_its_runs(tmp_path, tiny, monkeypatch):
    from attn_kernels import guard

    monkeypatch.setitem(guard.LINEAR_LIMITS, "cpu", (2, guard.LINEAR_LIMITS["cpu"][1]))
    with serve.linear_rows_up_to(5):
        assert guard.linear_rows("cpu") == 5
    assert guard.linear_rows("cpu") == 2
    seen = []
    linear = serve.qwen3_model.model.guarded_linear

    def spy(x, *args):
        out = linear(x, *args)
        if out is not None:  # our kernel ran (None: MLX's matmul)
            seen.append(x.size // x.shape[-1])
        return out

    monkeypatch.setattr(serve.qwen3_model.model, "guarded_linear", spy)
    record = run(tmp_path, "--slots", "3", "--variant", "ours", "--variant", "ours-linear-all-rows")
    series = record["results"]["series"]["slots=3"]
    assert all(s["generated"] == 20 for v in series["samples"].values() for s in v)
    assert 3 in seen and guard.linear_rows("cpu") == 2  # 3 rows: the variant's steps alone
