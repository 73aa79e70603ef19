"""``SnapKVLLM``: the front of the engine. It checks input, renders the prompt, hands the request
to the engine's scheduler (:mod:`snapkv_rag.runtime.scheduler`: prefill -> select -> decode, many requests
decoding together) and builds results. ``snapkv=False`` runs the very same path with the full
cache, so comparisons measure compression and nothing else.

Callers on any thread or event loop share one worker that owns the model: each request is
prefilled alone and joins the running decode batch; it gets the tokens it would get alone. An
abandoned stream is cancelled and frees its batch slot within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .documents import folder as doc_folder
from .documents import stitch
from .documents import store as doc_store
from .kv import prefix_cache, quantized
from .methods import DEFAULT_COMPRESSION, is_method
from .models import loading
from .models import quantize as quantizing
from .request import cited, structured
from .request.prompts import DEFAULT_INSTRUCTION, REPEAT_INSTRUCTION, DocumentLike
from .request.results import GenerationResult, Timings, finish_result
from .request.text import Message, Request, check_question, encode_request, normalise_messages
from .request.tools import ToolPlan
from .runtime import attention, choices
from .runtime import compare as comparing
from .runtime.runner import Runner
from .runtime.sampling import SamplingOptions
from .runtime.scheduler import Outcome, Scheduler, SchedulerStats, Ticket

Comparison = comparing.Comparison
log = logging.getLogger(__name__)
OPTIONS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "snapkv",
    "ignore_eos",
    "response_format",
    "cite",
    "n",
    "logprobs",
)


@dataclass
class ResolvedCall:
    """One call resolved in one place (:meth:`SnapKVLLM._resolve`), before anything runs: the prompt
    (documents, chat template, tools, output format), its sampling and stop strings, the method bound
    to this prompt (budget in tokens, document spans; a stored document set's own) and the tool plan.
    From here the path goes one way: the scheduler prefills, selects and decodes it."""

    request: Request
    sampling: SamplingOptions
    stop: list[str]
    method: Any
    plan: ToolPlan | None = None


class ContextLengthError(ValueError):
    """The prompt (plus the tokens to generate) does not fit the model's context window."""


class GenerationOutOfMemoryError(RuntimeError):
    """The device ran out of memory; the message names the prompt length and budget."""


def check_config(snapkv: Any):
    """A compression config from what a caller passes: ``None``/``False`` full cache, ``True`` the
    default compression (:data:`~snapkv_rag.methods.DEFAULT_COMPRESSION`), a config as it is."""
    if snapkv is None or snapkv is False:
        return None
    if snapkv is True:
        return DEFAULT_COMPRESSION
    if not is_method(snapkv):
        raise TypeError(
            f"snapkv: expected a SnapKVConfig (or another compression config), True, False or None; "
            f"got {type(snapkv).__name__}"
        )
    return snapkv


def check_options(model, attn_implementation, prefill_chunk, compile, quantize, kv_dtype) -> str | None:
    """The engine's options that need no model, checked before one loads: each bad value a ValueError
    naming its option; returns ``quantize`` checked."""
    quantize = quantizing.check_quantize(quantize)
    if quantize and isinstance(model, torch.nn.Module):
        raise ValueError(
            f"quantize={quantize!r}: applies to a model the engine loads (a name, folder or None); a model "
            "you pass runs as it is: quantize it before (e.g. transformers' TorchAoConfig) and leave quantize=None"
        )
    if attn_implementation is not None and attn_implementation not in attention.BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation: must be one of {attention.BASE_IMPLEMENTATIONS} or None, got {attn_implementation!r}"
        )
    if prefill_chunk is not None and (
        isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk <= 0
    ):
        raise ValueError(f"prefill_chunk: expected a positive number of tokens or None, got {prefill_chunk!r}")
    # before the model loads (fp8 on a CPU model of a CUDA machine: the runner refuses it)
    quantized.check_kv_dtype(kv_dtype, None if torch.cuda.is_available() else "cpu")
    if not isinstance(compile, (bool, str)):
        raise ValueError(f"compile: expected True, False or a torch.compile mode name, got {compile!r}")
    if compile and attn_implementation == "flash_attention_2":
        raise ValueError(
            "compile: the fixed-size decode cache needs a 4-D attention mask, which "
            "flash_attention_2 does not take; use attn_implementation='sdpa' with compile"
        )
    return quantize


