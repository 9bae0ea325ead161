"""--kv-bits in bench-operators (quantized implementations, floor in quantized bytes) and in
bench/ab-decode (quantized caches for our model and for mlx-lm)."""

import io

import mlx.core as mx
import pytest
import qwen3_model
from llm_eval import bench, operators
from llm_eval.progress import Progress
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from qwen3_model import QuantizedKVCache
from test_operators import small_run


def test_operators_quantized_implementations(tmp_path):
    args, record = small_run(
        tmp_path,
        "--head-dim",
        "64",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
        "--implementations",
        "mlx,custom-quantized,mlx-lm-quantized",
    )
    for entry in record["results"].values():
        # 4-bit codes (D/8 words) and bf16 scales and biases (D/32 each) per K/V row and position
        rows = 2 * (args.heads // args.gqa_ratio) * entry["context"]
        assert entry["kv_quantized_bytes"] == rows * (64 // 8 * 4 + 2 * 2 * 64 // 32)
        assert entry["kv_bytes"] == rows * 64 * 2
        summary = entry["summary"]
        for name, read in (
            ("custom-quantized", entry["kv_quantized_bytes"]),
            ("mlx", entry["kv_bytes"]),
        ):
            assert summary[name]["gbs"] == pytest.approx(read / summary[name]["median_us"] / 1e3)
    assert "quantized" in operators.format_table(record)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--implementations", "custom-quantized"], "custom-quantized needs --kv-bits"),
        (
            [
                "--kv-bits",
                "8",
                "--implementations",
                "mlx-lm-quantized",
                "--attention-mask",
                "explicit",
            ],
            "mlx-lm-quantized takes --attention-mask none or causal",
        ),
    ],
)
def test_operators_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit):
        operators.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_bench_quantized_caches_in_every_model(tmp_path):
    """--kv-bits gives every model a quantized cache (ours in mlx-lm's layout, mlx-lm its own)
    and the same greedy tokens; reads count the quantized bytes."""
    mx.set_default_device(mx.cpu)
    model = qwen3_model.load("qwen3-tiny")
    models = bench.Models(model, kv_bits=4, kv_group_size=32)
    ours, theirs = qwen3_model.make_cache(model, *models.kv), models._twin_cache()
    assert all(isinstance(c, QuantizedKVCache) and (c.bits, c.group_size) == (4, 32) for c in ours)
    assert all(isinstance(c, MlxLmQuantizedKVCache) and c.bits == 4 for c in theirs)
    flags = ["--device", "cpu", "--model", "qwen3-tiny", "--bandwidth-gbs", "10", "--no-record"]
    flags += ["--input-len", "9", "--output-len", "5", "--rounds", "1", "--kv-bits", "4"]
    flags += ["--kv-group-size", "32"]
    record = bench.run(bench.parse_args(flags), Progress(stream=io.StringIO()))
    samples = record["results"]["samples"]
    assert len({tuple(r["tokens"]) for rows in samples.values() for r in rows}) == 1
    a = model.args  # per head and position: 32 4-bit codes, one bf16 scale and bias per group
    assert record["results"]["kv_bytes_per_position"] == (
        2 * a.num_hidden_layers * a.num_key_value_heads * (a.head_dim // 2 + 2 * 2)
    )
    assert record["config"]["weights_tag"] == "bf16-kv4bit"


def test_mlx_lm_full_precision_peer(tmp_path):
    """--mlx-lm-kv-bits none: ours keeps its quantized cache, mlx-lm gets its own KVCache (the
    peer where mlx-lm's quantized cache does not run); reads count each cache's bytes."""
    mx.set_default_device(mx.cpu)
    model = qwen3_model.load("qwen3-tiny")
    models = bench.Models(model, kv_bits=8, kv_group_size=32, peer_kv="none")
    assert all(isinstance(c, QuantizedKVCache) for c in qwen3_model.make_cache(model, *models.kv))
    assert not any(isinstance(c, MlxLmQuantizedKVCache) for c in models._twin_cache())
    flags = ["--device", "cpu", "--model", "qwen3-tiny", "--bandwidth-gbs", "10", "--no-record"]
    flags += ["--input-len", "9", "--output-len", "4", "--rounds", "1", "--kv-bits", "8"]
    flags += ["--kv-group-size", "32", "--mlx-lm-kv-bits", "none"]
    record = bench.run(bench.parse_args(flags), Progress(stream=io.StringIO()))
    a = model.args
    full = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2  # bf16
    assert record["results"]["mlx_lm_kv_bytes_per_position"] == full
    assert record["results"]["kv_bytes_per_position"] < full
    assert "mlx-lm's: full precision" in record["config"]["quantization"]


def test_mlx_lm_kv_bits_needs_kv_bits(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--model", "qwen3-tiny", "--mlx-lm-kv-bits", "none"])
    assert "--mlx-lm-kv-bits none needs --kv-bits" in capsys.readouterr().err
