"""Two settings of MLX's CUDA backend that our decode steps depend on.

`graph_limits`: how many kernels MLX gathers into one CUDA graph on a stream before it commits
it: every `ops` kernels or `mb` "MB" of inputs (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER:
read once per process, 100 and 1000 on sm_90; mlx/backend/cuda/device.cpp). A batched decode
step of a 4B model is ~400 kernels, so it commits several graphs mid-step; on a stream whose
step is one graph (guard.BATCH_GRAPH_LIMITS) a 32-slot batch decoded up to twice as fast, though
not in every round (docs/serving-cuda.md).

`output_memory`: where our ops' outputs live. MLX exports one allocation to extensions,
`allocator::malloc`, which returns CUDA managed memory, and first moves a block that one of
MLX's own ops freed into managed memory with a synchronous copy whenever its cache hands one
back. So by default our outputs come from device memory the extension keeps (blocks from the
device's memory pool, reused by size; not counted by `mx.get_active_memory`).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from attn_kernels import _ext


def graph_limits(
    stream: mx.Stream, max_ops: int | None = None, max_mb: int | None = None
) -> tuple[int, int] | None:
    """`stream`'s CUDA graph limits (ops, MB) before the call, then max_ops and max_mb set where
    given (positive ints). None where MLX builds no CUDA graphs on the stream (a CPU stream, an
    MLX without the CUDA backend), which has nothing to set."""
    if not isinstance(stream, mx.Stream):
        raise ValueError(f"[graph_limits] stream must be an mx.Stream, got {type(stream).__name__}")
    for name, value in (("max_ops", max_ops), ("max_mb", max_mb)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"[graph_limits] {name} must be a positive int or None, got {value!r}")
    return _ext.set_graph_limits(stream, max_ops or 0, max_mb or 0)


def output_memory(device: bool | None = None) -> dict | None:
    """Where our CUDA ops' outputs live, after switching where `device` is given: True (the
    default) device memory the extension keeps, False MLX's `allocator::malloc` (managed memory;
    the A/B). Returns {"device", "live_bytes", "cached_bytes", "allocations"}: bytes held by
    arrays now, bytes freed and kept for reuse, and the blocks allocated so far. None without
    the CUDA backend, where outputs come from MLX's allocator."""
    if device is not None and not isinstance(device, bool):
        raise ValueError(f"[output_memory] device must be a bool or None, got {device!r}")
    return _ext.output_memory(device)


@contextlib.contextmanager
def managed_outputs():
    """Our CUDA ops' outputs from MLX's allocator (managed memory) inside the block, the setting
    before it restored after (the A/B of output_memory); nothing to switch without CUDA."""
    before = output_memory()  # output_memory(device=...) returns the state after the switch
    if before is None:
        yield
        return
    output_memory(device=False)
    try:
        yield
    finally:
        output_memory(device=before["device"])
