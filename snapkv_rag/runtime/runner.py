"""The model runner: executes what the scheduler decides (nano-vllm / vLLM v1 style).

    runner = Runner(model, eos_ids=frozenset({2}), pad_id=2)      # attention attached once
    pre = runner.prefill([[1, 5, 9, ...]], {"snapkv": SnapKVConfig(), "full": None})
    slots = runner.new_slots(max_rows=16)
    slots.join(0, pre.compressed["snapkv"][0], room=32, token=first)
    tokens = runner.decode_step(slots, slots.batch_rows())          # on the device, no host sync
    runner.to_host(tokens)                                         # the step's one copy
    runner.close()                                                 # the model's attention back

:meth:`Runner.prefill` runs the prompts once inside ``with compressing(cache, methods, lengths)``:
each attention layer is compressed right after its attention, once per method, so several methods
share one prefill. With a ``boundary`` (a RAG prompt's tokens before its question) and a prefix
cache, a prompt whose prefix was prefilled before runs only its rest on top of the cached K/V
(:mod:`snapkv_rag.kv.prefix_cache`); the compression is the same. :meth:`Runner.decode_step` runs one token for rows ``[0, b)`` of a
:class:`~snapkv_rag.kv.slot_cache.SlotCache` and picks the next tokens on the device: greedy inside the
step; rows that sample or follow a grammar are picked by the caller's ``pick`` after it.

With ``kv_dtype`` (``"int8"``, ``"fp8"``: :mod:`snapkv_rag.kv.quantized`) every kept cache a
prefill returns is quantized after its selection (:meth:`Runner.stored_as`), and the slot caches
it makes hold 8-bit buffers with their scales.

A step reads each row's slots in use, not the allocation (:meth:`SlotCache.view_length`), and picks
its tokens inside itself: greedy, or sampled from each row's own settings
(:class:`~snapkv_rag.runtime.sampling.SamplingSlots`); only rows under a grammar (or asking for
logprobs) take the logits out to the caller's ``pick``.

With ``compile``, the step goes through ``torch.compile`` (inductor, ``fullgraph=True``): one
function for every batch bucket and view length (those sizes become symbolic after their first
change, so a few compiles in all, logged). On CUDA ``compile=True`` then captures the compiled step
in a ``torch.cuda.CUDAGraph`` per (batch bucket, view length, sampling kind, allocation) and replays
it: inductor's fused kernels with no launch gaps. ``compile="eager-graph"`` captures the unfused
eager step instead (the fallback, also taken, with the reason logged, where compiling fails);
another ``torch.compile`` mode name is handed to ``torch.compile`` as it is (no capture of ours).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..kv import prefix_cache, quantized, tails
from ..kv.prefix_cache import PrefixCache
from ..kv.prompt_cache import Compressed, PromptCache, compressing
from ..kv.slot_cache import SlotCache
from ..models import layer_kinds
from . import attention
from . import draft as lookahead
from .sampling import GREEDY, SamplingSlots, sample

LOGITS = "logits"  # a step that returns the logits, for a caller's pick (grammars, logprobs)
EAGER_GRAPH = "eager-graph"  # compile= value: the eager step captured in CUDA graphs, not compiled
# graphs per step function: every (sampling kind, batch-size class) pair compiles once or twice
# before its sizes turn symbolic; dynamo's default limit (8) would leave later ones eager
_RECOMPILE_LIMIT = 64

log = logging.getLogger("snapkv_rag")


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
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        return cls(ids.to(device), mask.to(device), lengths)

    @property
    def padded(self) -> bool:
        return len(set(self.lengths)) > 1


@dataclass
class Prefilled:
    """What :meth:`Runner.prefill` returns: per method one :class:`Compressed` per prompt, the
    next-token logits ``[B, V]`` and the prefill's wall time (selection included)."""

    compressed: dict[str, list[Compressed]]
    logits: torch.Tensor
    prefill_s: float
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled


