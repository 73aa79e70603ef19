"""The engine: one loaded model, SnapKV-compressed prefill, then decoding from the small cache.

Every entry point (``generate``, ``stream``, ``generate_batch``, ``chat``) runs through
``_decode``: prefill with a :class:`~snapkv_rag.attach.PrefillPlan`, then a plain decode loop that
feeds each new token at its original position. ``snapkv=False`` runs the very same loop with the
full cache, so comparisons measure compression and nothing else.

Forward passes are serialised by a lock: one model on one device runs one forward at a time.
Each request owns its cache, so concurrent callers interleave token by token and each gets the
answer it would get alone; an abandoned stream holds no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache

from . import attach, loading
from .config import COMPRESSION_CONFIGS, PyramidKVConfig, SnapKVConfig
from .prompts import DEFAULT_INSTRUCTION, Document, DocumentLike, parse_citations, rag_user_message, to_documents
from .results import CompressionStats, GenerationResult, Timings, Usage

Message = Mapping[str, str] | tuple[str, str]
_ROLES = ("system", "user", "assistant")


class ContextLengthError(ValueError):
    """The prompt (plus the tokens to generate) does not fit the model's context window."""


class GenerationOutOfMemoryError(RuntimeError):
    """The device ran out of memory; the message names the prompt length and budget."""


@dataclass
class _Request:
    input_ids: list[int]
    documents: list[Document]


@dataclass
class _Prefilled:
    requests: list[_Request]
    mask: torch.Tensor
    real: torch.Tensor
    padded: bool
    cache: Any
    plan: attach.PrefillPlan
    logits: torch.Tensor
    prefill_s: float


@dataclass
class Comparison:
    """What :meth:`SnapKVLLM.compare` returns: one result per method, from one shared prefill."""

    results: dict[str, GenerationResult]
    hit_rate: dict[str, float]
    prefill_s: float


def attention_hit_rate(decode_attention: dict[int, torch.Tensor], kept_positions: dict[int, torch.Tensor]) -> float:
    """Share of the prompt positions most attended by the full cache's decode steps that a method
    kept, averaged over layers and KV heads (the top-k, k = the number the method kept there)."""
    rates = []
    for layer, kept in kept_positions.items():
        attention = decode_attention.get(layer)
        if attention is None:
            continue
        k = kept.shape[-1]
        if k >= attention.shape[-1]:
            rates.append(1.0)
            continue
        top = attention.topk(k, dim=-1).indices
        hit = torch.zeros_like(attention, dtype=torch.bool).scatter(-1, kept, True).gather(-1, top)
        rates.append(hit.float().mean().item())
    return sum(rates) / len(rates) if rates else 1.0


