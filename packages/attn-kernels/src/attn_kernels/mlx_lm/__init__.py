"""mlx-lm models decode through the fused kernel: one call, no change to the model code.

    import attn_kernels.mlx_lm
    attn_kernels.mlx_lm.enable()          # or: with attn_kernels.mlx_lm.enabled(): ...
    ...mlx_lm.load / stream_generate / generate as usual...
    attn_kernels.mlx_lm.disable()

mlx-lm's model modules call `mlx_lm.models.base.scaled_dot_product_attention`, each through the
name it imported (`from .base import scaled_dot_product_attention`). enable() rebinds that name in
base and in every loaded module that holds mlx-lm's function; modules imported later copy the
rebound name from base. disable() puts mlx-lm's function back under every name that holds ours.

A call runs `decode_attention_custom` when attn_kernels.guard accepts it (query length, context,
head dim and dtype inside the backend's measured region) and it has the op's form: mask None or
"causal", no attention sinks, a plain K/V cache in temporal order (or one query over a wrapped
RotatingKVCache: it sees the whole window in any order). Everything else goes to mlx-lm's
function, unchanged: longer prefill, explicit masks (batched generation, sliding windows), sinks,
several queries over a wrapped RotatingKVCache, and inputs the op rejects (mixed dtypes, K and V
head dims that differ). A QuantizedKVCache's decode steps run `decode_attention_quantized` where
the guard's quantized region accepts them (CPU: L = 1, S <= 32768, the measured head dim and
dtype), mlx-lm's quantized path elsewhere. docs/mlx-lm.md has the table and the records. mlx-lm
itself is optional: this module imports without it, enable() needs it.

enable() also replaces `Attention.__call__` of mlx-lm's llama (and so mistral), qwen2, qwen3,
qwen3_moe, gemma3_text and phi3 modules (step.STEP_MODELS): decode steps the guard accepts
(guard.use_step) with a plain KVCache (or a RotatingKVCache: one token, at its ring's slot) and a
RoPE the op takes (plain, position-scaled or Llama 3's frequencies) run q/k norm (Qwen3, Gemma 3),
RoPE, the cache write and attention as one `attention_step` on the cache's buffers (step.py), and
with a QuantizedKVCache (guard.use_step_quantized: on a GPU head dims that are multiples of 64) one
`attention_step_quantized` on its triples; everything else runs mlx-lm's method.
enable(fused_step=False) leaves those methods alone: only the attention function is replaced.

enable() also runs the linear layers of decode steps through `decode_linear` where the guard
measured it to beat MLX's matmul (guard.use_linear: on the CPU up to 8 rows of x, bf16/f16/f32
weights and bf16 4- and 8-bit affine codes; on CUDA 2-32 rows of bf16 4- and 8-bit codes):
`nn.Linear`, `nn.QuantizedLinear` and the embeddings' `as_linear` (a tied LM head) of every
mlx-lm model; other rows, formats, devices and layer subclasses keep MLX's. Where the
guard's linear limits for the default device's backend start at one row (the CPU) the routing is
installed for every call. Where they start at two (CUDA) enable() installs it only while mlx-lm's
GenerationBatch.next builds a batched decode step (BatchGenerator: batch_generate and
mlx_lm.server): a wrapped layer costs ~2.6 µs of Python a call at rows the backend leaves to MLX
(over MLX's own ~3 µs, this CPU), which a single request's decode step, bound by its host, would
pay 250 times for nothing. enable(linear=False) keeps MLX's matmuls, enable(linear=True) installs
the routing for every call (on CUDA also a speculative verify step's 2-8 rows;
kernels-cuda/linear_quantized.cuh). linear_routing() says which.

With the linear layers routed, enable() also replaces `MLP.__call__` of mlx-lm's llama, qwen2,
qwen3 and qwen3_moe modules (their `down_proj(swiglu(gate_proj(x), up_proj(x)))`, checked against
mlx-lm's source when enable() runs): where the guard accepts down_proj's call, the SwiGLU runs
inside it (`decode_linear`'s gate), one op instead of MLX's SwiGLU and a matmul.

enable() also folds a batched decode step's rows into positions in MLX's quantized layers
(nn.QuantizedLinear, QuantizedEmbedding.as_linear): an input (B, 1, K) with B > 1 runs as
(1, B, K), the same arithmetic, because MLX's CUDA quantized matmul runs each batch item as a
GEMM of its own with a 128-row tile (B GEMMs where one does; step.fold_rows).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Iterator

import mlx.core as mx

from attn_kernels import guard
from attn_kernels.attention import decode_attention_custom
from attn_kernels.guard import use_fused, use_fused_quantized
from attn_kernels.linear import guarded_linear, layer_weights, linear_rows_routed
from attn_kernels.mlx_lm import step
from attn_kernels.quantized import decode_attention_quantized

NAME = "scaled_dot_product_attention"

_lock = threading.Lock()
_enabled = False
_original = None  # mlx-lm's function, kept after disable() for stray references to ours
_rotating = None  # mlx_lm.models.cache.RotatingKVCache
_calls = {"fused": 0, "fused_quantized": 0, "fused_step": 0, "mlx_lm": 0, "linear": 0}
# mlx-lm's Attention classes whose __call__ is the fused step's, each with mlx-lm's own method
# (put back by disable() and enable(fused_step=False)).
_replaced: dict[type, object] = {}
# mlx.nn's quantized layers' methods that enable() folds (step.fold_rows), with their own.
_folded: dict[tuple[type, str], object] = {}
# mlx.nn's linear layers' methods that enable() routes through decode_linear, with the methods
# they replaced (MLX's, or the folded ones).
_routed: dict[tuple[type, str], object] = {}
# mlx-lm's GenerationBatch with its own `next`, where the routing is installed per batched decode
# step (enable(linear=None) where the backend's linear limits start at 2 rows).
_batch_steps: dict[type, object] = {}


def _mlx_lm_modules():
    try:
        from mlx_lm.models import base, cache
    except ImportError as e:
        raise ImportError(
            "attn_kernels.mlx_lm needs mlx-lm (`pip install mlx-lm`); it is not installed"
        ) from e
    return base, cache


def _fused(queries, keys, cache, mask, sinks) -> bool:
    """The guard's question, for calls in the op's form: no sinks, mask None or a string, a plain
    K/V cache (a wrapped RotatingKVCache for one query only). Shapes and dtypes the op does not
    take it rejects itself."""
    # Explicit masks stay with mlx-lm although the guard has a region for them: a padded row of
    # mlx-lm's batch masks can lose every key, which mx.fast and the fused op (zeros) treat
    # differently.
    if sinks is not None or not (mask is None or isinstance(mask, str)):
        return False
    if not isinstance(keys, mx.array):
        return False  # quantized caches hand over (data, scales, biases) tuples
    # A wrapped rotating cache (a sliding window: Gemma 3's local layers) holds its keys out of
    # temporal order, which a causal mask over several queries needs; one query sees every key of
    # the window, and mlx-lm's own call then attends the whole buffer unmasked, as the op does.
    if isinstance(cache, _rotating) and cache.offset > cache.max_size and queries.shape[-2] > 1:
        return False
    shape = queries.shape
    return use_fused(shape[-2], keys.shape[-2], shape[-1], mask, dtype=queries.dtype)


def _fused_quantized(queries, keys, cache, mask, sinks) -> bool:
    """The same question for a QuantizedKVCache (it hands over (codes, scales, biases) tuples)."""
    if sinks is not None or not (mask is None or isinstance(mask, str)):
        return False
    if not (hasattr(cache, "bits") and isinstance(keys, tuple | list)):
        return False
    shape = queries.shape
    return use_fused_quantized(
        shape[-2],
        keys[0].shape[-2],
        mask,
        head_dim=shape[-1],
        dtype=queries.dtype,
        group_size=cache.group_size,
    )


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks: mx.array | None = None
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` signature: decode steps the guard accepts run the
    fused DecodeAttention op (or, over a quantized cache, decode_attention_quantized), every
    other call runs mlx-lm's own function."""
    if _enabled and _fused(queries, keys, cache, mask, sinks):
        try:
            out = decode_attention_custom(queries, keys, values, scale=scale, mask=mask)
        except ValueError:
            pass  # inputs the op does not take (mixed dtypes, K and V head dims differ, ...)
        else:
            _calls["fused"] += 1
            return out
    if _enabled and _fused_quantized(queries, keys, cache, mask, sinks):
        try:
            out = decode_attention_quantized(
                queries, keys, values, scale=scale, mask=mask,
                group_size=cache.group_size, bits=cache.bits,
            )  # fmt: skip
        except ValueError:
            pass  # a layout the op does not take
        else:
            _calls["fused_quantized"] += 1
            return out
    _calls["mlx_lm"] += 1
    original = _original or _mlx_lm_modules()[0].scaled_dot_product_attention  # never enabled
    return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _rebind(old, new) -> int:
    """Point every loaded module's NAME that is `old` at `new` (not this module's own)."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is globals():
            continue
        if isinstance(namespace, dict) and namespace.get(NAME) is old:
            setattr(module, NAME, new)
            count += 1
    return count


def enable(fused_step: bool = True, linear: bool | str | None = None) -> None:
    """Send mlx-lm's decode attention through the fused kernel (idempotent). Starts calls()
    from zero when it was disabled.

    fused_step: also run the decode steps of mlx-lm's llama (mistral), qwen2, qwen3, qwen3_moe,
    gemma3_text and phi3 attention (step.STEP_MODELS) as one `attention_step` (q/k norm where
    the model has it, RoPE, cache write, attention) where the guard accepts them. False leaves
    mlx-lm's attention methods as they are (only the attention function is replaced), or puts
    them back if an earlier call replaced them.
    linear: also run decode-sized calls of mlx.nn's linear layers through decode_linear where
    the guard accepts them. None (default): every call where the guard's linear limits for the
    default device's backend start at one row (the CPU); where they start at two (CUDA) only the
    calls of mlx-lm's batched decode steps (GenerationBatch.next: a single request's step would
    pay the wrapped layers' Python on every call for nothing); where the backend has no limits,
    none. True: every call (on CUDA also speculative verify steps); False keeps (or puts back)
    MLX's matmuls. A value of linear_routing() ("all", "batches", "off") sets that routing."""
    global _enabled, _original, _rotating
    routing = _linear_routing_for(linear)
    base, cache = _mlx_lm_modules()
    with _lock:
        if not _enabled:
            _calls.update(fused=0, fused_quantized=0, fused_step=0, mlx_lm=0, linear=0)
            current = base.scaled_dot_product_attention
            if current is not scaled_dot_product_attention:
                _original = current
            _rotating = cache.RotatingKVCache
            _rebind(_original, scaled_dot_product_attention)
            _fold_rows(True)
            _enabled = True
        types = step.CacheTypes(
            cache.KVCache,
            cache.QuantizedKVCache,
            cache.BatchKVCache,
            cache.BatchRotatingKVCache,
            cache.RotatingKVCache,
        )
        _set_fused_step(fused_step, types)
        _set_linear_routing(routing)


