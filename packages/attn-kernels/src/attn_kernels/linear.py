"""Linear layers for decode on the CPU: `x @ weight.T (+ bias)` for a few rows of x.

A decode step multiplies one row of activations per token by every weight of the model, so it
reads all the weights to do 1-8 multiply-adds with each: bound by memory, where MLX 0.32's CPU
matmul reads bf16 weights at ~2 GB/s and quantized ones at ~0.1 GB/s. `DecodeLinear` reads each
weight once, widened or dequantised in registers, over the CPU kernels' thread pool
(docs/cpu-linear.md). Weights are dense (N, K) or mlx-lm's quantized layout (`mx.quantize`
triples: `nn.QuantizedLinear`'s weight, scales and biases) read as stored. On an NVIDIA GPU,
quantized weights against bf16/f16 x run a tensor-core kernel that reads each weight once for
up to 32 rows (kernels-cuda/linear_quantized.cuh; MLX's qmv re-reads them per row); dense and
float32 weights, and every weight on other GPUs, run MLX's own ops.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from attn_kernels import _ext, guard

Stream = mx.Stream | mx.Device | mx.DeviceType | None


def _on_cpu(stream: Stream) -> bool:
    if stream is None:
        device = mx.default_device()
    elif isinstance(stream, mx.Stream):
        device = stream.device
    else:
        device = stream
    # mx.cpu itself is a DeviceType, which MLX's ops take for a device as well
    return getattr(device, "type", device) == mx.cpu


def _cuda_kernel(x: mx.array) -> bool:
    """Whether a GPU stream's call of decode_linear_quantized runs the CUDA kernel (bf16/f16 x)."""
    return x.dtype in (mx.bfloat16, mx.float16) and mx.cuda.is_available()


