"""Batched generation: many requests decoded together, each at its own length, as continuous
batching does it (mlx-lm's BatchGenerator and batch_generate, on our caches).

The batch cache holds `slots` rows; a request takes a free row, its prompt is prefilled alone
(a single-request cache, then copied into the row), and from then on every decode step runs all
rows in one forward pass: attention_step writes each row's new position at the row's own length
and attends to [0, length] of it, in place, so requests join and leave without re-laying the
others out (mlx-lm pads and concatenates the whole batch cache then). A finished request frees
its row at once.

    from qwen3_model import batch_generate
    out = batch_generate(model, [[1, 2, 3], [4, 5]], max_tokens=32)
    out.token_ids  # per prompt, in order
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from attn_kernels import graph_limits
from attn_kernels.guard import BATCH_GRAPH_LIMITS

from qwen3_model.cache import KVCache, make_cache

Sampler = Callable[[mx.array], mx.array]


def batch_stream() -> mx.Stream:
    """The default device's stream for batched generation (made on first use), apart from
    generate_step's: on CUDA each of its graphs holds a whole decode step
    (guard.BATCH_GRAPH_LIMITS: with MLX's defaults, several graphs a step; docs/serving-cuda.md)."""
    from qwen3_model.generate import own_stream  # generate imports the model, which imports us

    return own_stream("batch", lambda stream: graph_limits(stream, *BATCH_GRAPH_LIMITS))


class DeviceLengths:
    """The rows' lengths as an int32 (rows,) array for the steps' AttentionStep, kept beside the
    generator's list: rebuilt from the list where rows join or leave (reset), advanced on the
    device in a step (each running row + 1). Made from the list in every layer, the array waited
    for the step in flight while the next one was built (12 ms a step at 32 slots, H100; the
    suspect, not measured: MLX's CUDA allocator hands host data a cached device buffer and moves
    it to unified memory with a synchronous copy)."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.array: mx.array | None = None
        self._running: tuple[bool, ...] | None = None
        self._increment: mx.array | None = None

    def current(self) -> mx.array:
        if self.array is None:
            self.array = mx.array(self.lengths, dtype=mx.int32)
        return self.array

    def reset(self) -> None:
        """The list changed other than by advance(): rebuild the array at its next use."""
        self.array = None

    def advance(self, running: Sequence[bool]) -> None:
        """One step: the running rows' lengths + 1 in the list and (lazily) in the array."""
        running = tuple(running)
        for row, on in enumerate(running):
            self.lengths[row] += on
        if self.array is None:
            return
        if running != self._running:
            self._running, self._increment = running, mx.array(running, dtype=mx.int32)
        self.array = self.array + self._increment


class BatchKVCache:
    """One layer's keys and values of `len(lengths)` rows, (rows, Hkv, capacity, D), capacity a
    multiple of `step`. Row b holds positions [0, lengths[b]); `lengths` is shared by every layer
    of the model and advanced by the generator once per step (each layer reads it as the step's
    write positions), `device_lengths` (optional, shared too) the same as an array."""

    step = 256

    def __init__(self, lengths: list[int], device_lengths: DeviceLengths | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths = lengths
        self.device_lengths = device_lengths

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, dtype: mx.Dtype, b: int, h: int, length: int, d: int) -> tuple:
        """The buffers, grown for every row (a copy, once every `step` positions of the longest
        row) to hold `length` more positions of the longest row."""
        return self._grow_to(max(self.lengths) + length, dtype, b, h, d)

    def _grow_to(self, end: int, dtype: mx.Dtype, b: int, h: int, d: int) -> tuple:
        if end > self.capacity:
            capacity = -(-end // self.step) * self.step
            grown_k = mx.zeros((b, h, capacity, d), dtype)
            grown_v = mx.zeros((b, h, capacity, d), dtype)
            if self.keys is not None:
                grown_k[:, :, : self.capacity] = self.keys
                grown_v[:, :, : self.capacity] = self.values
            self.keys, self.values = grown_k, grown_v
        return self.keys, self.values

    def advance(self, keys: mx.array, values: mx.array) -> None:
        """Take the buffers an AttentionStep returned; hold only these, so that the next step
        writes them in place (attention_step's owned_caches)."""
        self.keys, self.values = keys, values

    def write_row(self, row: int, prefilled: KVCache) -> None:
        """A request's prefilled cache (positions [0, prefilled.offset)) into `row` (in place
        where nothing else holds the buffers: no step in flight)."""
        n = prefilled.offset
        _, h, _, d = prefilled.keys.shape
        self._grow_to(n, prefilled.keys.dtype, len(self.lengths), h, d)
        self.keys[row : row + 1, :, :n] = prefilled.keys[:, :, :n]
        self.values[row : row + 1, :, :n] = prefilled.values[:, :, :n]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass
class BatchResponse:
    """One request's new token from BatchGenerator.next(): finish_reason None, "stop" (a stop
    token: mlx-lm leaves it out of the text) or "length"."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None


@dataclass
class _Request:
    uid: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None
    stop: frozenset[int]
    row: int = -1
    generated: int = 0
    done: bool = False
    first_token_time: float = 0.0


@dataclass
class _Step:
    """A decode step in flight: its sampled tokens and logprobs, and the request of each row."""

    tokens: mx.array
    logprobs: mx.array
    rows: list[_Request | None]


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class BatchGenerator:
    """Continuous batching over `slots` rows: insert() queues requests, next() runs one decode
    step of every active request and returns their new tokens (the first call for a new request
    also prefills it), remove() drops requests. Steps are pipelined as mlx-lm's: the next step is
    queued before this one's tokens are read; admitting a request waits for the step in flight
    (its prefill is written into the batch cache in place then)."""

    def __init__(
        self,
        model,
        *,
        slots: int = 32,
        max_tokens: int = 256,
        sampler: Sampler | None = None,
        stop_tokens: Sequence[int] = (),
        prefill_step_size: int = 2048,
        stream: mx.Stream | None = None,
    ):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model = model
        self.slots = slots
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.stop_tokens = frozenset(stop_tokens)
        self.prefill_step_size = prefill_step_size
        self.stream = stream or batch_stream()
        self.lengths = [0] * slots
        self.device_lengths = DeviceLengths(self.lengths)
        self.cache = [BatchKVCache(self.lengths, self.device_lengths) for _ in model.layers]
        self._rows: list[_Request | None] = [None] * slots
        self._inputs = mx.zeros((slots,), mx.uint32)  # each row's next input token
        self._waiting: deque[_Request] = deque()
        self._inflight: _Step | None = None
        self._next_uid = 0
        self.stats = BatchStats()

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int] | None = None,
        samplers: Sequence[Sampler | None] | None = None,
        stop_tokens: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """Queue requests (non-empty lists of token ids); per request max_tokens, sampler
        (None: the generator's) and stop tokens (None: the generator's). Returns their uids."""
        n = len(prompts)
        if max_tokens is None:
            max_tokens = self.max_tokens
        limits = list(max_tokens) if isinstance(max_tokens, Sequence) else [max_tokens] * n
        samplers = samplers if samplers is not None else [None] * n
        stops = stop_tokens if stop_tokens is not None else [None] * n
        for name, values in (
            ("max_tokens", limits),
            ("samplers", samplers),
            ("stop_tokens", stops),
        ):
            if len(values) != n:
                raise ValueError(f"{name} must have one entry per prompt ({n}), got {len(values)}")
        uids = []
        for prompt, limit, sampler, stop in zip(prompts, limits, samplers, stops, strict=True):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {self._next_uid} is empty")
            if limit < 1:
                raise ValueError(f"max_tokens must be >= 1, got {limit}")
            stop = self.stop_tokens if stop is None else frozenset(stop)
            self._waiting.append(_Request(self._next_uid, prompt, limit, sampler, stop))
            uids.append(self._next_uid)
            self._next_uid += 1
        return uids

    def remove(self, uids: Sequence[int]) -> None:
        """Drop requests, waiting or running (a running one's row is free from the next step)."""
        drop = set(uids)
        self._waiting = deque(r for r in self._waiting if r.uid not in drop)
        for row, request in enumerate(self._rows):
            if request is not None and request.uid in drop:
                self._free(row)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def next(self) -> list[BatchResponse]:
        """One decode step of every active request (after admitting waiting ones into free rows):
        their new tokens. Empty when no request is left."""
        with mx.stream(self.stream):
            responses = []
            if self._waiting and None in self._rows and self._inflight is not None:
                responses += self._read(self._inflight)  # frees the cache buffers for the prefill
                self._inflight = None
            self._admit()
            if self._inflight is None:
                if not self.active:
                    return responses
                self._inflight = self._launch()
            current = self._inflight
            self._inflight = self._launch() if self.active else None
            responses += self._read(current)
            return responses

    def _free(self, row: int) -> None:
        self._rows[row].done = True
        self._rows[row] = None
        self.lengths[row] = 0
        self.device_lengths.reset()

    def _admit(self) -> None:
        """Prefill waiting requests into free rows: all but the last prompt token alone (a
        single-request cache, in chunks), then copied into the row; the last token is the row's
        next input."""
        for row in range(self.slots):
            if not self._waiting:
                return
            if self._rows[row] is not None:
                continue
            request = self._waiting.popleft()
            start = time.perf_counter()
            head = request.prompt[:-1]
            if head:
                prefilled = make_cache(self.model)
                tokens = mx.array(head)
                for at in range(0, len(head), self.prefill_step_size):
                    self.model(tokens[None, at : at + self.prefill_step_size], prefilled)
                    mx.eval([c.state for c in prefilled])
                for layer, single in zip(self.cache, prefilled, strict=True):
                    layer.write_row(row, single)
                mx.eval([(c.keys, c.values) for c in self.cache])
            self.lengths[row] = len(head)
            self.device_lengths.reset()
            self._inputs[row] = request.prompt[-1]
            request.row = row
            self._rows[row] = request
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.prompt_time += time.perf_counter() - start

    def _launch(self) -> _Step:
        """Queue one decode step of every row: inputs (rows, 1), each row at its own length."""
        start = time.perf_counter()
        rows = list(self._rows)
        logits = self.model(self._inputs[:, None], self.cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = {id(r.sampler): r.sampler for r in rows if r is not None}
        if len(samplers) == 1:
            sampler = next(iter(samplers.values())) or self.sampler or _greedy
            tokens = sampler(logprobs)
        else:
            tokens = mx.concatenate(
                [
                    ((r.sampler or self.sampler or _greedy) if r else _greedy)(logprobs[i : i + 1])
                    for i, r in enumerate(rows)
                ]
            )
        tokens = tokens.astype(mx.uint32)
        built = time.perf_counter()
        mx.async_eval(tokens, logprobs)
        self.stats.build_time += built - start
        self.stats.encode_time += time.perf_counter() - built
        self.device_lengths.advance([r is not None for r in rows])
        self._inputs = tokens
        return _Step(tokens, logprobs, rows)

    def _read(self, step: _Step) -> list[BatchResponse]:
        """The step's tokens for the requests still running; finished ones free their rows."""
        start = time.perf_counter()
        tokens = step.tokens.tolist()
        now = time.perf_counter()
        self.stats.decode_time += now - start
        responses = []
        for row, request in enumerate(step.rows):
            if request is None or request.done:
                continue
            token = tokens[row]
            request.generated += 1
            if request.generated == 1:
                request.first_token_time = now
            reason = (
                "stop"
                if token in request.stop
                else "length"
                if request.generated >= request.max_tokens
                else None
            )
            responses.append(BatchResponse(request.uid, token, step.logprobs[row], reason))
            if reason is not None:
                self._free(row)
        self.stats.generation_tokens += len(responses)
        return responses


@dataclass
class BatchStats:
    """What a BatchGenerator did (mlx-lm's BatchStats' fields): prompt and generated tokens and
    the time spent on each (tokens per second derived). Of the decode steps' host time, besides:
    building their graphs (build_time) and MLX's encoding of them (encode_time: async_eval's
    return, which also waits for the device where MLX's command buffers in flight are at its cap)."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0
    build_time: float = 0.0
    encode_time: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.decode_time if self.decode_time else 0.0


@dataclass
class BatchResult:
    """batch_generate's answer, per prompt in order: the generated token ids (a stop token left
    out, as mlx-lm does), the text where a tokenizer was given, why each ended; and the stats."""

    token_ids: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: BatchStats = field(default_factory=BatchStats)


def batch_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int] = 256,
    tokenizer=None,
    *,
    sampler: Sampler | None = None,
    samplers: Sequence[Sampler | None] | None = None,
    stop_tokens: Sequence[int] | None = None,
    slots: int = 32,
    prefill_step_size: int = 2048,
    verbose: bool = False,
) -> BatchResult:
    """Generate for every prompt (lists of token ids) at once, as mlx-lm's batch_generate:
    continuous batching over `slots` rows (more prompts than rows wait for a free one), per-prompt
    max_tokens and samplers (default greedy), stop tokens (default: the tokenizer's
    eos_token_ids). Returns per prompt, in order, its token ids and, with a tokenizer (anything
    with decode(ids)), its text."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if stop_tokens is None:
        stop_tokens = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    gen = BatchGenerator(
        model,
        slots=max(1, min(slots, len(prompts))),  # 1 row for an empty list: nothing to do
        sampler=sampler,
        stop_tokens=stop_tokens,
        prefill_step_size=prefill_step_size,
    )
    uids = gen.insert(prompts, max_tokens, samplers)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    reasons: dict[int, str] = {}
    start = time.perf_counter()
    while responses := gen.next():
        for r in responses:
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                reasons[r.uid] = r.finish_reason
                if verbose:
                    print(f"[batch_generate] finished {len(reasons)}/{len(uids)}", end="\r")
    gen.stats.decode_time = time.perf_counter() - start - gen.stats.prompt_time
    ids = [tokens[uid] for uid in uids]
    texts = [tokenizer.decode(t) for t in ids] if tokenizer is not None else None
    if verbose:
        s = gen.stats
        print(
            f"\n[batch_generate] prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s; "
            f"generation: {s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s"
        )
    return BatchResult(ids, texts, [reasons[uid] for uid in uids], gen.stats)