def _linear_routing_for(linear) -> str:
    """enable()'s `linear` as a linear_routing() value (None: the default device's backend's)."""
    if linear is None:
        if guard.linear_rows() == 0:
            return "off"
        return "all" if guard.linear_min_rows() == 1 else "batches"
    if linear is True or linear is False:
        return "all" if linear else "off"
    if linear not in ("all", "batches", "off"):
        raise ValueError(
            "[enable] linear must be True, False, None or one of 'all', 'batches', 'off'; "
            f"got {linear!r}"
        )
    return linear


def _set_fused_step(on: bool, types: step.CacheTypes | None = None) -> None:
    if on and not _replaced:
        for name, model in step.STEP_MODELS.items():
            attention = importlib.import_module(f"mlx_lm.models.{name}").Attention
            _replaced[attention] = attention.__dict__["__call__"]
            attention.__call__ = step.fused_call(_replaced[attention], types, _calls, model)
    elif not on:
        for attention, call in _replaced.items():
            attention.__call__ = call
        _replaced.clear()


def _fold_rows(on: bool) -> None:
    import mlx.nn as nn

    methods = ((nn.QuantizedLinear, "__call__"), (nn.QuantizedEmbedding, "as_linear"))
    if on and not _folded:
        for cls, name in methods:
            _folded[(cls, name)] = cls.__dict__[name]
            setattr(cls, name, step.fold_rows(_folded[(cls, name)]))
    elif not on:
        for (cls, name), method in _folded.items():
            setattr(cls, name, method)
        _folded.clear()


