import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _cpu_default():
    mx.set_default_device(mx.cpu)
    yield
