"""``SnapKVLLM``: the front of the engine. It checks input, renders the prompt, calls the core
(:func:`~snapkv_rag.generation.prefill` then :func:`~snapkv_rag.text.decode_text`) and builds
results. ``snapkv=False`` runs the very same path with the full cache, so comparisons measure
compression and nothing else.

Forward passes are serialised by the runner's lock: one model on one device runs one forward at a
time. Each request owns its cache, so concurrent callers interleave token by token and each gets
the answer it would get alone; an abandoned stream holds no lock.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import torch

from . import attention, cited, compare as comparing, loading, structured
from .config import COMPRESSION_CONFIGS, SnapKVConfig
from .generation import Batch, Runner, SamplingOptions, prefill
from .prompts import DEFAULT_INSTRUCTION, DocumentLike
from .results import GenerationResult, build_result
from .text import Message, Request, check_question, decode_text, encode_request, normalise_messages
from .tools import ToolPlan
from .threads import iterate_in_thread

Comparison = comparing.Comparison
log = logging.getLogger(__name__)
OPTIONS = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "snapkv", "response_format", "cite")


class ContextLengthError(ValueError):
    """The prompt (plus the tokens to generate) does not fit the model's context window."""


class GenerationOutOfMemoryError(RuntimeError):
    """The device ran out of memory; the message names the prompt length and budget."""


