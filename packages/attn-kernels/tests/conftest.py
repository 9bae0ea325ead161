import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Tolerances against the float64 reference, per dtype. The kernel accumulates in float32 in a
# different order than the reference (online softmax reorders the sums): float32 is good to
# ~1e-6 relative. Half-precision outputs carry one rounding of the result (bf16: 2^-8, f16:
# 2^-11 relative) on values of magnitude <= ~3 (convex combinations of N(0,1) values), plus the
# float32 error. The oracle also rounds the probabilities to the value dtype before its matmul,
# so oracle-vs-kernel comparisons use twice these bounds.
TOLERANCE = {
    mx.float32: dict(atol=2e-5, rtol=2e-5),
    mx.float16: dict(atol=4e-3, rtol=2e-3),
    mx.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True)
def _cpu_default():
    mx.set_default_device(mx.cpu)
    yield


def pytest_collection_modifyitems(config, items):
    # S=131072 runs where a GPU does it in milliseconds, not on the CI CPU.
    for item in items:
        params = getattr(item, "callspec", None)
        device = params.params.get("device") if params else None
        if item.get_closest_marker("gpu_only") and device == mx.cpu:
            item.add_marker(pytest.mark.skip(reason="long context: GPU only"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: run on the GPU device only")


def settled(condition, seconds=2.0):
    """MLX releases a graph's arrays in a completion handler, shortly after eval returns."""
    deadline = time.perf_counter() + seconds
    while not condition() and time.perf_counter() < deadline:
        mx.synchronize()
        time.sleep(0.01)
    return condition()
