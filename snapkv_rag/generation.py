"""Generation as plain functions, top to bottom: ``prefill`` -> ``decode`` (``decode_step`` + ``sample``).

    runner = Runner(model, eos_ids=frozenset({2}), pad_id=2)            # a transformers causal LM
    batch = Batch.of([[1, 5, 9, ...], [1, 7, ...]], pad_id=2)           # token ids, left padded
    pre = prefill(runner, batch, {"snapkv": SnapKVConfig(), "full": None}, room=32)
    for event in decode(runner, pre, "snapkv", SamplingOptions(max_new_tokens=32)):
        ...  # Token(row, token_id) as they come, Finished(row, reason, steps, decode_s) per row

``prefill`` runs the prompt once; right after each layer's attention, that layer's K/V are
compressed into one cache per method (:mod:`snapkv_rag.cache`), so that several methods share one
prefill. ``decode`` continues from one of those caches at the original positions: row ``b``'s next
token sits at position ``len(prompt_b)``, whatever its cache holds.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from . import attention, structured
from .cache import KVCache, layer_specs
from .sampling import SamplingOptions


@dataclass(frozen=True)
class Token:
    """Row ``row`` produced ``token_id`` (not an end-of-sequence token)."""

    row: int
    token_id: int


@dataclass(frozen=True)
class Finished:
    """Row ``row`` is done: ``reason`` is ``"stop"`` (end of sequence, or the caller stopped it) or
    ``"length"``; the decode forward passes that ran for it took ``step_ms`` each."""

    row: int
    reason: str
    step_ms: tuple[float, ...]

    @property
    def steps(self) -> int:
        return len(self.step_ms)

    @property
    def ms_per_token(self) -> float:
        return sum(self.step_ms) / len(self.step_ms) if self.step_ms else 0.0


@dataclass
class Runner:
    """A transformers causal LM and how to call it: one forward pass at a time (``lock``), its
    base attention implementation, MLP slicing for long prompts, an optional compiled step."""

    model: Any
    eos_ids: frozenset[int]
    pad_id: int
    base: str = "sdpa"
    prefill_chunk: int | None = 4096
    compile: bool | str = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    _compiled: Any = None

    def __post_init__(self) -> None:
        params = inspect.signature(self.model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.specs = layer_specs(self.model.config, self.model)
        self.device = next(self.model.parameters()).device

    def forward(self, input_ids, attention_mask, position_ids, cache: KVCache, compiled: bool = False) -> torch.Tensor:
        """One model call under the lock; returns the last position's logits ``[B, V]``."""
        step = self._compiled_step() if compiled else self._step
        with self.lock, torch.inference_mode():
            attention.attach(self.model, self.base)
            logits = step(input_ids, attention_mask, position_ids, cache)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        return logits

    def _step(self, input_ids, attention_mask, position_ids, cache):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  self.cache_kwarg: cache, "use_cache": True, attention.CACHE_KWARG: cache}
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

    def _compiled_step(self):
        if self._compiled is None:
            self._compiled = torch.compile(self._step, mode=None if self.compile is True else self.compile)
        return self._compiled


@dataclass
class Batch:
    """Prompts as token ids, left padded to one length: ``ids``/``mask`` ``[B, L]``, ``lengths`` [B]."""

    ids: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]

    @classmethod
    def of(cls, prompts: list[list[int]], pad_id: int, device=None) -> Batch:
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompts: expected non-empty lists of token ids")
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        return cls(ids.to(device), mask.to(device), lengths)

    @property
    def padded(self) -> bool:
        return len(set(self.lengths)) > 1


@dataclass
class Prefilled:
    """What :func:`prefill` returns: one cache per method, the next-token logits, and timings."""

    batch: Batch
    caches: dict[str, KVCache]
    logits: torch.Tensor
    prefill_s: float

    def selection_ms(self, name: str) -> float:
        return 1000 * self.caches[name].selection_s