class SnapKVLLM:
    """A local causal LM that answers over retrieved documents from a SnapKV-compressed cache.

    >>> llm = SnapKVLLM()                                  # the embedded SmolLM2-135M-Instruct
    >>> result = llm.generate("Who wrote Hamlet?", documents=["Hamlet is a play by Shakespeare."])
    >>> result.text, result.citations, result.compression.ratio

    ``model`` is a folder, a ``.gguf`` file, a hub id, or an already loaded transformers model
    (then pass ``tokenizer``; ``device``/``dtype``, if given, move it). ``attn_implementation``
    ``None`` runs sdpa where the model supports it, else eager (said once in the log); a value
    given is used or refused with what works. The model's attention is routed through our
    wrapper (identical for other callers); :meth:`close` switches it back. ``snapkv`` is the
    compression of every call that does not choose its own (``False``/``None``: full cache); by
    default lookahead SnapKV drafting 4 tokens, keeping half of each prompt, never fewer than 512
    tokens (:data:`~snapkv_rag.methods.DEFAULT_COMPRESSION`: of the methods within about 1.25x
    SnapKV's time to the compressed cache, the one the project's evals show keeps the full cache's
    answers most often per byte; ``SnapKVConfig()`` is plain SnapKV at 1,024 tokens, as before).
    ``prefill_chunk`` runs each MLP over a
    long prompt in slices of that many tokens; ``compile=True`` (or a ``torch.compile`` mode name)
    decodes from fixed-size buffers through a step compiled by ``torch.compile``, on CUDA replayed
    from CUDA graphs (``"eager-graph"``: the eager step captured, not compiled). ``max_batch`` requests decode together
    at most (1: one at a time); ``max_kv_bytes`` bounds their caches (approximately); more requests
    wait in arrival order. ``prefix_cache_bytes`` bounds the document prefix cache (1 GiB, 0: none)
    shared by every caller: a prompt whose instruction + documents were prefilled before prefills only
    its question; ``doc_store_bytes`` the compressed document sets' store (:meth:`index_documents`),
    kept in the folder ``doc_store_dir`` too when one is given (read back by a later engine; at most
    ``doc_store_disk_bytes`` there: :mod:`snapkv_rag.documents.folder`). ``quantize`` (``"int8"``,
    ``"int4"``) quantizes the loaded model's linear layers (:mod:`snapkv_rag.models.quantize`); a model
    quantized by its caller (transformers' ``quantization_config``) runs as it is.
    ``kv_dtype`` stores every kept cache in 8 bits after its selection (which still runs on the
    prompt's full-precision attention): ``"int8"`` (symmetric, one scale per token, head and 32
    channels, in the model's dtype: about half of bf16's bytes, a quarter of float32's), ``"fp8"`` (float8 e4m3,
    CUDA only), ``None`` (the default: the model's dtype, as without it). Decode steps read it
    dequantized; recurrent states, the prefix cache and per-document caches stay full precision;
    stored document files keep the 8-bit tensors and load only into an engine of the same
    ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`, ``docs/engine.md``).
    """

    def __init__(
        self,
        model: Any = None,
        *,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        attn_implementation: str | None = None,
        snapkv: Any = DEFAULT_COMPRESSION,
        max_new_tokens: int | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        trust_remote_code: bool = False,
        prefill_chunk: int | None = 4096,
        compile: bool | str = False,
        max_batch: int = 16,
        max_kv_bytes: int | None = None,
        doc_store_bytes: int = doc_store.DEFAULT_BYTES,
        prefix_cache_bytes: int = prefix_cache.DEFAULT_BYTES,
        doc_store_dir: str | os.PathLike | None = None,
        doc_store_disk_bytes: int = doc_folder.DEFAULT_DISK_BYTES,
        quantize: str | None = None,
        kv_dtype: str | None = None,
    ):
        quantize = check_options(model, attn_implementation, prefill_chunk, compile, quantize, kv_dtype)
        self.default_snapkv = check_config(snapkv)
        self.max_new_tokens = SamplingOptions(
            max_new_tokens=128 if max_new_tokens is None else max_new_tokens
        ).max_new_tokens
        self._structured_max_new_tokens = cited.STRUCTURED_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        self.instruction = instruction
        self._adopt_or_load(model, tokenizer, device, dtype, trust_remote_code, quantize)
        # None, "int8"/"int4" (ours) or the method of a model the caller quantized
        self.weight_quantization = quantizing.quantized_by(self.model)
        self.attn_implementation = attention.resolve_implementation(self.model, attn_implementation)
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        self.prefix_cache = prefix_cache.PrefixCache(prefix_cache_bytes)
        folder = doc_folder.DocFolder(doc_store_dir, doc_store_disk_bytes) if doc_store_dir is not None else None
        self.doc_store = doc_store.DocStore(doc_store_bytes, folder)
        self.chunk_store = stitch.ChunkStore()  # per-document caches for reuse_documents
        self.runner = Runner(
            self.model,
            eos_ids=frozenset(eos),
            pad_id=pad,
            base=self.attn_implementation,
            prefill_chunk=prefill_chunk,
            compile=compile,
            prefix_cache=self.prefix_cache,
            kv_dtype=kv_dtype,
        )
        self.runner.repeat_ids = tuple(self.tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False))
        self.device = self.runner.device
        self.compile, self.prefill_chunk, self.kv_dtype = compile, prefill_chunk, kv_dtype
        self.scheduler = Scheduler(self.runner, self.tokenizer, max_batch=max_batch, max_kv_bytes=max_kv_bytes)
        if folder is not None:
            folder.open(self)  # crashed writes cleaned up, bad files named in the log

    def _adopt_or_load(self, model, tokenizer, device, dtype, trust_remote_code, quantize) -> None:
        """The caller's loaded model (moved where ``device``/``dtype`` ask), or the one ``model`` names,
        loaded and quantized as ``quantize`` asks."""
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
            loaded = loading.load(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
            self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
            if quantize:
                quantizing.quantize_model(self.model, quantize)

    def close(self) -> None:
        """Stop the scheduler's worker (requests still running end with an error) and switch the
        model back to its own attention implementation. A later call starts a new worker."""
        self.scheduler.close()
        self.runner.close()

    def stats(self) -> SchedulerStats:
        """Requests waiting and decoding now, the batch limit, and totals so far."""
        return self.scheduler.stats()

    # ------------------------------------------------------------------ documents reused across questions
    def index_documents(self, documents: Sequence[DocumentLike], method: Any = 0.5) -> doc_store.DocumentSet:
        """Prefill the instruction + ``documents`` once, compress them with a query-agnostic
        ``method`` (a :class:`~snapkv_rag.methods.KeyNormConfig`, ``KVzipConfig``, ``StreamingLLMConfig``,
        ``RandomConfig``, a fraction: key-norm keeping that share, default 0.5; ``None``: kept whole)
        and keep the result in the document store. Returns the handle to ask over:
        ``handle.generate(q)`` or ``generate(q, handle)`` prefills only the question."""
        return doc_store.index(self, documents, method)

    def load_documents(self, path) -> doc_store.DocumentSet:
        """A handle on a document set saved with ``handle.save(path)`` by the same model, tokenizer and
        library version (anything else: a clear error); it goes into the store."""
        return doc_store.load_set(self, path)

    def reuse_documents(self, documents: Sequence[DocumentLike], recompute: float = 0.15) -> stitch.StitchedDocuments:
        """A handle on ``documents`` (in this prompt's order) whose caches are computed once per
        document and stitched wherever the document sits, the ``recompute`` share of reused tokens
        that deviate most recomputed (:mod:`snapkv_rag.documents.stitch`). Opt-in: answers can differ
        from a full prefill's (``python -m evals.stitch`` measures it). The cache decodes whole."""
        return stitch.StitchedDocuments(self, documents, recompute)

    def prefix_stats(self) -> prefix_cache.PrefixStats:
        """The prefix cache's hits, misses, tokens saved and bytes used."""
        return self.prefix_cache.stats()

    def doc_stats(self) -> doc_store.DocStoreStats:
        """The document store's hits (questions answered from it), misses, tokens saved, bytes used."""
        return self.doc_store.stats()

    # ------------------------------------------------------------------ public API
    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or 2048

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def request(
        self,
        question_or_messages: str | Sequence[Message],
        documents: Sequence[DocumentLike] | None = None,
        cite: str = "text",
        tools: Sequence[Mapping] | None = None,
    ) -> Request:
        """The prompt ``generate`` (a question) or ``chat`` (messages, with ``tools``) would run:
        ``.text`` (chat template applied), ``.input_ids`` and the numbered ``.documents``. Nothing runs. With
        ``cite="json"`` the instruction asks for the cited-answer JSON (the question stays last)."""
        if cite not in cited.CITE_MODES:
            cited.check_cite(cite, ())
        instruction = cited.CITE_INSTRUCTION if cite == "json" else self.instruction
        request = encode_request(
            self.tokenizer,
            self._messages(question_or_messages),
            doc_store.documents_of(self, documents),
            instruction,
            tools,
        )
        request = doc_store.bind(request, documents)  # over a stored document set: its cache
        request.cite = cited.check_cite(cite, request.documents)
        return request

    def prompt_tokens(self, question: str, documents: Sequence[DocumentLike] | None = None) -> int:
        """The length of the prompt ``generate(question, documents)`` would run, chat template included."""
        return len(self.request(check_question(question), documents).input_ids)

    def generate(self, question: str, documents: Sequence[DocumentLike] | None = None, **options) -> GenerationResult:
        """Answer ``question`` over ``documents`` (strings, dicts with ``text``, or :class:`Document`).
        Options: ``max_new_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``stop`` (strings),
        ``seed``, ``snapkv`` (a config, or ``False`` for the full cache), ``response_format`` (a JSON
        schema, a pydantic model class or ``{"type": "json_object"}``: the answer is that JSON, parsed
        in ``result.parsed``), ``cite`` (``"json"``: the answer and its citations come as
        constrained JSON, see :mod:`snapkv_rag.request.cited`), ``n`` (answers, in ``result.choices``) and
        ``logprobs`` (alternatives per token, in ``result.logprobs``): see :mod:`snapkv_rag.runtime.choices`."""
        return self.chat(self._messages(check_question(question)), documents, **options)

    def stream(self, question: str, documents: Sequence[DocumentLike] | None = None, **options) -> Iterator[str]:
        """Yield text pieces as they are decoded; they concatenate to ``generate``'s text."""
        return self.stream_chat(self._messages(check_question(question)), documents, **options)

    def chat(
        self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None, **options
    ) -> GenerationResult:
        """Continue a conversation. With ``documents``, the last (user) message becomes the
        question of a RAG prompt; the observation window is always the end of the last message.
        ``tools`` (OpenAI-style function dicts) and ``tool_choice``: see :mod:`snapkv_rag.request.tools`;
        the call comes back in ``result.tool_calls``. Messages may hold an assistant message with
        ``tool_calls`` and ``tool`` messages (``content``, ``tool_call_id``) with the results."""
        return _last(self.stream_result(messages, documents, **options))

    def stream_chat(
        self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None, **options
    ) -> Iterator[str]:
        return (item for item in self.stream_result(messages, documents, **options) if isinstance(item, str))

    def stream_result(
        self, question_or_messages: str | Sequence[Message], documents: Sequence[DocumentLike] | None = None, **options
    ) -> Iterator[str | GenerationResult]:
        """Like :meth:`stream`, then the full :class:`GenerationResult` as the last item. Input is
        checked before this returns; closing the iterator early cancels the request."""
        call = self._resolve(question_or_messages, documents, options)
        return self._results(call, self._submit(call))

    async def agenerate(
        self, question: str, documents: Sequence[DocumentLike] | None = None, **options
    ) -> GenerationResult:
        """:meth:`generate` without blocking the event loop (the engine's worker does the work)."""
        return await _alast(self.astream_result(check_question(question), documents, **options))

    async def achat(
        self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None, **options
    ) -> GenerationResult:
        return await _alast(self.astream_result(messages, documents, **options))

    async def astream(
        self, question: str, documents: Sequence[DocumentLike] | None = None, **options
    ) -> AsyncIterator[str]:
        """:meth:`stream` for asyncio; bad input raises before the first piece."""
        async for item in self.astream_result(check_question(question), documents, **options):
            if isinstance(item, str):
                yield item

    async def astream_result(
        self, question_or_messages: str | Sequence[Message], documents: Sequence[DocumentLike] | None = None, **options
    ) -> AsyncIterator[str | GenerationResult]:
        """:meth:`stream_result` for asyncio: pieces, then the result; closing it cancels the request."""
        call = self._resolve(question_or_messages, documents, options)
        ticket = self._submit(call, asyncio.get_running_loop())
        try:
            async for item in ticket:
                yield self._result(call.request, item, call.plan) if isinstance(item, Outcome) else item
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error, len(call.request.input_ids), call.method) from error
        finally:
            ticket.cancel()

    def generate_batch(
        self,
        questions: Sequence[str],
        documents: Sequence[Sequence[DocumentLike] | None] | None = None,
        *,
        batch_size: int = 8,
        **options,
    ) -> list[GenerationResult]:
        """Several requests; at most ``batch_size`` of them in the engine at once (each prefilled at
        its own length, decoded together). ``documents`` is one list per question (or ``None``)."""
        if isinstance(questions, str) or not isinstance(questions, Sequence):
            raise TypeError("questions: expected a list of strings")
        documents = [None] * len(questions) if documents is None else list(documents)
        if len(documents) != len(questions):
            raise ValueError(f"documents: got {len(documents)} lists for {len(questions)} questions")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        requests = [
            self.request(check_question(q), d, options.get("cite", "text")) for q, d in zip(questions, documents)
        ]
        prepared = [self._bind(r, *self._options(options, r)) for r in requests]
        runs = [self._results(call, self._submit(call)) for call in prepared[:batch_size]]
        results: list[GenerationResult] = []
        try:
            for i in range(len(prepared)):
                results.append(_last(runs[i]))
                if i + batch_size < len(prepared):
                    call = prepared[i + batch_size]
                    runs.append(self._results(call, self._submit(call)))
        finally:
            for run in runs[len(results) :]:
                run.close()
        return results

    def compare(
        self,
        question: str,
        documents: Sequence[DocumentLike] | None = None,
        *,
        methods: Mapping[str, Any],
        hit_rate: bool = True,
        together: bool = False,
        **options,
    ) -> Comparison:
        """Run several compression methods (``methods``: name -> config, ``None`` for the full cache)
        on one prompt with ONE shared prefill; each result equals ``generate`` with that method.
        ``together=True`` decodes the methods as rows of one batch (faster; each method's decode
        ms/token is then the batch step's); by default one after another, each timed alone."""
        if not methods:
            raise ValueError("methods: give at least one method")
        request = self.request(check_question(question), documents, options.get("cite", "text"))
        configs = {name: check_config(config) for name, config in methods.items()}
        configs = {
            name: config and config.for_prompt(len(request.input_ids)).with_spans(request.spans)
            for name, config in configs.items()
        }
        sampling, stop, _ = self._options({k: v for k, v in options.items() if k != "snapkv"}, request)
        try:
            return comparing.compare(self.scheduler, request, configs, sampling, stop, hit_rate, together)
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error, len(request.input_ids), next(iter(configs.values()))) from error

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _messages(question_or_messages) -> Sequence[Message]:
        text = isinstance(question_or_messages, str)
        return [{"role": "user", "content": check_question(question_or_messages)}] if text else question_or_messages

    def _resolve(self, question_or_messages, documents, options: dict) -> ResolvedCall:
        """The call's arguments as one :class:`ResolvedCall`: the request (tools rendered), then its options
        checked against it, then the method bound to it. Bad input raises here, before any work."""
        request, options, plan = self._tool_request(question_or_messages, documents, options)
        return self._bind(request, *self._options(options, request), plan)

    def _bind(self, request: Request, sampling: SamplingOptions, stop: list[str], config, plan=None) -> ResolvedCall:
        """A checked request with its method bound to it: a budget share becomes this prompt's tokens,
        a document-aware method gets this prompt's document spans, a stored document set runs its own."""
        config = self.doc_store.used(request.stored) if request.stored is not None else config
        if config is not None:
            config = config.for_prompt(len(request.input_ids)).with_spans(request.spans)
        return ResolvedCall(request, sampling, stop, config, plan)

    def _tool_request(self, messages, documents, options: dict) -> tuple[Request, dict, ToolPlan | None]:
        """The request with its tools rendered, the options with the call's ``response_format``."""
        options = dict(options)
        messages = self._messages(messages)
        plan = ToolPlan.of(
            options.pop("tools", None), options.pop("tool_choice", None), normalise_messages(messages)[-1]["role"]
        )
        if plan is not None and plan.response_format is not None:
            if options.get("response_format") is not None:
                raise ValueError(
                    "response_format: cannot be combined with a tool call (tool_choice "
                    f"{plan.choice!r}); use tool_choice='none' for a structured text answer"
                )
            options["response_format"] = plan.response_format
        return self.request(messages, documents, options.get("cite", "text"), plan and plan.shown), options, plan

    def _options(self, options: dict, *requests: Request) -> tuple[SamplingOptions, list[str], Any]:
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise TypeError(f"unexpected option(s): {', '.join(sorted(unknown))}")
        constrained = cited.constrain(
            requests, options.get("response_format"), options.get("cite", "text"), self._compile_format
        )
        default_new = self._structured_max_new_tokens if constrained else self.max_new_tokens
        sampling = SamplingOptions(
            max_new_tokens=default_new if options.get("max_new_tokens") is None else options["max_new_tokens"],
            temperature=options.get("temperature") or 0.0,
            top_p=1.0 if options.get("top_p") is None else options["top_p"],
            seed=options.get("seed"),
            ignore_eos=options.get("ignore_eos", False),
            n=1 if options.get("n") is None else options["n"],
            logprobs=options.get("logprobs"),
        )
        for request in requests:
            if request.constraint is not None:  # its last tokens close the JSON
                request.constraint.budget = sampling.max_new_tokens
        stop = options.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) for s in stop):
            raise TypeError("stop: expected a string or a list of strings")
        config = self.default_snapkv if "snapkv" not in options else check_config(options["snapkv"])
        doc_store.check_options(options, requests)
        for request in requests:
            total = len(request.input_ids) + sampling.max_new_tokens
            if total > self.context_window:
                raise ContextLengthError(
                    f"prompt is {len(request.input_ids)} tokens and max_new_tokens is {sampling.max_new_tokens}: "
                    f"together {total} tokens, over the model's context window of {self.context_window} tokens"
                )
        return sampling, stop, config

    def _submit(self, call: ResolvedCall, loop=None) -> Ticket:
        """Hand one resolved call to the scheduler (prefill, select, decode)."""
        return self.scheduler.submit(call.request, call.sampling, call.stop, call.method, loop)

    def _results(self, call: ResolvedCall, ticket: Ticket) -> Iterator[str | GenerationResult]:
        """A ticket's pieces (str) as they come, then the :class:`GenerationResult`."""
        try:
            for item in ticket:
                yield self._result(call.request, item, call.plan) if isinstance(item, Outcome) else item
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error, len(call.request.input_ids), call.method) from error
        finally:
            ticket.cancel()

    def _result(self, request: Request, outcome: Outcome, plan: ToolPlan | None = None) -> GenerationResult:
        if outcome.choices:  # n > 1: each choice's result (its own grammar state), then all in one
            return choices.combine([self._result(choices.own_request(request, o), o, plan) for o in outcome.choices])
        timings = Timings(
            prefill_s=outcome.prefill_s,
            decode_ms_per_token=0.0,
            batch_size=outcome.batch_size,
            queued_s=outcome.queued_s,
        )
        result = cited.finish(
            finish_result(outcome.row, request.documents, len(request.input_ids), outcome.compression, timings),
            request.constraint,
            request.cite,
        )
        result.usage.cached_tokens = outcome.cached_tokens
        result = _with_calls(plan, result)
        if log.isEnabledFor(logging.INFO):
            c, t = result.compression, result.timings
            log.info(
                "%s: kept %d of %d prompt tokens per layer (%s), prefill %.2f s, %d tokens at %.1f ms/token%s (%s)",
                self.model_name,
                max(c.kept_tokens, default=0),
                c.prompt_tokens,
                c.method,
                t.prefill_s,
                result.usage.completion_tokens,
                t.decode_ms_per_token,
                f" (in a batch of up to {t.batch_size})" if t.batch_size > 1 else "",
                result.finish_reason,
            )
        return result

    def _out_of_memory(self, error: Exception, longest: int, config, batch: int = 1) -> GenerationOutOfMemoryError:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        budget = getattr(config, "max_capacity_prompt", None)
        return GenerationOutOfMemoryError(
            f"out of memory on {self.device} with a prompt of {longest} tokens (batch {batch}), budget "
            f"{budget if budget is not None else 'full cache'}: use a smaller budget, a shorter prompt or a smaller "
            "batch"
        )

    def _compile_format(self, response_format: Any) -> structured.CompiledFormat:
        """``response_format`` compiled for this model (cached per tokenizer and schema)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        width = head.weight.shape[0] if head is not None else self.model.config.vocab_size
        return structured.compile_format(self.tokenizer, response_format, int(width), self.runner.eos_ids)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return ids or {0}


def _with_calls(plan: ToolPlan | None, result: GenerationResult) -> GenerationResult:
    """``result`` with the call it decoded (then ``finish_reason`` is ``"tool_calls"``, as OpenAI says)."""
    if plan is not None:
        result.tool_calls = plan.calls(result.raw_text or result.text)
        if result.tool_calls:
            result.finish_reason = "tool_calls"
    return result


def _last(run) -> GenerationResult:
    """Run a stream of pieces to its final :class:`GenerationResult`."""
    for item in run:
        if isinstance(item, GenerationResult):
            return item
    raise RuntimeError("generation ended without a result")


async def _alast(run) -> GenerationResult:
    async for item in run:
        if isinstance(item, GenerationResult):
            return item
    raise RuntimeError("generation ended without a result")
