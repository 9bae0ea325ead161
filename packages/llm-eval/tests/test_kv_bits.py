"""--kv-bits in bench-operators (quantized implementations, floor in quantized bytes) and in
bench/ab-decode (quantized caches for our model and for mlx-lm)."""

import argparse

import mlx.core as mx
import pytest
from llm_eval import bench, operators
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


@pytest.mark.parametrize("checkpoint", ["decode-attention", "mlx-lm"])
def test_bench_builds_quantized_caches(checkpoint):
    mx.set_default_device(mx.cpu)
    args = argparse.Namespace(
        quantize="none",
        weights=None,
        model="qwen3-tiny",
        seed=0,
        checkpoint=checkpoint,
        schedule="auto",
        kv_bits=4,
        kv_group_size=32,
    )
    model, make_cache = bench.build(args)
    cache = make_cache(model)
    expected = QuantizedKVCache if checkpoint != "mlx-lm" else MlxLmQuantizedKVCache
    assert len(cache) == len(model.layers)
    assert all(isinstance(c, expected) and (c.bits, c.group_size) == (4, 32) for c in cache)