def check_config(snapkv: Any):
    """A compression config from what a caller passes: ``None``/``False`` full cache, ``True`` SnapKV."""
    if snapkv is None or snapkv is False:
        return None
    if snapkv is True:
        return SnapKVConfig()
    if not isinstance(snapkv, COMPRESSION_CONFIGS):
        raise TypeError(f"snapkv: expected a SnapKVConfig (or another compression config), True, False or None; "
                        f"got {type(snapkv).__name__}")
    return snapkv


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
    default compression (``False``/``None``: full cache). ``prefill_chunk`` runs each MLP over a
    long prompt in slices of that many tokens; ``compile=True`` (or a ``torch.compile`` mode name)
    decodes from fixed-size buffers through a compiled step.
    """

    def __init__(self, model: Any = None, *, tokenizer: Any = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, attn_implementation: str | None = None,
                 snapkv: Any = SnapKVConfig(), max_new_tokens: int | None = None, instruction: str = DEFAULT_INSTRUCTION,
                 trust_remote_code: bool = False, prefill_chunk: int | None = 4096, compile: bool | str = False):
        if attn_implementation is not None and attn_implementation not in attention.BASE_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation: must be one of {attention.BASE_IMPLEMENTATIONS} or None, "
                             f"got {attn_implementation!r}")
        self.default_snapkv = check_config(snapkv)
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk <= 0):
            raise ValueError(f"prefill_chunk: expected a positive number of tokens or None, got {prefill_chunk!r}")
        if not isinstance(compile, (bool, str)):
            raise ValueError(f"compile: expected True, False or a torch.compile mode name, got {compile!r}")
        if compile and attn_implementation == "flash_attention_2":
            raise ValueError("compile: the fixed-size decode cache needs a 4-D attention mask, which "
                             "flash_attention_2 does not take; use attn_implementation='sdpa' with compile")
        self.max_new_tokens = SamplingOptions(max_new_tokens=128 if max_new_tokens is None else max_new_tokens).max_new_tokens
        self._structured_max_new_tokens = cited.STRUCTURED_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
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
            loaded = loading.load(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
            self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.attn_implementation = attention.resolve_implementation(self.model, attn_implementation)
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        self.runner = Runner(self.model, eos_ids=frozenset(eos), pad_id=pad, base=self.attn_implementation,
                             prefill_chunk=prefill_chunk, compile=compile)
        attention.attach(self.model, self.attn_implementation)
        self.device = self.runner.device
        self.compile, self.prefill_chunk = compile, prefill_chunk

    def close(self) -> None:
        """Switch the model back to its own attention implementation."""
        attention.detach(self.model)

    # ------------------------------------------------------------------ public API
    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or 2048

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def request(self, question_or_messages: str | Sequence[Message],
                documents: Sequence[DocumentLike] | None = None, cite: str = "text",
                tools: Sequence[Mapping] | None = None) -> Request:
        """The prompt ``generate`` (a question) or ``chat`` (messages, with ``tools``) would run:
        ``.text`` (chat template applied), ``.input_ids`` and the numbered ``.documents``. Nothing runs. With
        ``cite="json"`` the instruction asks for the cited-answer JSON (the question stays last)."""
        if cite not in cited.CITE_MODES:
            cited.check_cite(cite, ())
        instruction = cited.CITE_INSTRUCTION if cite == "json" else self.instruction
        request = encode_request(self.tokenizer, self._messages(question_or_messages), documents, instruction,
                                 tools)
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
        in ``result.parsed``) and ``cite`` (``"json"``: the answer and its citations come as
        constrained JSON, see :mod:`snapkv_rag.cited`)."""
        return self.chat(self._messages(check_question(question)), documents, **options)

    def stream(self, question: str, documents: Sequence[DocumentLike] | None = None, **options) -> Iterator[str]:
        """Yield text pieces as they are decoded; they concatenate to ``generate``'s text."""
        return self.stream_chat(self._messages(check_question(question)), documents, **options)

    def chat(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None,
             **options) -> GenerationResult:
        """Continue a conversation. With ``documents``, the last (user) message becomes the
        question of a RAG prompt; the observation window is always the end of the last message.
        ``tools`` (OpenAI-style function dicts) and ``tool_choice``: see :mod:`snapkv_rag.tools`;
        the call comes back in ``result.tool_calls``. Messages may hold an assistant message with
        ``tool_calls`` and ``tool`` messages (``content``, ``tool_call_id``) with the results."""
        request, options, plan = self._tool_request(messages, documents, options)
        return _with_calls(plan, _last(self._run([request], *self._options(options, request)))[0])

    def stream_chat(self, messages: Sequence[Message], documents: Sequence[DocumentLike] | None = None,
                    **options) -> Iterator[str]:
        request, options, _ = self._tool_request(messages, documents, options)
        return (item for item in self._run([request], *self._options(options, request)) if isinstance(item, str))

    def stream_result(self, question_or_messages: str | Sequence[Message],
                      documents: Sequence[DocumentLike] | None = None, **options) -> Iterator[str | GenerationResult]:
        """Like :meth:`stream`, then the full :class:`GenerationResult` as the last item."""
        request, options, plan = self._tool_request(question_or_messages, documents, options)
        run = self._run([request], *self._options(options, request))
        return (item if isinstance(item, str) else _with_calls(plan, item[0]) for item in run)

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
        self._options(dict(options), self.request(check_question(question), documents, options.get("cite", "text")))
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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        requests = [self.request(check_question(q), d, options.get("cite", "text")) for q, d in zip(questions, documents)]
        results: list[GenerationResult] = []
        for start in range(0, len(requests), batch_size):
            group = requests[start:start + batch_size]
            results.extend(_last(self._run(group, *self._options(options, *group))))
        return results

    def compare(self, question: str, documents: Sequence[DocumentLike] | None = None, *,
                methods: Mapping[str, Any], hit_rate: bool = True, **options) -> Comparison:
        """Run several compression methods (``methods``: name -> config, ``None`` for the full cache)
        on one prompt with ONE shared prefill; each result equals ``generate`` with that method."""
        if not methods:
            raise ValueError("methods: give at least one method")
        request = self.request(check_question(question), documents, options.get("cite", "text"))
        configs = {name: check_config(config) for name, config in methods.items()}
        configs = {name: config and config.for_prompt(len(request.input_ids)) for name, config in configs.items()}
        sampling, stop, _ = self._options({k: v for k, v in options.items() if k != "snapkv"}, request)
        try:
            return comparing.compare(self.runner, self.tokenizer, request, configs, sampling, stop, hit_rate)
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error, len(request.input_ids), 1, next(iter(configs.values()))) from error

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _messages(question_or_messages) -> Sequence[Message]:
        if isinstance(question_or_messages, str):
            return [{"role": "user", "content": check_question(question_or_messages)}]
        return question_or_messages

    def _tool_request(self, messages, documents, options: dict) -> tuple[Request, dict, ToolPlan | None]:
        """The request with its tools rendered, the options with the call's ``response_format``."""
        options = dict(options)
        messages = self._messages(messages)
        plan = ToolPlan.of(options.pop("tools", None), options.pop("tool_choice", None),
                           normalise_messages(messages)[-1]["role"])
        if plan is not None and plan.response_format is not None:
            if options.get("response_format") is not None:
                raise ValueError("response_format: cannot be combined with a tool call (tool_choice "
                                 f"{plan.choice!r}); use tool_choice='none' for a structured text answer")
            options["response_format"] = plan.response_format
        return self.request(messages, documents, options.get("cite", "text"), plan and plan.tools), options, plan

    def _options(self, options: dict, *requests: Request) -> tuple[SamplingOptions, list[str], Any]:
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise TypeError(f"unexpected option(s): {', '.join(sorted(unknown))}")
        constrained = cited.constrain(requests, options.get("response_format"), options.get("cite", "text"),
                                      self._compile_format)
        default_new = self._structured_max_new_tokens if constrained else self.max_new_tokens
        sampling = SamplingOptions(
            max_new_tokens=default_new if options.get("max_new_tokens") is None else options["max_new_tokens"],
            temperature=options.get("temperature") or 0.0,
            top_p=1.0 if options.get("top_p") is None else options["top_p"], seed=options.get("seed"))
        stop = options.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) for s in stop):
            raise TypeError("stop: expected a string or a list of strings")
        config = self.default_snapkv if "snapkv" not in options else check_config(options["snapkv"])
        for request in requests:
            total = len(request.input_ids) + sampling.max_new_tokens
            if total > self.context_window:
                raise ContextLengthError(
                    f"prompt is {len(request.input_ids)} tokens and max_new_tokens is {sampling.max_new_tokens}: "
                    f"together {total} tokens, over the model's context window of {self.context_window} tokens")
        return sampling, stop, config

    def _run(self, requests: list[Request], sampling: SamplingOptions, stop: list[str], config):
        """Prefill, then decode as text: yields pieces (str) as they come, then the list of results."""
        longest = max(len(r.input_ids) for r in requests)
        if config is not None:  # a share of the prompt: of the longest in a padded batch
            config = config.for_prompt(longest)
        try:
            batch = Batch.of([r.input_ids for r in requests], self.runner.pad_id, self.device)
            pre = prefill(self.runner, batch, {"": config}, room=sampling.max_new_tokens)
            text = decode_text(self.runner, self.tokenizer, pre, "", sampling, stop, [r.constraint for r in requests])
            try:
                while True:
                    try:
                        _, piece = next(text)
                    except StopIteration as done:
                        rows = done.value
                        break
                    yield piece
            finally:
                text.close()
        except torch.OutOfMemoryError as error:
            pre = None  # free the partial cache before the error travels up with this frame
            raise self._out_of_memory(error, longest, len(requests), config) from error
        results = [cited.finish(build_result(rows[i], r.documents, len(r.input_ids), pre.caches[""], i, pre.prefill_s,
                                             pre.selection_ms(""), batch_size=len(requests)), r.constraint, r.cite)
                   for i, r in enumerate(requests)]
        if log.isEnabledFor(logging.INFO):
            for result in results:
                c, t = result.compression, result.timings
                log.info("%s: kept %d of %d prompt tokens per layer (%s), prefill %.2f s%s, %d tokens at %.1f ms/token"
                         " (%s)", self.model_name, max(c.kept_tokens, default=0), c.prompt_tokens, c.method,
                         t.prefill_s, f" (a batch of {t.batch_size})" if t.batch_size > 1 else "",
                         result.usage.completion_tokens, t.decode_ms_per_token, result.finish_reason)
        yield results

    def _out_of_memory(self, error: Exception, longest: int, batch: int, config) -> GenerationOutOfMemoryError:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        budget = getattr(config, "max_capacity_prompt", None)
        return GenerationOutOfMemoryError(
            f"out of memory on {self.device} with a prompt of {longest} tokens (batch {batch}), budget "
            f"{budget if budget is not None else 'full cache'}: use a smaller budget, a shorter prompt or a smaller "
            "batch")

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


def _last(run) -> list[GenerationResult]:
    """Run a :meth:`SnapKVLLM._run` generator to its results."""
    for item in run:
        if isinstance(item, list):
            return item
    raise RuntimeError("generation ended without results")
