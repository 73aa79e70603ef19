"""The engine: one loaded model, SnapKV-compressed prefill, then decoding from the small cache.

Every entry point (``generate``, ``stream``, ``generate_batch``, ``chat``) runs through
``_decode``: prefill with a :class:`~snapkv_rag.attach.PrefillPlan`, then a plain decode loop that
feeds each new token at its original position. ``snapkv=False`` runs the very same loop with the
full cache, so comparisons measure compression and nothing else.

Requests are serialised by a lock: one model on one device runs one forward at a time, and a
shared engine gives every caller the answer it would get alone.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

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
    (then pass ``tokenizer`` too). ``snapkv`` is the default compression (``SnapKVConfig()``;
    ``False`` or ``None`` for the full cache); every call may override it.
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, attn_implementation: str = "sdpa",
                 snapkv: Any = SnapKVConfig(), max_new_tokens: int = 128, instruction: str = DEFAULT_INSTRUCTION,
                 trust_remote_code: bool = False):
        attach.wrapped_name(attn_implementation)  # validate before any loading
        self.default_snapkv = self._check_config(snapkv)
        self.max_new_tokens = self._check_max_new_tokens(max_new_tokens)
        self.instruction = instruction
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("tokenizer: required when model is an already loaded model")
            self.model, self.tokenizer = model.eval(), tokenizer
            self.model_name = getattr(model.config, "_name_or_path", None) or type(model).__name__
        else:
            loaded = loading.load(model, device=device, dtype=dtype, attn_implementation=attn_implementation,
                                  trust_remote_code=trust_remote_code)
            self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        attach.attach(self.model, attn_implementation)
        self.attn_implementation = attn_implementation
        self.device = next(self.model.parameters()).device
        self._lock = threading.Lock()  # not owner-bound: async adapters resume streams on other threads
        self._holder: int | None = None
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
        for event in events:
            if isinstance(event, list):
                return event
        raise RuntimeError("decode loop ended without results")  # pragma: no cover

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  self._cache_kwarg: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

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

    def _decode(self, requests: list[_Request], *, max_new_tokens: int, temperature: float, top_p: float,
                stop: list[str], seed: int | None, config, record_decode_attention: bool = False,
                on_plan: Callable | None = None):
        """Yields ``(row, piece)`` as text is decoded, then the list of results."""
        if not self._lock.acquire(blocking=self._holder != threading.get_ident()):
            raise RuntimeError("this thread has an unfinished stream open on this engine: finish or close it "
                               "before starting another request")
        self._holder = threading.get_ident()
        try:
            lengths = [len(r.input_ids) for r in requests]
            batch, longest = len(requests), max(lengths)
            padded = min(lengths) != longest
            if padded and isinstance(config, PyramidKVConfig):
                raise ValueError("snapkv: PyramidKVConfig gives layers different cache lengths; "
                                 "batch only prompts of equal length with it, or run them one by one")
            ids = torch.full((batch, longest), self._pad_id, dtype=torch.long)
            mask = torch.zeros((batch, longest), dtype=torch.long)
            for row, request in enumerate(requests):
                ids[row, longest - lengths[row]:] = torch.tensor(request.input_ids)
                mask[row, longest - lengths[row]:] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            real = torch.tensor(lengths, device=self.device)
            num_layers = self.model.config.num_hidden_layers
            cache = DynamicCache(config=self.model.config)
            plan = attach.PrefillPlan(cache=cache, config=config, attention_mask=mask if padded else None,
                                      num_layers=num_layers, record_decode_attention=record_decode_attention)
            generator = None
            if temperature > 0:
                generator = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**62))
            states = [_TextState(self.tokenizer, stop) for _ in requests]
            steps, decode_s = 0, 0.0
            try:
                with torch.inference_mode(), attach.prefill_plan(plan):
                    start = time.perf_counter()
                    logits = self._forward(ids, mask if padded else None, (mask.cumsum(-1) - 1).clamp(min=0), cache)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    prefill_s = time.perf_counter() - start
                    plan.phase = "decode"
                    if on_plan is not None:
                        on_plan(plan)
                    kept = [layer.keys.shape[-2] for layer in cache.layers]
                    valid = self._valid_slots(mask, real, kept[0]) if padded else None
                    positions = real.clone()
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
                        if valid is not None:
                            valid = torch.cat([valid, valid.new_ones((batch, 1))], dim=-1)
                        start = time.perf_counter()
                        logits = self._forward(tokens[:, None], valid, positions[:, None], cache)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize()
                        decode_s += time.perf_counter() - start
                        positions += 1
                        steps += 1
            except torch.OutOfMemoryError as error:
                del cache, plan
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                budget = getattr(config, "max_capacity_prompt", None)
                raise GenerationOutOfMemoryError(
                    f"out of memory on {self.device} with a prompt of {longest} tokens (batch {batch}), "
                    f"budget {budget if budget is not None else 'full cache'}: use a smaller budget, a shorter "
                    f"prompt or a smaller batch") from error
            for row, state in enumerate(states):
                if not state.finished:
                    state.finished = "length"
                    piece = state.flush()
                    if piece:
                        yield row, piece
            results = [self._result(requests[row], states[row], cache, plan, config, prefill_s, decode_s, steps)
                       for row in range(batch)]
            yield results
        finally:
            self._holder = None
            self._lock.release()

    @staticmethod
    def _valid_slots(mask: torch.Tensor, real: torch.Tensor, slots: int) -> torch.Tensor:
        """Which cache slots of each row hold real tokens. Compression keeps pads only when a row
        has fewer real tokens than the budget, and sorted positions put those pads first."""
        if slots == mask.shape[1]:
            return mask
        first_real = slots - torch.clamp(real, max=slots)
        return (torch.arange(slots, device=mask.device)[None, :] >= first_real[:, None]).long()

    def _result(self, request: _Request, state: _TextState, cache, plan, config, prefill_s: float,
                decode_s: float, steps: int) -> GenerationResult:
        prompt_tokens = len(request.input_ids)
        layers = self.model.config.num_hidden_layers
        kept = [min(prompt_tokens, plan.kept_positions[i].shape[-1]) if i in plan.kept_positions else prompt_tokens
                for i in range(layers)]
        per_token = 2 * self._kv_heads() * self._head_dim() * self._itemsize()
        full_bytes = per_token * prompt_tokens * layers
        kept_bytes = per_token * sum(kept)
        method = "full" if config is None else config.method
        compression = CompressionStats(method=method, prompt_tokens=prompt_tokens, kept_tokens=kept,
                                       ratio=kept_bytes / full_bytes if full_bytes else 1.0,
                                       kv_bytes_full=full_bytes, kv_bytes_kept=kept_bytes,
                                       selection_ms=plan.selection_s * 1000)
        return GenerationResult(
            text=state.text, citations=parse_citations(state.text, len(request.documents)),
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(state.ids)),
            compression=compression,
            timings=Timings(prefill_s=prefill_s, decode_ms_per_token=1000 * decode_s / steps if steps else 0.0),
            finish_reason=state.finished or "length", documents=request.documents)

    def _kv_heads(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def _head_dim(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.model.dtype).element_size()
