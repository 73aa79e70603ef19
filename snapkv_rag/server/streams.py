"""The events of one streamed response: per choice (``n``) its opening role (chat), its text or
tool-call deltas with their tokens' logprobs, and its closing finish reason."""

from __future__ import annotations

from ..runtime.choices import Piece
from . import logprobs
from .protocol import Call, chunk
from .tool_calls import CallStream, stream_end


class Streams:
    """Turns the engine's streamed pieces (a :class:`~snapkv_rag.runtime.choices.Piece` names its choice and
    carries its logprobs; a plain ``str`` is choice 0's) into chunks. Every choice ends when the
    last one has: the engine's result comes once, with all of them."""

    def __init__(self, call: Call, call_id: str, created: int):
        self.call, self.id, self.created = call, call_id, created
        self.n = call.options.get("n", 1)
        tools = call.tools is not None and call.tools.call  # a call, not text
        self.calls = [CallStream() for _ in range(self.n)] if tools else None
        self.offsets = [0] * self.n  # characters of each choice's text sent (completions' text_offset)

    def _chunk(self, *args, **kwargs) -> dict:
        return chunk(self.call, self.id, self.created, *args, **kwargs)

    def start(self) -> list[dict]:
        return [self._chunk(role=True, index=i) for i in range(self.n)] if self.call.kind == "chat" else []

    def piece(self, piece: str) -> list[dict]:
        index, entries = (piece.choice, piece.logprobs) if isinstance(piece, Piece) else (0, None)
        deltas = self.calls[index].feed(piece) if self.calls else [piece] if piece else []
        events = [self._chunk(delta, index=index) for delta in deltas]
        if entries is not None:
            if not events:  # tokens whose text is held back or cut: their logprobs still go out
                events.append(self._chunk("", index=index))
            events[-1]["choices"][0]["logprobs"] = logprobs.of(self.call.kind, entries, self.offsets[index])
            self.offsets[index] += sum(len(entry.token) for entry in entries)
        return events

    def end(self, result) -> list[dict]:
        events = []
        for index, answer in enumerate(result.choices or [result]):
            if self.calls:
                events += [self._chunk(delta, index=index) for delta in stream_end(self.calls[index], answer)]
            events.append(self._chunk(result=answer, index=index))
        return events