def _linear_call(method):
    """A linear layer's forward `method` that runs decode_linear where the guard accepts x."""

    def call(self, x, *args, **kwargs):
        routed = not args and not kwargs and linear_rows_routed(x)
        out = guarded_linear(x, layer_weights(self)) if routed else None
        if out is None:
            return method(self, x, *args, **kwargs)
        _calls["linear"] += 1
        return out

    call.__wrapped__ = method
    return call


# mlx-lm's modules whose MLP is down_proj(swiglu(gate_proj(x), up_proj(x))): enable() runs the
# SwiGLU inside down_proj's decode_linear. Each method is checked against this line first.
SWIGLU_MLPS = ("llama", "qwen2", "qwen3", "qwen3_moe")
SWIGLU_LINE = "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"


def swiglu_mlp(cls: type) -> bool:
    """Whether `cls.__call__` (an mlx-lm MLP's own) is exactly SWIGLU_LINE after its signature."""
    return _is_swiglu_method(cls.__dict__.get("__call__"))


@functools.cache
def _is_swiglu_method(method) -> bool:
    """swiglu_mlp's reading of the source, once per method (the batch routing asks every step)."""
    try:
        lines = [line.strip() for line in inspect.getsource(method).splitlines()]
    except (OSError, TypeError):
        return False
    return lines[1:] == [SWIGLU_LINE]


