"""Settings shared by every room: where a RAG prompt's parts lie (:class:`PromptSpans`), the
limits of a request, and the validation helper every frozen settings class uses. The compression
methods' own settings live with each method (:mod:`snapkv_rag.methods`)."""

from __future__ import annotations

from dataclasses import dataclass


def require(ok: bool, name: str, message: str) -> None:
    """A ``ValueError`` naming the setting ``name`` and what is wrong with it, unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class PromptSpans:
    """Where a RAG prompt's parts lie, in tokens counted back from the END of the prompt (so
    ``-n`` is the first of ``n`` tokens): ``documents`` one ``(start, stop)`` per document, in
    order, ``stop`` exclusive and ``<= 0``; ``question`` where the question starts. Counted from the
    end, they hold unchanged for any slice of the prompt that ends where it ends (a sliding layer's
    window, a left-padded row). Built by :func:`snapkv_rag.request.text.encode_request`."""

    documents: tuple[tuple[int, int], ...]
    question: int

    def __post_init__(self) -> None:
        last = None
        for start, stop in self.documents:
            require(
                isinstance(start, int) and isinstance(stop, int) and start < stop <= 0,
                "spans",
                f"each document span must be (start, stop) with start < stop <= 0, got {(start, stop)!r}",
            )
            require(last is None or start >= last, "spans", "document spans must be in order, not overlapping")
            last = stop
        require(
            isinstance(self.question, int) and self.question < 0 and (last is None or self.question >= last),
            "spans",
            f"question must start after the last document and before the end, got {self.question!r}",
        )

    def in_slice(self, length: int) -> list[tuple[int, int]]:
        """The document spans as positions of a slice of ``length`` tokens that ends where the
        prompt ends; documents wholly before the slice are left out, one cut by it is clipped."""
        return [(max(length + start, 0), length + stop) for start, stop in self.documents if length + stop > 0]


MAX_N, MAX_LOGPROBS = 16, 20  # answers per request; alternatives reported per token
