"""mlx-lm-decode on a tiny config on the CPU: both variants run mlx-lm's stream_generate, the
kernel variant's decode steps go through the fused step (the attention-only variant's through the
fused op), and the records validate."""

import contextlib
import json
from pathlib import Path

import pytest
from llm_eval import mlx_lm_decode
from llm_eval.progress import Progress
from llm_eval.record import validate

TINY = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,  # bf16 D=128: where the guard sends decode steps to the fused op
    rms_norm_eps=1e-5,
    vocab_size=512,
    tie_word_embeddings=True,
)


def test_tiny_model_two_workloads(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny", TINY)
    argv = ["--model", "tiny", "--quantize", "none", "--device", "cpu", "--rounds", "2"]
    argv += ["--bandwidth-gbs", "10", "--output", str(tmp_path)]
    mlx_lm_decode.main([*argv, "--workload", "12+5", "--workload", "3+4"])
    for prompt, generated in ((12, 5), (3, 4)):
        (path,) = tmp_path.glob(f"cpu-*core-tiny-bf16-mlx-lm-decode-{prompt}+{generated}-*.json")
        record = json.loads(path.read_text())
        validate(record)
        samples, medians = record["results"]["samples"], record["results"]["medians"]
        assert [o["order"] for o in record["execution_order"]] == [
            ["mlx-lm", "mlx-lm+kernel"],
            ["mlx-lm+kernel", "mlx-lm"],
        ]
        for v in mlx_lm_decode.VARIANTS:
            assert len(samples[v]) == 2
            for s in samples[v]:
                assert len(s["tokens"]) == generated and len(s["step_s"]) == generated - 1
                assert s["decode_tok_s"] == pytest.approx((generated - 1) / s["decode_s"])
                assert s["read_gbs"] > 0
            assert medians[v]["rounds_at_or_above_mlx_lm"] in (0, 1, 2)
        assert record["results"]["first_divergence"] is None
        assert samples["mlx-lm"][0]["tokens"] == samples["mlx-lm+kernel"][0]["tokens"]
        # Fused steps per layer (llama: no q/k norm): the last prompt token and every generated
        # one, plus one (generate_step queues one token past what it yields); the rest of the
        # prompt (L = prompt - 1) too where it fits the query limit of 8.
        # On the CPU each of those forwards runs its linear layers through decode_linear: 7 a
        # layer and the tied LM head.
        calls = {tuple(s["attention_calls"].items()) for s in samples["mlx-lm+kernel"]}
        fused = 2 * (1 + generated + (prompt - 1 <= 8))
        prefill = 0 if prompt - 1 <= 8 else 2
        linear = (7 * 2 + 1) * fused // 2
        assert calls == {
            (("fused", 0), ("fused_quantized", 0), ("fused_step", fused), ("mlx_lm", prefill),
             ("linear", linear))
        }  # fmt: skip
    out = capsys.readouterr().out
    assert "mlx-lm+kernel" in out and "greedy tokens identical" in out


def test_arguments_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        mlx_lm_decode.parse_args(["--workload", "32x97"])
    assert "PROMPT+GENERATED" in capsys.readouterr().err
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(SystemExit):
        mlx_lm_decode.parse_args(["--output", str(tmp_path / "a.json")])
    assert "not a folder" in capsys.readouterr().err


TINY_QWEN3 = dict(
    model_type="qwen3",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    vocab_size=512,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def test_attention_only_variant(tmp_path, monkeypatch, capsys):
    """--attention-only: three variants rotated in one process; mlx-lm+kernel's decode steps run
    as attention_step (its attention function is reached by the prefill only),
    mlx-lm+kernel-attention-only's attention calls through the fused op."""
    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny-qwen3", TINY_QWEN3)
    argv = ["--model", "tiny-qwen3", "--quantize", "none", "--device", "cpu", "--rounds", "3"]
    argv += ["--bandwidth-gbs", "10", "--output", str(tmp_path), "--workload", "12+5"]
    mlx_lm_decode.main([*argv, "--attention-only"])
    (path,) = tmp_path.glob("cpu-*core-tiny-qwen3-bf16-mlx-lm-decode-12+5-*.json")
    record = json.loads(path.read_text())
    validate(record)
    variants = ["mlx-lm", "mlx-lm+kernel", "mlx-lm+kernel-attention-only"]
    assert record["config"]["variants"] == variants
    assert [sorted(o["order"]) for o in record["execution_order"]] == [sorted(variants)] * 3
    assert len({tuple(o["order"]) for o in record["execution_order"]}) == 3  # rotated
    samples = record["results"]["samples"]
    assert all(len(samples[v]) == 3 for v in variants)
    # Per layer: the last prompt token and 5 + 1 generated ones fused; the 11-token prefill
    # through mlx-lm's attention function. Both variants run the linear layers of those 6
    # forwards through decode_linear (7 a layer and the tied LM head).
    only = {tuple(s["attention_calls"].items()) for s in samples["mlx-lm+kernel-attention-only"]}
    step = {tuple(s["attention_calls"].items()) for s in samples["mlx-lm+kernel"]}
    linear = ("linear", 6 * (7 * 2 + 1))
    assert only == {
        (("fused", 12), ("fused_quantized", 0), ("fused_step", 0), ("mlx_lm", 2), linear)
    }
    assert step == {
        (("fused", 0), ("fused_quantized", 0), ("fused_step", 12), ("mlx_lm", 2), linear)
    }
    results = record["results"]
    assert results["first_divergence"] is None
    assert results["first_divergence_attention_only"] is None
    assert "vs_mlx_lm" in results["medians"]["mlx-lm+kernel-attention-only"]
    out = capsys.readouterr().out
    assert (
        "mlx-lm+kernel-attention-only: calls per request (attention, linear layers): fused 12"
        in out
    )
    assert "mlx-lm+kernel: calls per request (attention, linear layers): fused 0" in out


def test_one_graph_a_step_variants(tmp_path, monkeypatch):
    """--one-graph-a-step: mlx-lm+one-graph and mlx-lm+kernel+one-graph rotated with the plain
    two, the kernel one fused as mlx-lm+kernel; the stream's graph limits raised inside the
    request and restored after (on a CPU MLX builds no graphs: the limits are None, a no-op)."""
    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny-qwen3", TINY_QWEN3)
    seen = []
    real = mlx_lm_decode.one_graph_a_step

    @contextlib.contextmanager
    def noting(stream):
        with real(stream):
            seen.append(stream)
            yield

    monkeypatch.setattr(mlx_lm_decode, "one_graph_a_step", noting)
    argv = ["--model", "tiny-qwen3", "--quantize", "none", "--device", "cpu", "--rounds", "2"]
    argv += ["--output", str(tmp_path), "--workload", "12+5", "--one-graph-a-step"]
    mlx_lm_decode.main(argv)
    (path,) = tmp_path.glob("cpu-*core-tiny-qwen3-bf16-mlx-lm-decode-12+5-*.json")
    record = json.loads(path.read_text())
    validate(record)
    variants = ["mlx-lm", "mlx-lm+kernel", "mlx-lm+one-graph", "mlx-lm+kernel+one-graph"]
    assert record["config"]["variants"] == variants
    samples = record["results"]["samples"]
    assert "attention_calls" not in samples["mlx-lm+one-graph"][0]
    assert samples["mlx-lm+kernel+one-graph"][0]["attention_calls"]["fused_step"] == 12
    assert len(seen) == 2 * (1 + 2)  # the two variants' warm-up and rounds
    assert "vs_mlx_lm" in record["results"]["medians"]["mlx-lm+kernel+one-graph"]


def test_linear_routing_variants(tmp_path, monkeypatch, capsys):
    """--linear-routing off and batches: two more kernel variants rotated with the plain two;
    on the CPU (whose default routing is all) off and batches leave every linear layer to MLX,
    mlx-lm+kernel routes them; every variant's steps fused, its tokens compared."""
    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny-qwen3", TINY_QWEN3)
    argv = ["--model", "tiny-qwen3", "--quantize", "none", "--device", "cpu", "--rounds", "2"]
    argv += ["--bandwidth-gbs", "10", "--output", str(tmp_path), "--workload", "12+5"]
    mlx_lm_decode.main([*argv, "--linear-routing", "off", "--linear-routing", "batches"])
    (path,) = tmp_path.glob("cpu-*core-tiny-qwen3-bf16-mlx-lm-decode-12+5-*.json")
    record = json.loads(path.read_text())
    validate(record)
    off, batches = "mlx-lm+kernel+linear-off", "mlx-lm+kernel+linear-batches"
    assert record["config"]["variants"] == ["mlx-lm", "mlx-lm+kernel", off, batches]
    samples = record["results"]["samples"]
    linear = {v: {s["attention_calls"]["linear"] for s in samples[v]} for v in samples if "+" in v}
    assert linear == {"mlx-lm+kernel": {6 * (7 * 2 + 1)}, off: {0}, batches: {0}}
    assert all(s["attention_calls"]["fused_step"] == 12 for v in (off, batches) for s in samples[v])
    assert record["results"]["first_divergence_linear"] == {"off": None, "batches": None}
    assert "vs_mlx_lm" in record["results"]["medians"][off]
    out = capsys.readouterr().out
    assert f"{off}: calls per request (attention, linear layers): fused 0" in out
    assert "linear 0; greedy tokens identical to mlx-lm's" in out


def test_speculative_decoding(tmp_path, monkeypatch, capsys):
    """--draft-layers 1: both variants decode speculatively with the model's first layer as the
    draft; the kernel variant's verify steps (L = 4) run fused; the same tokens; the record names
    the draft and counts its accepted tokens."""
    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny", TINY)
    argv = ["--model", "tiny", "--quantize", "none", "--device", "cpu", "--rounds", "1"]
    argv += ["--bandwidth-gbs", "10", "--output", str(tmp_path), "--workload", "12+9"]
    mlx_lm_decode.main([*argv, "--draft-layers", "1", "--num-draft-tokens", "3"])
    (path,) = tmp_path.glob("cpu-*core-tiny-bf16-mlx-lm-decode-speculative-12+9-*.json")
    record = json.loads(path.read_text())
    validate(record)
    assert record["config"]["draft_layers"] == 1 and record["config"]["num_draft_tokens"] == 3
    samples = record["results"]["samples"]
    assert samples["mlx-lm"][0]["tokens"] == samples["mlx-lm+kernel"][0]["tokens"]
    assert all(0 <= s[0]["tokens_from_draft"] < 9 for s in samples.values())
    assert samples["mlx-lm+kernel"][0]["attention_calls"]["fused_step"] > 0
    assert "speculative (1-layer draft, 3 tokens a step)" in capsys.readouterr().out


def test_quantized_cache(tmp_path, monkeypatch, capsys):
    """--kv-bits 8 --kv-group-size 32: both variants decode over mlx-lm's QuantizedKVCache from
    the first token; the kernel variant's decode steps run attention_step_quantized (counted
    here), the prompt mlx-lm's path; the record names the cache, its reads count the codes."""
    from attn_kernels.mlx_lm import step

    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny", TINY)
    quantized_steps, op = [], step.attention_step_quantized
    monkeypatch.setattr(
        step, "attention_step_quantized", lambda *a, **k: quantized_steps.append(1) or op(*a, **k)
    )
    argv = ["--model", "tiny", "--quantize", "none", "--device", "cpu", "--rounds", "2"]
    argv += ["--bandwidth-gbs", "10", "--output", str(tmp_path), "--workload", "12+5"]
    mlx_lm_decode.main([*argv, "--kv-bits", "8", "--kv-group-size", "32"])
    (path,) = tmp_path.glob("cpu-*core-tiny-bf16-kv8-group-32-mlx-lm-decode-12+5-*.json")
    record = json.loads(path.read_text())
    validate(record)
    assert (record["config"]["kv_bits"], record["config"]["kv_group_size"]) == (8, 32)
    # Per layer and head: 128 one-byte codes and a bf16 scale and bias for each of 4 groups.
    assert record["results"]["kv_bytes_per_position"] == 2 * 2 * 2 * (128 + 4 * 4)
    # Per layer the last prompt token and 5 + 1 generated ones (warm-up: 2 + 1), 2 layers.
    assert len(quantized_steps) == 2 * 6 * 2 + 2 * 3
    calls = {
        tuple(s["attention_calls"].items()) for s in record["results"]["samples"]["mlx-lm+kernel"]
    }
    assert calls == {
        (("fused", 0), ("fused_quantized", 0), ("fused_step", 12), ("mlx_lm", 2), ("linear", 90))
    }
    assert "a 8-bit cache (group 32)" in capsys.readouterr().out


def test_quantized_cache_arguments(capsys):
    with pytest.raises(SystemExit):
        mlx_lm_decode.parse_args(["--model", "phi-3-mini", "--kv-bits", "4"])
    assert "--kv-group-size 64 does not divide phi-3-mini's head dim 96" in capsys.readouterr().err
    assert mlx_lm_decode.parse_args(["--model", "phi-3-mini", "--kv-bits", "4",
                                     "--kv-group-size", "32"]).kv_group_size == 32  # fmt: skip
    with pytest.raises(SystemExit):
        mlx_lm_decode.parse_args(["--kv-bits", "3"])
    assert "--kv-bits: invalid choice" in capsys.readouterr().err


def test_draft_arguments(capsys):
    for argv, named in ((["--draft-layers", "0"], "--draft-layers"),
                        (["--draft-layers", "29", "--model", "qwen3-0.6b"], "28 layers"),
                        (["--num-draft-tokens", "0"], "--num-draft-tokens")):  # fmt: skip
        with pytest.raises(SystemExit):
            mlx_lm_decode.parse_args(argv)
        assert named in capsys.readouterr().err


def test_every_qwen3_config_and_8_bits():
    """The built-in Qwen3 configs bench knows are mlx-lm-decode's too, in 8 bits as well."""
    args = mlx_lm_decode.parse_args(["--model", "qwen3-tiny", "--quantize", "8bit"])
    model = mlx_lm_decode.build(args.model[0], args.quantize, 0)
    assert model.layers[0].mlp.down_proj.bits == 8


def test_kernel_trace_arguments(capsys):
    for argv, named in ((["--kernel-trace", "0"], "must be >= 1 steps"),
                        (["--kernel-trace", "2", "--device", "cpu"], "needs MLX's CUDA backend"),
                        (["--kernel-trace", "2", "--linear-routing", "off"], "not with --linear")):  # fmt: skip
        with pytest.raises(SystemExit):
            mlx_lm_decode.parse_args(argv)
        assert named in capsys.readouterr().err


def test_kernel_trace_window(tmp_path, monkeypatch):
    """--kernel-trace's child (run here without ncu, on the CPU) opens the profiled range for STEPS
    tokens from the request's middle, and the decode steps launched inside it are STEPS: one
    fused step a layer each."""
    import attn_kernels.mlx_lm as attention
    import mlx.core as mx
    from llm_eval import kernel_trace

    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny", TINY)
    argv = ["--model", "tiny", "--quantize", "none", "--device", "cpu", "--workload", "12+11"]
    args = mlx_lm_decode.parse_args(argv)
    args.kernel_trace, args.trace_child = 3, ("mlx-lm+kernel", str(tmp_path / "timings.json"))
    inside = []

    @contextlib.contextmanager
    def profiled():
        before = attention.calls()["fused_step"]
        yield
        inside.append(attention.calls()["fused_step"] - before)

    monkeypatch.setattr(kernel_trace, "profiled", profiled)
    with mx.stream(mx.cpu):
        mlx_lm_decode.trace_child(args)
    assert inside == [3 * TINY["num_hidden_layers"]]
    assert json.loads((tmp_path / "timings.json").read_text()) == {"tokens": 11}


def test_kernel_trace_record(tmp_path, monkeypatch, capsys):
    """The parent of --kernel-trace: each variant's wall step timed here, without ncu; one ncu
    child per variant (stood in for by a log of four kernels over STEPS = 2); the record."""
    import subprocess

    from llm_eval import kernel_trace
    from test_kernel_trace import HEADER, row

    monkeypatch.setitem(mlx_lm_decode.MODELS, "tiny", TINY)
    children, run = [], subprocess.run

    def ncu(command, **kwargs):
        if command[0] != "ncu":  # git, for the record's metadata
            return run(command, **kwargs)
        children.append(command[command.index("--trace-child") + 1])
        log = command[command.index("--log-file") + 1]
        kernels = [row(i, f"void k{i % 2}(int)", 1000 * (i + 1)) for i in range(4)]
        Path(log).write_text("\n".join([HEADER, *kernels]) + "\n")
        Path(command[-1]).write_text(json.dumps({"tokens": 9}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(kernel_trace.subprocess, "run", ncu)
    argv = ["--model", "tiny", "--quantize", "none", "--device", "cpu", "--workload", "12+9"]
    args = mlx_lm_decode.parse_args([*argv, "--output", str(tmp_path)])
    args.kernel_trace, args.ncu = 2, "ncu"
    record = mlx_lm_decode.trace_workload(args, "tiny", (12, 9), Progress())
    validate(record)
    assert children == mlx_lm_decode.VARIANTS
    for v in mlx_lm_decode.VARIANTS:
        r = record["results"][v]
        assert r["wall_ms_per_step"] > 0 and r["kernels_per_step"] == 2
        assert r["kernel_ms_per_step"] == pytest.approx(10e-3 / 2)
    assert "| mlx-lm+kernel |" in mlx_lm_decode.format_trace(record)
    assert "kernel-trace-12+9" in mlx_lm_decode.record_path(args, record).name
