"""The residual add and the RMSNorm after it as one kernel on CUDA (an experiment on the fused
step's kernel count, Model.set_add_norm; docs/fused-step.md).

    h = x + y;  normed = mx.fast.rms_norm(h, weight, eps)

On CUDA one block per row adds, stores h, reduces the squares and writes normed with
mx.fast.rms_norm's roundings (h rounded to the dtype, h·r rounded, times the weight rounded):
a kernel written with mx.fast.cuda_kernel (MLX compiles it at its first use). Elsewhere the two
MLX ops.
"""

from __future__ import annotations

import mlx.core as mx

THREADS = 256  # per row: hidden sizes of Qwen3 are 1024..5120

SOURCE = """
  const int row = blockIdx.x;
  const T* xr = x + size_t(row) * D;
  const T* yr = y + size_t(row) * D;
  T* hr = h + size_t(row) * D;
  T* nr = normed + size_t(row) * D;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const T s = T(static_cast<float>(xr[i]) + static_cast<float>(yr[i]));
    hr[i] = s;
    const float f = static_cast<float>(s);
    sum += f * f;
  }
  __shared__ float partial[32];
  for (int m = 16; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int m = 16; m > 0; m /= 2) t += __shfl_xor_sync(0xffffffffu, t, m);
    if (threadIdx.x == 0) partial[0] = t;
  }
  __syncthreads();
  const float r = rsqrtf(partial[0] / D + EPS);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const T scaled = T(static_cast<float>(hr[i]) * r);
    nr[i] = T(static_cast<float>(w[i]) * static_cast<float>(scaled));
  }
"""

_kernels: dict[float, object] = {}


def _kernel(eps: float):
    """One kernel per eps (a literal in the source: MLX keys its compiled modules by source)."""
    if eps not in _kernels:
        _kernels[eps] = mx.fast.cuda_kernel(
            name="add_rms_norm",
            input_names=["x", "y", "w"],
            output_names=["h", "normed"],
            source=SOURCE.replace("EPS", f"{float(eps)!r}f"),
        )
    return _kernels[eps]


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def add_rms_norm(
    x: mx.array, y: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """(x + y, rms_norm(x + y) * weight) over the last axis: one kernel on CUDA."""
    if not on_cuda() or x.dtype != y.dtype or weight.dtype != x.dtype or x.shape != y.shape:
        h = x + y
        return h, mx.fast.rms_norm(h, weight, eps)
    dim = x.shape[-1]
    rows = x.size // dim
    h, normed = _kernel(eps)(
        inputs=[x, y, weight],
        template=[("T", x.dtype), ("D", dim)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, normed