def _swiglu_call(method):
    """An MLP's forward `method` that applies the SwiGLU inside down_proj where the guard accepts
    it; elsewhere the same layers and mlx-lm's swiglu as `method` (or `method` itself)."""
    from mlx_lm.models.activations import swiglu

    def call(self, x):
        if not linear_rows_routed(x):
            return method(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        out = guarded_linear(up, layer_weights(self.down_proj), gate=gate)
        if out is None:
            return self.down_proj(swiglu(gate, up))
        _calls["linear"] += 1
        return out

    call.__wrapped__ = method
    return call


def _route_linear(on: bool) -> None:
    import mlx.nn as nn

    methods = (
        (nn.Linear, "__call__"),
        (nn.QuantizedLinear, "__call__"),
        (nn.Embedding, "as_linear"),
        (nn.QuantizedEmbedding, "as_linear"),
    )
    if on and not _routed:
        for cls, name in methods:
            _routed[(cls, name)] = cls.__dict__[name]
            setattr(cls, name, _linear_call(_routed[(cls, name)]))
        for module in SWIGLU_MLPS:
            mlp = importlib.import_module(f"mlx_lm.models.{module}").MLP
            if swiglu_mlp(mlp):
                _routed[(mlp, "__call__")] = mlp.__dict__["__call__"]
                mlp.__call__ = _swiglu_call(_routed[(mlp, "__call__")])
    elif not on:
        for (cls, name), method in _routed.items():
            setattr(cls, name, method)
        _routed.clear()


def _set_linear_routing(mode: str) -> None:
    """Route the linear layers in every call ("all"), while GenerationBatch.next runs
    ("batches"), or in none ("off")."""
    _route_linear(mode == "all")
    if mode == "batches" and not _batch_steps:
        from mlx_lm.generate import GenerationBatch

        _batch_steps[GenerationBatch] = GenerationBatch.__dict__["next"]
        GenerationBatch.next = _routed_batch_step(_batch_steps[GenerationBatch])
    elif mode != "batches":
        for cls, method in _batch_steps.items():
            cls.next = method
        _batch_steps.clear()


def _routed_batch_step(method):
    """GenerationBatch.next with the linear layers routed while it builds the step (installed on
    entry, removed on return: ~35 µs of Python a step on this 2-vCPU EPYC)."""

    def next(self):
        with _lock:
            own = not _routed  # routed already: linear=True, or another thread's step
            if own:
                _route_linear(True)
        try:
            return method(self)
        finally:
            if own:
                with _lock:
                    _route_linear(False)

    next.__wrapped__ = method
    return next


def disable() -> None:
    """Give every name that holds the fused entry point mlx-lm's function back, and mlx-lm's
    attention classes their own methods (idempotent)."""
    global _enabled
    with _lock:
        if not _enabled:
            return
        _enabled = False
        _set_fused_step(False)
        _set_linear_routing("off")  # before the fold: the routed methods wrap the folded ones
        _fold_rows(False)
        _rebind(scaled_dot_product_attention, _original)


def is_enabled() -> bool:
    return _enabled


def fused_step_enabled() -> bool:
    """Whether mlx-lm's llama, qwen2 and qwen3 attention run the fused step (enable(), unless
    fused_step=False)."""
    return bool(_replaced)


def linear_enabled() -> bool:
    """Whether mlx.nn's linear layers run decode_linear where the guard accepts them, in every
    call (enable(linear=True), or the CPU's default; see linear_routing)."""
    return bool(_routed) and not _batch_steps


def linear_routing() -> str:
    """Where enable() routes the linear layers: "all" (every call), "batches" (mlx-lm's batched
    decode steps: enable()'s default on CUDA) or "off"."""
    return "batches" if _batch_steps else "all" if _routed else "off"


def calls() -> dict[str, int]:
    """Calls since enable(): {"fused": ..., "fused_quantized": ..., "fused_step": ...,
    "mlx_lm": ..., "linear": ...} (attention: decode_attention_custom,
    decode_attention_quantized, attention_step in mlx-lm's llama/qwen2/qwen3 attention, mlx-lm's
    own attention function; linear: layers run through decode_linear)."""
    return dict(_calls)


@contextlib.contextmanager
def enabled(fused_step: bool = True, linear: bool | str | None = None) -> Iterator[None]:
    """enable(fused_step, linear) for the block; afterwards the state before it (disabled, or
    enabled with or without the fused step and the linear layers)."""
    was, had_step, had_linear = _enabled, fused_step_enabled(), linear_routing()
    enable(fused_step, linear)
    try:
        yield
    finally:
        if was:
            enable(had_step, had_linear)
        else:
            disable()