class _TextState:
    """Incremental detokenisation of one row, with stop strings that never leak into the text."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.finished: str | None = None

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.finished = self.text[: min(hits)], "stop"
            return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            safe -= 1
        for s in self.stop:  # hold back what may be the start of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._emit(max(safe, self.emitted))

    def flush(self) -> str:
        self.text = self.text.rstrip("\ufffd") if self.finished != "stop" else self.text
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece, self.emitted = self.text[self.emitted:upto], upto
        return piece


def _normalise_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, message in enumerate(messages):
        role, content = (message if isinstance(message, tuple) else (message.get("role"), message.get("content"))
                         ) if isinstance(message, (tuple, Mapping)) else (None, None)
        if role not in _ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {_ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a str, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


class SnapKVLLM:
    """A local causal LM that answers over retrieved documents from a SnapKV-compressed cache.

    >>> llm = SnapKVLLM()                                  # the embedded SmolLM2-135M-Instruct
    >>> result = llm.generate("Who wrote Hamlet?", documents=["Hamlet is a play by Shakespeare."])
    >>> result.text, result.citations, result.compression.ratio

    ``model`` is a folder, a ``.gguf`` file, a hub id, or an already loaded transformers model
    (then pass ``tokenizer`` too; ``device``/``dtype``, if given, move it). ``device`` defaults to
    CUDA when available; a device this torch cannot use is a ValueError. ``snapkv`` is the default
    compression (``SnapKVConfig()``; ``False`` or ``None`` for the full cache); every call may
    override it. ``prefill_chunk`` runs each layer's MLP over the prompt in slices of that many
    tokens (``None``: all at once), which bounds the prefill's activations on long prompts without
    changing what is computed.
    ``compile=True`` (or a ``torch.compile`` mode name) decodes from fixed-size cache buffers with
    a compiled step: the first call of each shape compiles (tens of seconds), later ones run
    with less per-token overhead; PyramidKV's unequal layers decode uncompiled.
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, attn_implementation: str = "sdpa",
                 snapkv: Any = SnapKVConfig(), max_new_tokens: int = 128, instruction: str = DEFAULT_INSTRUCTION,
                 trust_remote_code: bool = False, prefill_chunk: int | None = 4096, compile: bool | str = False):
        attach.wrapped_name(attn_implementation)  # validate before any loading
        if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attn_implementation: 'flash_attention_2' needs the flash-attn package (CUDA only): "
                             "pip install 'snapkv-rag[flash-attn]', or use 'sdpa'")
        self.default_snapkv = self._check_config(snapkv)
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk <= 0):
            raise ValueError(f"prefill_chunk: expected a positive number of tokens or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if not isinstance(compile, (bool, str)):
            raise ValueError(f"compile: expected True, False or a torch.compile mode name, got {compile!r}")
        if compile and attn_implementation == "flash_attention_2":
            raise ValueError("compile: the fixed-size decode cache needs a 4-D attention mask, which "
                             "flash_attention_2 does not take; use attn_implementation='sdpa' with compile")
        self.compile = compile
        self._compiled_step = None
        self.max_new_tokens = self._check_max_new_tokens(max_new_tokens)
        self.instruction = instruction
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("tokenizer: required when model is an already loaded model")
            if device is not None:  # asked for explicitly: move the caller's model there
                model = model.to(loading.check_device(device))
            if dtype not in (None, "auto"):
                model = model.to(loading.resolve_dtype(dtype, str(next(model.parameters()).device)))
            self.model, self.tokenizer = model.eval(), tokenizer
            self.model_name = getattr(model.config, "_name_or_path", None) or type(model).__name__
        else:
            loaded = loading.load(model, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                  trust_remote_code=trust_remote_code)
            self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        attach.attach(self.model, attn_implementation)
        attach.chunk_mlps(self.model)
        self.attn_implementation = attn_implementation
        self.device = next(self.model.parameters()).device
        self._lock = threading.Lock()  # one forward pass at a time (see _forward)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        self._eos_ids = self._collect_eos_ids()
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self._eos_ids)

    # ------------------------------------------------------------------ public API
    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or 2048

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt_tokens(self, question: str, documents: Sequence[DocumentLike] | None = None) -> int:
        """The length of the prompt ``generate(question, documents)`` would run, chat template included."""
        return len(self._request([{"role": "user", "content": self._check_question(question)}], documents).input_ids)

    def generate(self, question: str, documents: Sequence[DocumentLike] | None = None, **options) -> GenerationResult:
        """Answer ``question`` over ``documents`` (strings, dicts with ``text``, or :class:`Document`).

        Options: ``max_new_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``stop`` (strings),
        ``seed``, ``snapkv`` (a config, or ``False`` for the full cache).
        """
        return self.chat([{"role": "user", "content": self._check_question(question)}], documents, **options)

    def stream(self, question: str, documents: Sequence[DocumentLike] | None = None, **options) -> Iterator[str]:
        """Yield text pieces as they are decoded; they concatenate to ``generate``'s text."""
        return self.stream_chat([{"role": "user", "content": self._check_question(question)}], documents, **options)

    def chat(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None,
             **options) -> GenerationResult:
        """Continue a conversation. With ``documents``, the last (user) message becomes the
        question of a RAG prompt; the observation window is always the end of the last message."""
        request = self._request(messages, documents)
        events = self._decode([request], **self._options(options, request))
        return self._drain(events)[0]

    def stream_chat(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None,
                    **options) -> Iterator[str]:
        request = self._request(messages, documents)
        settings = self._options(options, request)
        return self._stream([request], settings)

    def stream_result(self, question_or_messages: str | Sequence[Message],
                      documents: Sequence[DocumentLike] | None = None, **options
                      ) -> Iterator[str | GenerationResult]:
        """Like :meth:`stream`, then the full :class:`GenerationResult` as the last item."""
        messages = ([{"role": "user", "content": self._check_question(question_or_messages)}]
                    if isinstance(question_or_messages, str) else question_or_messages)
        request = self._request(messages, documents)
        settings = self._options(options, request)
        return self._stream([request], settings, with_result=True)

    async def agenerate(self, question: str, documents: Sequence[DocumentLike] | None = None,
                        **options) -> GenerationResult:
        """:meth:`generate` in a worker thread: the event loop keeps running meanwhile."""
        return await asyncio.to_thread(self.generate, question, documents, **options)

    async def achat(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None,
                    **options) -> GenerationResult:
        return await asyncio.to_thread(self.chat, messages, documents, **options)

    async def astream(self, question: str, documents: Sequence[DocumentLike] | None = None,
                      **options) -> AsyncIterator[str]:
        """:meth:`stream` run in a worker thread; bad input raises before the first piece."""
        self._check_question(question)
        self._request([{"role": "user", "content": question}], documents)  # validate on the caller's side
        from .adapters import iterate_in_thread

        async for piece in iterate_in_thread(lambda: self.stream(question, documents, **options)):
            yield piece

    def generate_batch(self, questions: Sequence[str], documents: Sequence[Sequence[DocumentLike] | None] | None = None,
                       *, batch_size: int = 8, **options) -> list[GenerationResult]:
        """Several requests, decoded together (left padding) in groups of ``batch_size``.
        ``documents`` is one list per question (or ``None``)."""
        if isinstance(questions, str) or not isinstance(questions, Sequence):
            raise TypeError("questions: expected a list of strings")
        documents = [None] * len(questions) if documents is None else list(documents)
        if len(documents) != len(questions):
            raise ValueError(f"documents: got {len(documents)} lists for {len(questions)} questions")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        requests = [self._request([{"role": "user", "content": self._check_question(q)}], d)
                    for q, d in zip(questions, documents)]
        results: list[GenerationResult] = []
        for start in range(0, len(requests), batch_size):
            group = requests[start:start + batch_size]
            settings = self._options(options, *group)
            results.extend(self._drain(self._decode(group, **settings)))
        return results

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_question(question: Any) -> str:
        if not isinstance(question, str):
            raise TypeError(f"question: expected a str, got {type(question).__name__}")
        if not question.strip():
            raise ValueError("question: must not be empty")
        return question

    @staticmethod
    def _check_max_new_tokens(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"max_new_tokens: must be a positive integer, got {value!r}")
        return value

    @staticmethod
    def _check_config(snapkv: Any):
        if snapkv is None or snapkv is False:
            return None
        if snapkv is True:
            return SnapKVConfig()
        if not isinstance(snapkv, COMPRESSION_CONFIGS):
            raise TypeError(f"snapkv: expected a SnapKVConfig (or another compression config), True, False or None; "
                            f"got {type(snapkv).__name__}")
        return snapkv

    def _collect_eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return ids or {0}

    def _request(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None) -> _Request:
        messages = _normalise_messages(messages)
        docs = to_documents(documents)
        if docs:
            if messages[-1]["role"] != "user":
                raise ValueError("messages: with documents, the last message must be the user's question")
            self._check_question(messages[-1]["content"])
            messages[-1] = {"role": "user",
                            "content": rag_user_message(messages[-1]["content"], docs, self.instruction)}
        return _Request(input_ids=self._encode(messages), documents=docs)

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _options(self, options: dict, *requests: _Request) -> dict:
        unknown = set(options) - {"max_new_tokens", "temperature", "top_p", "stop", "seed", "snapkv"}
        if unknown:
            raise TypeError(f"unexpected option(s): {', '.join(sorted(unknown))}")
        requested = options.get("max_new_tokens")
        max_new = self.max_new_tokens if requested is None else self._check_max_new_tokens(requested)
        temperature = options.get("temperature") or 0.0
        top_p = 1.0 if options.get("top_p") is None else options["top_p"]
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature: must be a number >= 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")
        stop = options.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) for s in stop):
            raise TypeError("stop: expected a string or a list of strings")
        config = self.default_snapkv if "snapkv" not in options else self._check_config(options["snapkv"])
        if config is not None:  # a share of the prompt: of the longest in a padded batch
            config = config.for_prompt(max(len(r.input_ids) for r in requests))
        limit = self.context_window
        for request in requests:
            if len(request.input_ids) + max_new > limit:
                raise ContextLengthError(
                    f"prompt is {len(request.input_ids)} tokens and max_new_tokens is {max_new}: together "
                    f"{len(request.input_ids) + max_new} tokens, over the model's context window of {limit} tokens")
        seed = options.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        return {"max_new_tokens": max_new, "temperature": float(temperature), "top_p": float(top_p), "stop": stop,
                "seed": seed, "config": config}

    # ------------------------------------------------------------------ the loop
    def _stream(self, requests: list[_Request], settings: dict, with_result: bool = False):
        events = self._decode(requests, **settings)
        try:
            for event in events:
                if isinstance(event, tuple):
                    if event[1]:
                        yield event[1]
                elif with_result:
                    yield event[0]
        finally:
            events.close()  # a consumer that stops early releases the engine here

    @staticmethod
    def _drain(events) -> list[GenerationResult]:
        """Run a decode generator to its results (the final list it yields, or the value it returns)."""
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration as stop:
                    return stop.value
                if isinstance(event, list):
                    return event
        finally:
            events.close()  # releases the engine's lock held by the generator

    def _forward(self, input_ids, attention_mask, position_ids, cache, plan=None, compiled=False) -> torch.Tensor:
        """One model call under the engine's lock. Each request owns its cache, so concurrent
        requests interleave forward passes without sharing state; a stream that is abandoned
        between two tokens holds nothing."""
        step = self._compiled() if compiled else self._model_step
        with self._lock, torch.inference_mode(), (attach.activate(plan) if plan else contextlib.nullcontext()):
            logits = step(input_ids, attention_mask, position_ids, cache)
            self._sync()
        return logits

    def _model_step(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  self._cache_kwarg: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

    def _compiled(self):
        if self._compiled_step is None:
            mode = None if self.compile is True else self.compile
            self._compiled_step = torch.compile(self._model_step, mode=mode)
        return self._compiled_step

    def _static_mask(self, valid: torch.Tensor | None, batch: int, kept: int, extra: int) -> tuple[torch.Tensor, Any]:
        """The ``[B, 1, 1, kept + extra]`` mask of a fixed-size decode cache, open on the ``kept``
        slots (where ``valid``, if given), and the value that opens one more slot."""
        slots = torch.zeros((batch, kept + extra), dtype=torch.bool, device=self.device)
        slots[:, :kept] = True if valid is None else valid.bool()
        if self.attn_implementation == "eager":  # eager attention adds the mask to its scores
            blocked = torch.finfo(self.model.dtype).min
            return torch.zeros(slots.shape, dtype=self.model.dtype, device=self.device).masked_fill(
                ~slots, blocked)[:, None, None, :], 0.0
        return slots[:, None, None, :], True

    def _sample(self, logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)

    def _out_of_memory(self, error: Exception, longest: int, batch: int, config) -> GenerationOutOfMemoryError:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        budget = getattr(config, "max_capacity_prompt", None)
        return GenerationOutOfMemoryError(
            f"out of memory on {self.device} with a prompt of {longest} tokens (batch {batch}), budget "
            f"{budget if budget is not None else 'full cache'}: use a smaller budget, a shorter prompt or a smaller "
            f"batch")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _prefill(self, requests: list[_Request], config, branches: dict | None = None) -> _Prefilled:
        """Run the prompt once; ``config`` compresses the cache in place, ``branches`` derive more caches."""
        lengths = [len(r.input_ids) for r in requests]
        batch, longest = len(requests), max(lengths)
        padded = min(lengths) != longest
        if padded and (isinstance(config, PyramidKVConfig)
                       or any(isinstance(c, PyramidKVConfig) for c, _ in (branches or {}).values())):
            raise ValueError("snapkv: PyramidKVConfig gives layers different cache lengths; batch only prompts of "
                             "equal length with it, or run them one by one")
        ids = torch.full((batch, longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((batch, longest), dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, longest - lengths[row]:] = torch.tensor(request.input_ids)
            mask[row, longest - lengths[row]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        plan = attach.PrefillPlan(cache=cache, config=config, attention_mask=mask if padded else None,
                                  num_layers=self.model.config.num_hidden_layers, branches=branches or {},
                                  mlp_chunk=self.prefill_chunk)
        start = time.perf_counter()
        try:
            logits = self._forward(ids, mask if padded else None, (mask.cumsum(-1) - 1).clamp(min=0), cache, plan)
        except torch.OutOfMemoryError as error:
            cache = plan = None  # free the partial cache before the error travels up with this frame
            raise self._out_of_memory(error, longest, batch, config) from error
        plan.phase = "decode"
        return _Prefilled(requests=requests, mask=mask, real=torch.tensor(lengths, device=self.device),
                          padded=padded, cache=cache, plan=plan, logits=logits,
                          prefill_s=time.perf_counter() - start)

    def _decode(self, requests: list[_Request], *, max_new_tokens: int, temperature: float, top_p: float,
                stop: list[str], seed: int | None, config):
        """Prefill, then decode; yields ``(row, piece)`` as text comes, then the list of results."""
        pre = self._prefill(requests, config)
        results = yield from self._decode_from(pre, pre.cache, pre.plan.kept_positions, config,
                                               max_new_tokens=max_new_tokens, temperature=temperature,
                                               top_p=top_p, stop=stop, seed=seed)
        yield results

    def _decode_from(self, pre: _Prefilled, cache, kept_positions: dict, config, *, max_new_tokens: int,
                     temperature: float, top_p: float, stop: list[str], seed: int | None):
        """Decode from ``cache`` (the prefill's own or a branch), feeding each token at its original
        position. Yields ``(row, piece)``; returns the results."""
        batch = len(pre.requests)
        generator = None
        if temperature > 0:
            generator = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**62))
        states = [_TextState(self.tokenizer, stop) for _ in pre.requests]
        valid = self._valid_slots(pre.mask, pre.real, cache.layers[0].keys.shape[-2]) if pre.padded else None
        if valid is not None and bool(valid.all()):
            valid = None  # compression dropped every pad: decode exactly as unpadded rows do
        positions = pre.real.clone()
        logits, steps, step_ms = pre.logits, 0, []
        slot = None
        if self.compile and not pre.plan.record_decode_attention:
            kept_slots = cache.layers[0].keys.shape[-2]
            slot = attach.make_static(cache, max_new_tokens)
        if slot is None:
            attach.reserve(cache, max_new_tokens)
        else:
            static_mask, open_slot = self._static_mask(valid, batch, kept_slots, max_new_tokens)
        try:
            for step in range(max_new_tokens):
                tokens = self._sample(logits, temperature, top_p, generator)
                for row, state in enumerate(states):
                    if state.finished:
                        continue
                    token = int(tokens[row])
                    if token in self._eos_ids:
                        state.finished = "stop"
                        piece = state.flush()
                    else:
                        piece = state.push(token)
                    if piece:
                        yield row, piece
                if all(s.finished for s in states) or step == max_new_tokens - 1:
                    break
                start, recorded = time.perf_counter(), pre.plan.record_s
                if slot is not None:
                    static_mask[..., kept_slots + step] = open_slot
                    slot.fill_(kept_slots + step)
                    logits = self._forward(tokens[:, None], static_mask, positions[:, None], cache, compiled=True)
                else:
                    if valid is not None:
                        valid = torch.cat([valid, valid.new_ones((batch, 1))], dim=-1)
                    logits = self._forward(tokens[:, None], valid, positions[:, None], cache,
                                           pre.plan if pre.plan.record_decode_attention else None)
                step_ms.append(1000 * (time.perf_counter() - start - (pre.plan.record_s - recorded)))
                positions += 1
                steps += 1
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error, int(pre.real.max()), batch, config) from error
        for row, state in enumerate(states):
            if not state.finished:
                state.finished = "length"
                piece = state.flush()
                if piece:
                    yield row, piece
        timings = Timings(prefill_s=pre.prefill_s, decode_ms_per_token=sum(step_ms) / steps if steps else 0.0,
                          decode_step_ms=step_ms)
        selection_ms = 1000 * pre.plan.selection_s
        return [self._result(pre.requests[row], states[row], kept_positions, config, timings, selection_ms)
                for row in range(batch)]

    def compare(self, question: str, documents: Sequence[DocumentLike] | None = None, *,
                methods: Mapping[str, Any], hit_rate: bool = True, **options) -> "Comparison":
        """Run several compression methods on one prompt with ONE shared prefill.

        ``methods`` maps a name to a config (``None``/``False`` for the full cache). Every compressed
        cache is derived from the same prefill (the prefill's computation does not depend on what
        the cache keeps), so only decoding is repeated. With ``hit_rate``, the full cache is decoded
        first while recording the attention its decode steps pay to the prompt, and each method
        gets the share of those most-attended positions that it kept.
        """
        if not methods:
            raise ValueError("methods: give at least one method")
        configs = {name: self._check_config(cfg) for name, cfg in methods.items()}
        request = self._request([{"role": "user", "content": self._check_question(question)}], documents)
        settings = self._options({k: v for k, v in options.items() if k != "snapkv"}, request)
        settings.pop("config")
        configs = {name: cfg and cfg.for_prompt(len(request.input_ids)) for name, cfg in configs.items()}
        branches = {name: (cfg, DynamicCache(config=self.model.config))
                    for name, cfg in configs.items() if cfg is not None}
        results: dict[str, GenerationResult] = {}
        rates: dict[str, float] = {}
        pre = self._prefill([request], None, branches)
        full_names = [name for name, cfg in configs.items() if cfg is None]
        record = hit_rate and bool(branches)
        pre.plan.record_decode_attention = record
        full = self._drain(self._decode_from(pre, pre.cache, {}, None, **settings))[0]
        pre.plan.record_decode_attention = False
        for name in full_names:
            results[name] = full
        for name, (cfg, cache) in branches.items():
            kept = pre.plan.branch_kept.get(name, {})
            results[name] = self._drain(self._decode_from(pre, cache, kept, cfg, **settings))[0]
            results[name].compression.selection_ms = 1000 * pre.plan.branch_selection_s.get(name, 0.0)
            if record:
                rates[name] = attention_hit_rate(pre.plan.decode_attention, kept)
        return Comparison(results={name: results[name] for name in configs}, hit_rate=rates,
                          prefill_s=full.timings.prefill_s)

    @staticmethod
    def _valid_slots(mask: torch.Tensor, real: torch.Tensor, slots: int) -> torch.Tensor:
        """Which cache slots of each row hold real tokens. Compression keeps pads only when a row
        has fewer real tokens than the budget, and sorted positions put those pads first."""
        if slots == mask.shape[1]:
            return mask
        first_real = slots - torch.clamp(real, max=slots)
        return (torch.arange(slots, device=mask.device)[None, :] >= first_real[:, None]).long()

    def _result(self, request: _Request, state: _TextState, kept_positions: dict, config, timings: Timings,
                selection_ms: float) -> GenerationResult:
        prompt_tokens = len(request.input_ids)
        layers = self.model.config.num_hidden_layers
        kept = [min(prompt_tokens, kept_positions[i].shape[-1]) if i in kept_positions else prompt_tokens
                for i in range(layers)]
        per_token = 2 * self._kv_heads() * self._head_dim() * self._itemsize()
        full_bytes = per_token * prompt_tokens * layers
        kept_bytes = per_token * sum(kept)
        compression = CompressionStats(method="full" if config is None else config.method,
                                       prompt_tokens=prompt_tokens, kept_tokens=kept,
                                       ratio=kept_bytes / full_bytes if full_bytes else 1.0,
                                       kv_bytes_full=full_bytes, kv_bytes_kept=kept_bytes, selection_ms=selection_ms)
        return GenerationResult(
            text=state.text, citations=parse_citations(state.text, len(request.documents)),
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(state.ids)),
            compression=compression, timings=timings, finish_reason=state.finished or "length",
            documents=request.documents)

    def _kv_heads(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def _head_dim(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.model.dtype).element_size()
