"""Tensor parallelism on this machine's CPUs: 2 ranks over MLX's ring backend on localhost."""

from pathlib import Path

import mlx.core as mx
import pytest
from qwen3_model import CONFIGS, Model, ModelArgs
from qwen3_model.distributed import LaunchError, launch

WORKER = str(Path(__file__).with_name("tp_worker.py"))
# Logits are O(5) here. In float32 the sharded model equals the unsharded one to rounding (seen:
# 4e-6, 4-bit weights too): the layout is exact. In bf16 o_proj/down_proj are two rounded
# halves joined by an all_sum, which moves logits by a few bf16 ulps (seen: 0.04), more with the
# 4-bit model's larger activations (seen: 0.27; the parity tests with mlx-lm see the same
# spread, test_model.LOGIT_ATOL).
LOGIT_ATOL = {"float32": 1e-4, "4bit-float32": 1e-4, "bf16": 0.1, "4bit": 0.35}


# `make test` runs float32 (the exact layout) and the 4-bit model in bf16; `make test-full` all.
QUICK = ("float32", "4bit")


@pytest.mark.parametrize(
    "variant", [v if v in QUICK else pytest.param(v, marks=pytest.mark.full) for v in LOGIT_ATOL]
)
def test_sharded_model_matches_unsharded(variant):
    ranks = launch([WORKER, variant], n=2, timeout=240)
    assert len(ranks) == 2
    for r in ranks:
        assert r["rank_heads"] == [2, 1]  # 4 query and 2 key/value heads split over 2 ranks
        assert r["sharded_tokens"] == r["full_tokens"]
        assert r["max_logit_diff"] <= LOGIT_ATOL[variant], r
        assert r["max_prefill_diff"] <= LOGIT_ATOL[variant], r
        if variant.endswith("float32"):  # bf16 rounding may flip a near-tie among 37 positions
            assert r["sharded_prefill_argmax"] == r["full_prefill_argmax"]
    assert ranks[0]["sharded_tokens"] == ranks[1]["sharded_tokens"]


def test_launch_names_the_failing_rank():
    with pytest.raises(LaunchError, match=r"rank 1 failed: RuntimeError: failing on purpose"):
        launch([WORKER, "bf16", "1"], n=2, timeout=240)


def test_launch_names_a_rank_that_never_reported(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("import mlx.core as mx\nmx.distributed.init()\n")
    with pytest.raises(LaunchError, match=r"rank 0 reported nothing.*rank 1 reported nothing"):
        launch([str(script)], n=2, timeout=120)


def test_launch_times_out_with_a_clear_error(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(LaunchError, match=r"did not finish within 3 s"):
        launch([str(script)], n=2, timeout=3)


def test_shard_refuses_indivisible_heads():
    args = CONFIGS["qwen3-tiny"]  # 4 query heads, 2 key/value heads
    model = Model(ModelArgs(**{**args.to_dict(), "num_key_value_heads": 1}))

    class Three:
        def size(self):
            return 3

    with pytest.raises(ValueError, match=r"num_attention_heads=4, num_key_value_heads=1"):
        model.shard(Three())
    assert mx.distributed.init().size() == 1  # a plain process is a group of one: no-op
    model.shard()