class Runner:
    """A transformers causal LM and how to run it: one forward pass at a time (``lock``), its base
    attention implementation (attached at construction, restored by :meth:`close`), MLP slicing for
    long prompts, compiled decode steps."""

    def __init__(
        self,
        model,
        eos_ids: frozenset[int],
        pad_id: int,
        base: str = "sdpa",
        prefill_chunk: int | None = 4096,
        compile: bool | str = False,
        prefix_cache: PrefixCache | None = None,
        kv_dtype: str | None = None,
    ):
        self.model, self.eos_ids, self.pad_id, self.base = model, eos_ids, pad_id, base
        self.prefix_cache = prefix_cache
        self.prefill_chunk, self.compile = prefill_chunk, compile
        self.lock = threading.Lock()
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.specs = layer_kinds.layer_specs(
            model.config, model
        )  # (refuses an unsupported model here, before any work)
        self.device = next(model.parameters()).device
        # how every kept cache stores its K/V after the selection (kv.quantized): None, "int8", "fp8"
        self.kv_dtype = quantized.check_kv_dtype(kv_dtype, self.device)
        self._steps: dict[tuple, Callable[[], torch.Tensor]] = {}
        self._host: torch.Tensor | None = None
        self._pool = None
        self._eager_logged = False
        self._step_function: Callable | None = None  # the torch.compile'd step, made at first use
        self.fallback: str | None = None  # why compile=True captures the eager step (None: it compiles)
        # the compiled step's attention over the slots: "sdpa" (torch's kernel), or "split" (plain
        # ops that inductor fuses into split-K reductions; for slot caches made after it is set)
        self.decode_attention = "sdpa"
        self.repeat_ids: tuple[int, ...] = ()  # KVzip's repeat instruction, tokenized (set by the engine)
        # why a multi-token pass cannot continue this model's recurrent states (None: it can): then no
        # prompt is split at a cached prefix, and a tail over stored states runs one token per step
        self.state_break = layer_kinds.state_break(model.config, self.specs)
        self.one_pass_tail = self.state_break is None
        self.attach()

    def attach(self) -> None:
        """Route the model's attention through our wrapper: at construction, and checked (a string
        compare) by each prefill, so that the first request after :meth:`close` attaches it again.
        Decode steps never touch it."""
        attention.attach(self.model, self.base)

    def close(self) -> None:
        """Give the model its own attention implementation back (and drop the compiled steps)."""
        attention.detach(self.model)
        self._steps.clear()

    # ------------------------------------------------------------ prompt
    def prefill(
        self,
        prompts: list[list[int]],
        methods: Mapping[str, Any],
        boundary: int | None = None,
        whole: prefix_cache.Capture | None = None,
    ) -> Prefilled:
        """Run ``prompts`` once (left padded) and compress them under every method of ``methods``
        (name -> config, ``None`` for the full cache). Only the kept caches differ: the prefill
        itself sees the whole prompt. The one entry; what runs depends on the methods and the prompt:

        - a method that drafts (lookahead): :func:`snapkv_rag.runtime.draft.prefill`, which comes back
          here with ``whole`` (a capture of every position of the prompt, not stored);
        - a method that re-reads the prompt (KVzip): :meth:`_prefill_rereading`;
        - a ``boundary`` (one RAG prompt: its first ``boundary`` tokens are the document prefix) and a
          prefix cache that may serve it: :meth:`_prefill_cached`;
        - else one plain pass: :meth:`_prefill_plain`.
        The selection is the same whichever path ran, on the prompt's full-precision attention; under
        a ``kv_dtype`` the kept caches are then quantized (:meth:`stored_as`), except in a pass
        that fills ``whole`` (the lookahead draft's, which quantizes what it returns)."""
        self.attach()
        if any(m is not None and m.drafts for m in methods.values()):
            return self.stored_as(lookahead.prefill(self, prompts, methods))
        prefix, capture = (None, None) if whole is not None else self._prefix_plan(prompts, methods, boundary)
        if any(m is not None and m.rereads for m in methods.values()):
            out = self._prefill_rereading(prompts, methods)
        elif prefix is not None or capture is not None:
            out = self._prefill_cached(prompts[0], methods, prefix, capture)
        else:
            out = self._prefill_plain(prompts, methods, capture=whole)
        return out if whole is not None else self.stored_as(out)

    def stored_as(self, pre: Prefilled, heads: list | None = None) -> Prefilled:
        """``pre`` with every kept cache stored as this runner's ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`;
        ``None``: as it is). ``heads``: per layer the quantized slots a cache starts with (a stored
        set's), kept as they are."""
        if self.kv_dtype is None and all(c.kv_dtype is None for rows in pre.compressed.values() for c in rows):
            return pre
        compressed = {
            name: [c.as_kv_dtype(self.kv_dtype, heads) for c in rows] for name, rows in pre.compressed.items()
        }
        return dataclasses.replace(pre, compressed=compressed)

    def _prefill_plain(
        self,
        prompts: list[list[int]],
        methods: Mapping[str, Any],
        prefix=None,
        capture: prefix_cache.Capture | None = None,
    ) -> Prefilled:
        """The prompts in one pass, or one prompt's rest over a cached ``prefix`` (its K/V, last
        queries and recurrent states) at the positions it has in the whole prompt; ``capture`` is
        handed every layer's K/V and last queries as they run."""
        start = time.perf_counter()
        skip = 0 if prefix is None else prefix.length
        batch = Batch.of([p[skip:] for p in prompts], self.pad_id, self.device)
        cache = PromptCache(self.model.config, self.specs, prefix)
        cache.capture = capture
        if prefix is not None:
            tails.with_states(cache, prefix.states)
        positions = (batch.mask.cumsum(-1) - 1).clamp(min=0) + skip
        lengths = [length + skip for length in batch.lengths]
        with self.lock, torch.inference_mode(), self.sliced_mlps(), compressing(cache, methods, lengths) as compressed:
            logits = self.forward(batch.ids, batch.mask if batch.padded else None, positions, cache)
        return self._prefilled(compressed, logits, start, cached_tokens=skip)

    def _prefill_cached(self, prompt: list[int], methods: Mapping[str, Any], prefix, capture) -> Prefilled:
        """A RAG prompt whose document prefix the prefix cache serves (:mod:`snapkv_rag.kv.prefix_cache`):
        on a hit (``prefix``) only its rest runs; on a miss the whole prompt runs with the prefix
        captured, then stored. A model with recurrent layers has their states at the prefix's end
        only after a pass that ends there: on a miss the prefix runs alone (stored), then the rest
        from it as on a hit, counted as no cached tokens."""
        if prefix is not None:
            return self._prefill_plain([prompt], methods, prefix=prefix)
        begin = time.perf_counter()
        if any(spec.state for spec in self.specs):
            out = self._prefill_plain([prompt], methods, prefix=self._prefix_pass(prompt, capture))
            return dataclasses.replace(out, prefill_s=time.perf_counter() - begin, cached_tokens=0)
        out = self._prefill_plain([prompt], methods, capture=capture)
        if not capture.too_big:
            self.prefix_cache.store(capture.prefix(prompt, len(self.specs)))
        return dataclasses.replace(out, prefill_s=time.perf_counter() - begin)

    def _prefill_rereading(self, prompts: list[list[int]], methods: Mapping[str, Any]) -> Prefilled:
        """KVzip's context reconstruction: one prompt, then the repeat instruction and the prompt again
        in the same pass (:meth:`_with_reread`); the re-read's queries vote for that method and its
        positions are cut off for every method. A model with recurrent layers runs the prompt alone
        first, for their states after it (the re-read would run them on). No prefix is reused."""
        start = time.perf_counter()
        reread = self._with_reread(prompts, methods)
        prompt = prompts[0]
        states = None
        if any(spec.state for spec in self.specs):
            states = tails.states_only(PromptCache(self.model.config, self.specs))
            with self.lock, torch.inference_mode(), self.sliced_mlps():
                self.forward(
                    torch.tensor([prompt], device=self.device),
                    None,
                    torch.arange(len(prompt), device=self.device)[None],
                    states,
                )
        ids = torch.tensor([prompt + reread], device=self.device)
        cache = PromptCache(self.model.config, self.specs)
        with (
            self.lock,
            torch.inference_mode(),
            self.sliced_mlps(),
            compressing(cache, methods, [len(prompt)], reread=len(reread), states=states) as compressed,
        ):
            logits = self.forward(
                ids, None, torch.arange(ids.shape[-1], device=self.device)[None], cache, at=len(prompt) - 1
            )
        return self._prefilled(compressed, logits, start)

    def _prefilled(self, compressed: dict, logits: torch.Tensor, start: float, cached_tokens: int = 0) -> Prefilled:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # prefill time is wall time of the work, not its launch
        return Prefilled(
            compressed=compressed, logits=logits, prefill_s=time.perf_counter() - start, cached_tokens=cached_tokens
        )

    def _prefix_pass(self, prompt: list[int], capture) -> prefix_cache.Prefix | None:
        """A model with recurrent layers storing a prompt's prefix: their states at its end exist only
        after a pass that ends there, so the prefix runs alone (its K/V, last queries and states kept,
        stored) and the rest runs on from it as on a hit. ``None`` if it was too big to keep."""
        cache = tails.capture_only(PromptCache(self.model.config, self.specs), capture)
        with self.lock, torch.inference_mode(), self.sliced_mlps():
            self.forward(
                torch.tensor([prompt[: capture.length]], device=self.device),
                None,
                torch.arange(capture.length, device=self.device)[None],
                cache,
            )
        if capture.too_big:
            return None
        prefix = capture.prefix(prompt, len(self.specs), tails.states_of(cache, self.specs))
        self.prefix_cache.store(prefix)
        return prefix

    def prefill_stored(self, stored, ids: list[int]) -> Prefilled:
        """Run only ``ids[stored.length:]`` (the tail of a prompt over a stored compressed document
        set, :mod:`snapkv_rag.documents.store`) on top of the stored kept K/V, at the positions the tail has
        in the whole prompt; the tail is kept whole (:mod:`snapkv_rag.kv.tails`); recurrent layers
        start from the stored states (one token per step where transformers cannot continue them
        in one pass: ``one_pass_tail``). A stitched document prompt
        (:mod:`snapkv_rag.documents.stitch`) prefills itself."""
        self.attach()
        if hasattr(stored, "prefill"):
            return self.stored_as(stored.prefill(self, ids))
        start = time.perf_counter()
        heads = stored.layers  # the stored layers padded again (8-bit under a kv_dtype)
        prefix = stored.prefix(heads)  # ... and in floats, for this prefill
        cache = PromptCache(self.model.config, self.specs, prefix)
        with self.lock, torch.inference_mode(), self.sliced_mlps():
            tails.with_states(cache, stored.states)
            if stored.states and not self.one_pass_tail:
                layers, logits = tails.stepwise_tail(self.forward, cache, prefix, ids, self.device)
            else:
                cache.compress = tails.tail_hook(cache, prefix.layers, stored.length, len(ids))
                tail = torch.tensor([ids[stored.length :]], device=self.device)
                positions = torch.arange(stored.length, len(ids), device=self.device)[None]
                logits, layers = self.forward(tail, None, positions, cache), cache.compress.layers
            layers = tails.states_after(cache, layers)
        compressed = Compressed(stored.config, self.specs, layers, len(ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = Prefilled(
            compressed={"": [compressed]},
            logits=logits,
            prefill_s=time.perf_counter() - start,
            cached_tokens=stored.length,
        )
        return self.stored_as(out, list(heads))

    def sliced_mlps(self):
        """While open, the MLPs run over a long prompt in slices of ``prefill_chunk`` tokens."""
        return attention.sliced_mlps(self.model, self.prefill_chunk) if self.prefill_chunk else contextlib.nullcontext()

    def _prefix_plan(self, prompts, methods, boundary):
        """``(prefix to reuse, capture to fill)`` for a prefill: at most one of them, or neither."""
        store = self.prefix_cache
        if boundary is None or store is None or not store.enabled or len(prompts) != 1:
            return None, None
        why = prefix_cache.unsupported(self.specs, self.state_break)
        if why is None and any(m is not None and m.rereads for m in methods.values()):
            why = "KVzip re-reads the whole prompt in its own pass"
        needed = prefix_cache.queries_needed(methods)
        if why is None and needed is None:
            why = "H2O votes with every prompt query"
        if why is not None:
            store.say_once(why)
            return None, None
        hit = store.lookup(prompts[0], limit=boundary, queries=needed)
        return (hit, None) if hit is not None else (None, prefix_cache.Capture(boundary, store.max_bytes))

    def _with_reread(self, prompts: list[list[int]], methods: Mapping[str, Any]) -> list[int]:
        """The tokens a KVzip method's re-read appends to the prompt (none without one): the repeat
        instruction (``repeat_ids``, set by the engine from its tokenizer) and the prompt again."""
        if not any(m is not None and m.rereads for m in methods.values()):
            return []
        name = type(self.model).__name__
        if len(prompts) != 1:
            raise ValueError("kvzip: one prompt per prefill (the re-read follows its own prompt)")
        extra = list(self.repeat_ids) + list(prompts[0])
        context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        if context and len(prompts[0]) + len(extra) > context:
            raise ValueError(
                f"kvzip: the prompt ({len(prompts[0])} tokens) and its re-read need "
                f"{len(prompts[0]) + len(extra)} positions, more than {name}'s {context}; use keynorm "
                "or a shorter prompt"
            )
        return extra

    # ------------------------------------------------------------ decode
    def new_slots(self, max_rows: int) -> SlotCache:
        slots = SlotCache(
            self.model.config, self.specs, max_rows, self.device, keep=bool(self.compile), kv_dtype=self.kv_dtype
        )
        slots.decode_attention = self.decode_attention
        return slots

    def decode_step(
        self,
        slots: SlotCache,
        b: int,
        pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
        sampling: SamplingSlots | None = None,
    ) -> torch.Tensor:
        """One token for rows ``[0, b)`` of ``slots``; returns the next tokens ``[b]`` on the device
        (also fed by the next step). Inside the step: greedy, or each row's own ``sampling``
        settings. ``pick`` (logits -> tokens) replaces both, for rows that follow a grammar: the step
        then returns its logits, and the pick runs after it. No host sync."""
        with self.lock, torch.inference_mode():
            length = slots.view_length(b)
            kind = LOGITS if pick is not None else sampling.kind(b) if sampling is not None else GREEDY
            if self._eager(slots):
                out = self._decode(slots, b, length, kind, sampling)
            else:
                out = self._compiled(slots, b, length, kind, sampling)()
            slots.stepped(b)
            if pick is None:
                return out
            slots.tokens[:b].copy_(pick(out))
            return slots.tokens[:b]

    def _eager(self, slots: SlotCache) -> bool:
        """Whether this step runs eagerly: no ``compile`` (or ``"eager-graph"`` off CUDA), a hit-rate
        recorder reading the step's tensors, or recurrent / conv state layers (said once)."""
        if self.compile and slots.recurrent and not self._eager_logged:
            self._eager_logged = True
            log.info(
                "snapkv_rag: compile is set, but this model has recurrent / conv state layers: its decode "
                "steps run eagerly"
            )
        off = not self.compile or (self.compile == EAGER_GRAPH and self.device.type != "cuda")
        return off or slots.recorder is not None or slots.recurrent

    def to_host(self, tokens: torch.Tensor) -> list[int]:
        """The step's one device-to-host copy: the sampled ids (EOS is read from them on the host).
        On CUDA through a pinned buffer, non-blocking, then waited for on an event."""
        if tokens.device.type != "cuda":
            return tokens.tolist()
        if self._host is None or self._host.numel() < tokens.numel():
            self._host = torch.empty(max(tokens.numel(), 16), dtype=torch.long, pin_memory=True)
        host = self._host[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()

    def _decode(
        self, slots: SlotCache, b: int, length: int, kind: str = GREEDY, sampling: SamplingSlots | None = None
    ) -> torch.Tensor:
        """The step function: marks the slots, runs the model over the rows' first ``length`` slots,
        moves the rows on, and picks the next tokens by ``kind`` (written where the next step reads
        them); ``kind`` :data:`LOGITS` returns the logits instead."""
        positions = slots.begin_step(b, length)
        logits = self.forward(slots.tokens[:b, None], slots.no_mask(b), positions[:, None], slots)
        slots.end_step(b)
        if kind == LOGITS:
            return logits
        tokens = logits.argmax(dim=-1) if kind == GREEDY else sample(logits, sampling, b, kind)
        slots.tokens[:b].copy_(tokens)
        return slots.tokens[:b]

    def _compiled(
        self, slots: SlotCache, b: int, length: int, kind: str, sampling: SamplingSlots | None
    ) -> Callable[[], torch.Tensor]:
        """The step for ``b`` rows over ``length`` slots of this allocation of ``slots``, compiled
        (and on CUDA captured) at first use."""
        key = (id(slots), slots.generation, b, length, kind, id(sampling))
        step = self._steps.get(key)
        if step is not None:
            return step
        for old in [k for k in self._steps if k[0] == id(slots) and k[1] != slots.generation]:
            del self._steps[old]  # a graph of buffers since reallocated
        if not self._steps:
            # no graph left on the pool: once the last one is freed, the allocator retires its pool,
            # and capturing into that pool's handle again fails an internal assert; take a fresh one
            self._pool = None
        what = f"decode step for {b} rows x {length} of {slots.capacity} slots ({kind})"
        if self.device.type == "cuda" and self.compile in (True, EAGER_GRAPH):
            step = self._captured(slots, b, length, kind, sampling, what)
        elif self.fallback is not None:
            step = lambda: self._decode(slots, b, length, kind, sampling)  # noqa: E731
        else:
            function = self._compiled_function()
            step = self._first_compile(
                lambda: function(slots, b, length, kind, sampling),
                lambda: self._decode(slots, b, length, kind, sampling),
                [slots.counters] + ([sampling.step] if sampling is not None else []),
                what,
            )
        self._steps[key] = step
        return step

    def _first_compile(
        self, compiled: Callable[[], torch.Tensor], eager: Callable[[], torch.Tensor], restore: list, what: str
    ) -> Callable[[], torch.Tensor]:
        """``compiled``, whose first call (the one that compiles) logs its time; if compiling fails,
        the reason is logged once and this and every later step runs ``eager`` (``restore``'s
        tensors put back first, should the failed call have moved them)."""
        first = [True]

        def run() -> torch.Tensor:
            if not first[0]:
                return compiled() if self.fallback is None else eager()
            saved, begin = [t.clone() for t in restore], time.perf_counter()
            try:
                out = compiled()
            except Exception as error:  # noqa: BLE001 - any compiler failure: the eager step still works
                for tensor, value in zip(restore, saved):
                    tensor.copy_(value)
                self._fall_back(error)
                out = eager()
            else:
                log.info("snapkv_rag: %s compiled in %.1f s", what, time.perf_counter() - begin)
            first[0] = False
            return out

        return run

    def _fall_back(self, error: Exception) -> None:
        """Compiling the step failed: say why, once; the eager step is used from now on."""
        self.fallback = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("snapkv_rag: compiling the decode step failed (%s); the eager step is used", self.fallback)

    def _compiled_function(self) -> Callable:
        """``_decode`` through ``torch.compile`` (inductor, one graph: a break is an error), made once;
        ``compile=True`` gets the default mode, a mode name that mode."""
        if self._step_function is None:
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
            mode = None if self.compile in (True, EAGER_GRAPH) else self.compile
            self._step_function = torch.compile(self._decode, mode=mode, fullgraph=True)
        return self._step_function

    def _captured(
        self, slots: SlotCache, b: int, length: int, kind: str, sampling: SamplingSlots | None, what: str
    ) -> Callable[[], torch.Tensor]:
        """The step captured in a CUDA graph: the compiled one, or the eager one under
        ``compile="eager-graph"`` or once compiling has failed (the reason logged, once)."""
        begin = time.perf_counter()
        if self._pool is None:  # one memory pool shared by every captured bucket
            self._pool = torch.cuda.graph_pool_handle()
        restore = [slots.counters] + ([sampling.step] if sampling is not None else [])
        if self.compile is True and self.fallback is None:
            function = self._compiled_function()
            try:
                step = _capture(lambda: function(slots, b, length, kind, sampling), restore, self._pool)
                log.info("snapkv_rag: %s compiled and captured in %.1f s", what, time.perf_counter() - begin)
                return step
            except Exception as error:  # noqa: BLE001 - any compiler failure: the eager step still works
                self._fall_back(error)
                torch.cuda.synchronize()
        step = _capture(lambda: self._decode(slots, b, length, kind, sampling), restore, self._pool)
        log.info("snapkv_rag: %s captured (eager) in a CUDA graph in %.1f s", what, time.perf_counter() - begin)
        return step

    def forward(
        self, input_ids, attention_mask, position_ids, cache, at: int | list[int] | None = None
    ) -> torch.Tensor:
        """One pass of the model over ``cache`` (a prompt cache, the slot cache or a tail's): the
        next-token logits ``[B, V]`` after the last position (or after position ``at``; after each of
        a list of positions: ``[B, len(at), V]``). What prompt passes outside the runner use (the
        lookahead draft, stored-document tails), under ``lock`` and :meth:`sliced_mlps`."""
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self.cache_kwarg: cache,
            "use_cache": True,
            attention.CACHE_KWARG: cache,
        }
        if self.keep_last:
            kwargs["logits_to_keep"] = (
                1 if at is None else torch.tensor(at if isinstance(at, list) else [at], device=input_ids.device)
            )
        logits = self.model(**kwargs).logits
        if isinstance(at, list):
            return logits if self.keep_last else logits[:, at, :]
        return logits[:, -1, :] if self.keep_last or at is None else logits[:, at, :]


class StepClock:
    """A decode step's time: CUDA events on CUDA (read after the step's one sync), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.begin = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()  # already reached: the tokens were copied to the host
            return self.start.elapsed_time(self.end)
        return 1000 * (time.perf_counter() - self.begin)


def _capture(step: Callable[[], torch.Tensor], restore: list[torch.Tensor], pool) -> Callable[[], torch.Tensor]:
    """``step`` captured in a CUDA graph (warmed up on a side stream first: a compiled step compiles
    there) and replayed: its inputs and outputs are the slot cache's buffers, at fixed addresses until
    the cache reallocates. The warm-up runs write only the slots the real step writes again; the
    tensors in ``restore`` (the rows' counters, the sampling steps) are put back after each run,
    also when one fails."""
    saved = [t.clone() for t in restore]

    def put_back() -> None:
        for tensor, value in zip(restore, saved):
            tensor.copy_(value)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
                put_back()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
    finally:
        torch.cuda.current_stream().wait_stream(stream)
        put_back()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay
