"""What a generation returns: plain dataclasses, easy to log or turn into JSON (``asdict``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .prompts import Document, parse_citations


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache instead of prefilled (counted in ``prompt_tokens``)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class CompressionStats:
    """How much of the prompt's KV cache was kept. ``kept_tokens`` has one entry per layer."""

    method: str
    prompt_tokens: int
    kept_tokens: list[int]
    ratio: float
    kv_bytes_full: int
    kv_bytes_kept: int
    selection_ms: float


@dataclass
class Timings:
    """Wall-clock times of one generation (on CUDA, synchronised: the work, not its launch).
    ``decode_step_ms`` has one entry per decode step, so that first-step costs (compilation,
    CUDA-graph capture) can be told apart from the steady state."""

    prefill_s: float
    decode_ms_per_token: float
    decode_step_ms: list[float] = field(default_factory=list)
    batch_size: int = 1
    """The most requests this one decoded together with (itself included), or how many shared its
    prefill where several prompts are prefilled as one padded batch."""
    queued_s: float = 0.0
    """How long the request waited for a free batch slot before its prefill began."""


@dataclass
class TopLogprob:
    """One of the most likely tokens at a step: its text, id, log-probability and UTF-8 bytes."""

    token: str
    id: int
    logprob: float
    bytes: list[int]


@dataclass
class TokenLogprob(TopLogprob):
    """A generated token (with ``logprobs``): as :class:`TopLogprob`, and the step's ``top_logprobs``,
    most likely first (the chosen token among them when it is one of them)."""

    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    citations: list[int]
    usage: Usage
    compression: CompressionStats
    timings: Timings
    finish_reason: str
    documents: list[Document] = field(default_factory=list)
    parsed: Any = None
    """With ``response_format`` or ``cite="json"``: the parsed JSON answer; ``None`` for a free-text
    request, and for a structured one cut short (``finish_reason`` ``"length"``)."""
    raw_text: str = ""
    """The decoded text as the model wrote it (in the cited-answer mode: the JSON, while ``text`` is
    the answer)."""
    tool_calls: list[dict] = field(default_factory=list)
    """With ``tools``: the call the model made, ``[{"id", "name", "arguments": dict}]``."""
    logprobs: list[TokenLogprob] | None = None
    """With ``logprobs=k``: one entry per generated token (the logits the sampler used: after the
    grammar mask, before temperature); ``None`` otherwise."""
    choices: list[GenerationResult] = field(default_factory=list)
    """With ``n > 1``: the ``n`` answers (this result is a copy of ``choices[0]``, but its ``usage``
    counts the prompt once and the completion tokens of all of them); empty otherwise."""

    @property
    def cited_documents(self) -> list[Document]:
        """The documents the answer cites, in citation order."""
        return [self.documents[n - 1] for n in self.citations]

    def __repr__(self) -> str:
        """One line: the answer, its citations and the figures; the documents by count only
        (``to_dict()`` and the fields hold everything)."""
        text = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        c = self.compression
        return (
            f"GenerationResult(text={text!r}, citations={self.citations}, finish_reason={self.finish_reason!r}, "
            f"{c.method}: kept {max(c.kept_tokens, default=0)}/{c.prompt_tokens} prompt tokens, "
            f"{self.usage.completion_tokens} new, prefill {self.timings.prefill_s:.2f} s, "
            f"decode {self.timings.decode_ms_per_token:.1f} ms/token, {len(self.documents)} documents)"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("documents")
        data["cited_documents"] = [asdict(d) for d in self.cited_documents]
        return data


def compression_stats(compressed, selection_ms: float) -> CompressionStats:
    """What a request's compressed cache (:class:`snapkv_rag.kv.prompt_cache.Compressed`) keeps of its prompt:
    kept tokens and bytes read from its buffers."""
    full_bytes, kept_bytes = compressed.kv_bytes()
    return CompressionStats(
        method="full" if compressed.method is None else compressed.method.method,
        prompt_tokens=compressed.prompt_tokens,
        kept_tokens=compressed.kept_tokens(),
        ratio=kept_bytes / full_bytes if full_bytes else 1.0,
        kv_bytes_full=full_bytes,
        kv_bytes_kept=kept_bytes,
        selection_ms=selection_ms,
    )


def finish_result(
    row_text, documents: list[Document], prompt_tokens: int, compression: CompressionStats, timings: Timings
) -> GenerationResult:
    """A :class:`GenerationResult` from a row's text (a :class:`snapkv_rag.request.text.RowText`) and its figures."""
    timings.decode_ms_per_token = row_text.decode_ms_per_token
    timings.decode_step_ms = list(row_text.decode_step_ms)
    return GenerationResult(
        text=row_text.text,
        citations=parse_citations(row_text.text, len(documents)),
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(row_text.token_ids)),
        compression=compression,
        timings=timings,
        finish_reason=row_text.finish_reason,
        documents=documents,
        raw_text=row_text.text,
        logprobs=row_text.logprobs,
    )


@dataclass
class SchedulerStats:
    """A snapshot: requests waiting, requests decoding, the batch limit, and totals so far."""

    queued: int
    running: int
    max_batch: int
    finished: int
    generated_tokens: int
    prompt_tokens: int
    kept_prompt_tokens: int
    prefills: int = 0  # prompts prefilled (n choices, or the methods of ``compare``, share one)