def prefill(runner: Runner, batch: Batch, compression: Mapping[str, Any] | Any, room: int) -> Prefilled:
    """Run the prompts once and fill one cache per method of ``compression`` (a mapping from a name
    to a config, ``None`` for the full cache; or a single config, named ``""``), each with ``room``
    slots for decoding. Only the stored caches differ: the prefill itself sees the whole prompt."""
    methods = dict(compression) if isinstance(compression, Mapping) else {"": compression}
    if not methods:
        raise ValueError("compression: give at least one method")
    caches = {name: KVCache(runner.model.config, runner.specs, method) for name, method in methods.items()}
    first, *siblings = caches.values()
    first.open_prefill(siblings, batch.lengths, room)
    positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)
    start = time.perf_counter()
    with attention.sliced_mlps(runner.model, runner.prefill_chunk) if runner.prefill_chunk else contextlib.nullcontext():
        logits = runner.forward(batch.ids, batch.mask if batch.padded else None, positions, first)
    first.close_prefill()
    return Prefilled(batch=batch, caches=caches, logits=logits, prefill_s=time.perf_counter() - start)


def sample(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from ``logits`` ``[B, V]``: argmax when greedy, else temperature + top-p."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / options.temperature, dim=-1)
    if options.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > options.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def decode_step(runner: Runner, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                compiled: bool = False) -> torch.Tensor:
    """Feed ``tokens`` ``[B]`` at ``positions`` ``[B]``; returns the next logits ``[B, V]``."""
    with torch.inference_mode():
        cache.begin_step(positions)
    return runner.forward(tokens[:, None], None, positions[:, None], cache, compiled=compiled)


def decode(runner: Runner, pre: Prefilled, name: str, options: SamplingOptions,
           stopped: set[int] | None = None, constraints: Sequence[Any] | None = None) -> Iterator[Token | Finished]:
    """Decode from ``pre.caches[name]`` until every row is finished. The caller may add rows to
    ``stopped`` (e.g. when a stop string appeared): they get no more tokens and finish as "stop".
    ``constraints`` has one :class:`~snapkv_rag.structured.Constraint` (or ``None``) per row: a
    constrained row samples only tokens its grammar allows, and every token it samples is fed back."""
    cache = pre.caches[name]
    batch = len(pre.batch.lengths)
    stopped = set() if stopped is None else stopped
    generator = options.generator()
    eos_ids = frozenset() if options.ignore_eos else runner.eos_ids
    compiled = bool(runner.compile) and cache.recorder is None and cache.make_static() is not None
    positions = torch.tensor(pre.batch.lengths, device=runner.device)
    logits, step_ms = pre.logits, []
    done: set[int] = set()
    constraints = list(constraints) if constraints is not None else [None] * batch
    constrained = any(c is not None for c in constraints)
    if constrained:  # masked in place below: leave the prefill's logits to other decodes of it
        logits = logits.clone()
    for step in range(options.max_new_tokens):
        if constrained:
            structured.apply_masks(logits, [None if row in done else c for row, c in enumerate(constraints)])
        tokens = sample(logits, options, generator)
        picked = tokens.tolist()  # one device-to-host copy per step, not one per row
        for row in range(batch):
            if row in done:
                continue
            if constraints[row] is not None and row not in stopped:
                constraints[row].accept(picked[row])
            if row in stopped or picked[row] in eos_ids:
                done.add(row)
                yield Finished(row, "stop", tuple(step_ms))
            else:
                yield Token(row, picked[row])
                if row in stopped:  # the caller stopped it on this very token
                    done.add(row)
                    yield Finished(row, "stop", tuple(step_ms))
        if len(done) == batch or step == options.max_new_tokens - 1:
            break
        begin = time.perf_counter()
        logits = decode_step(runner, cache, tokens, positions, compiled)  # synchronised on CUDA
        step_ms.append(1000 * (time.perf_counter() - begin - cache.record_s))
        cache.record_s = 0.0
        positions = positions + 1
    for row in range(batch):
        if row not in done:
            yield Finished(row, "length", tuple(step_ms))