def _check_arrays(**arrays) -> None:
    for name, a in arrays.items():
        if a is not None and not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mx.array, got {type(a).__name__}")


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's swiglu (models/activations.py), compiled as it is: the same fused kernel and
    roundings, so a GPU down projection's input equals mlx-lm's."""
    return nn.silu(gate) * x


def decode_linear(
    x: mx.array,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    gate: mx.array | None = None,
    stream: Stream = None,
) -> mx.array:
    """x @ weight.T + bias as `nn.Linear` computes it, for decode on the CPU.

    x: (..., K) float32, float16 or bfloat16; weight: (N, K) and bias: (N,) in x's dtype (no
    silent promotion). Returns (..., N) in x's dtype, accumulated in float32. Made for a few rows
    of x (a decode step's tokens: each pass over the weights serves up to 8); more rows are
    served in passes of 8. Bad shapes or dtypes raise ValueError naming the argument.

    gate: with it (x's shape and dtype) the layer multiplies silu(gate) * x, an MLP's down
    projection of mlx-lm's `swiglu(gate, x)`: computed while x is prepared (float32, rounded
    once to x's dtype as the separate op's output would be), one op instead of MLX's SwiGLU
    and a matmul (docs/cpu-linear.md).
    """
    _check_arrays(x=x, weight=weight, bias=bias, gate=gate)
    if not _on_cpu(stream):
        out = (x if gate is None else _swiglu(gate, x)) @ weight.T
        return out if bias is None else out + bias
    return _ext.decode_linear(x, weight, None, None, bias, 64, 0, gate, stream=stream)


def decode_linear_quantized(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    bias: mx.array | None = None,
    *,
    group_size: int = 64,
    bits: int = 4,
    gate: mx.array | None = None,
    stream: Stream = None,
) -> mx.array:
    """x @ W.T + bias with W = scales * codes + biases per group (`mx.quantize`'s affine mode), as
    `nn.QuantizedLinear` computes it, reading the codes as stored.

    x: (..., K) float32, float16 or bfloat16; weight: uint32 codes (N, K * bits / 32); scales,
    biases: (N, K / group_size) in x's dtype; bias: (N,) or None. bits 4 or 8, group_size 32, 64
    or 128 (mlx-lm's default: 4 and 64). gate: as decode_linear's (on a GPU: mlx-lm's swiglu
    op first). Returns (..., N) in x's dtype. On a CUDA stream with bf16/f16 x: the tensor-core
    kernel (the bias added in float32 before the output's one rounding); elsewhere on a GPU,
    mx.quantized_matmul.
    """
    _check_arrays(x=x, weight=weight, scales=scales, biases=biases, bias=bias, gate=gate)
    on_cpu = _on_cpu(stream)
    return _quantized(x, weight, scales, biases, bias, group_size, bits, gate, stream, on_cpu)


def _quantized(x, weight, scales, biases, bias, group_size, bits, gate, stream, on_cpu):
    """decode_linear_quantized past its type checks (guarded_linear's arrays are a layer's, its
    device the backend the guard was asked about)."""
    if not on_cpu and _cuda_kernel(x):
        x = x if gate is None else _swiglu(gate, x)
        return _ext.decode_linear(
            x, weight, scales, biases, bias, group_size, bits, None, stream=stream
        )
    if not on_cpu:
        out = mx.quantized_matmul(
            x if gate is None else _swiglu(gate, x),
            weight,
            scales,
            biases,
            transpose=True,
            group_size=group_size,
            bits=bits,
        )
        return out if bias is None else out + bias
    return _ext.decode_linear(
        x, weight, scales, biases, bias, group_size, bits, gate, stream=stream
    )


# (weight, scales, biases, bias, group_size, bits) of a linear layer; bits 0: dense weight.
LayerWeights = tuple[mx.array, mx.array | None, mx.array | None, mx.array | None, int, int]


def layer_weights(layer) -> LayerWeights | None:
    """The arrays of mlx.nn's Linear, QuantizedLinear (affine mode), Embedding or
    QuantizedEmbedding (an embedding as a linear layer: a tied LM head's as_linear); None for
    any other layer, subclasses included (their forward may differ)."""
    # A module is a dict of its arrays: item access skips Module.__getattr__ (0.5 us a name on
    # every wrapped call).
    kind = type(layer)
    if kind is nn.QuantizedLinear or kind is nn.QuantizedEmbedding:
        biases = layer.get("biases")
        if layer.mode != "affine" or biases is None:
            return None
        return (layer["weight"], layer["scales"], biases, layer.get("bias"), layer.group_size,
                layer.bits)  # fmt: skip
    if kind is nn.Linear or kind is nn.Embedding:
        return layer["weight"], None, None, layer.get("bias"), 0, 0
    return None


def linear_rows_routed(x: mx.array) -> bool:
    """Whether x's rows (everything before its last axis) are a count decode_linear runs for on
    the default device's backend (guard.linear_min_rows to guard.linear_rows): the cheap question
    before the full one (the layer's arrays, their formats). Asked first, it keeps the rows MLX
    runs from paying for the rest on every call (a one-row CUDA step, 250 linear calls)."""
    shape = x.shape
    if not shape or not shape[-1]:
        return False
    where = guard.backend()
    return guard.linear_min_rows(where) <= x.size // shape[-1] <= guard.linear_rows(where)


def guarded_linear(
    x: mx.array, weights: LayerWeights | None, gate: mx.array | None = None
) -> mx.array | None:
    """x @ W.T (+ bias), or with a gate (silu(gate) * x) @ W.T (+ bias), through decode_linear or
    decode_linear_quantized where attn_kernels.guard has measured them to beat MLX's matmul
    (use_linear: the rows of x, their dtype, the format and group size, the default device's
    backend) and the arrays share x's dtype; None elsewhere (the caller runs MLX's own)."""
    shape = x.shape
    if weights is None or not shape or not shape[-1]:
        return None
    weight, scales, biases, bias, group_size, bits = weights
    dtype, where = x.dtype, guard.backend()
    if not guard.use_linear(x.size // shape[-1], dtype, bits, group_size, where):
        return None
    if (scales.dtype != dtype or biases.dtype != dtype) if bits else weight.dtype != dtype:
        return None
    if (bias is not None and bias.dtype != dtype) or (gate is not None and gate.dtype != dtype):
        return None
    try:
        if bits:
            on_cpu = where == "cpu"
            return _quantized(x, weight, scales, biases, bias, group_size, bits, gate, None, on_cpu)
        return decode_linear(x, weight, bias, gate=gate)
    except ValueError:
        return None  # a layout the op does not take (a width or packing it rejects)
