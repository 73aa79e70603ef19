"""From messages to token ids, and from decoded tokens back to text with stop strings: the
scheduler feeds each row's tokens to its :class:`TextState`, which detokenises incrementally and
stops the row when one of its stop strings appears (the stop string never reaches the text)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import PromptSpans
from .prompts import QUESTION_MARK, Document, DocumentLike, document_blocks, rag_user_message, to_documents
from .tools import for_template, has_tool_section, normalise_tool_calls, render_without_tool_section

Message = Mapping[str, str] | tuple[str, str]
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Request:
    """One prompt ready to run: the text the model sees (chat template applied), its token ids and
    the documents it numbers ``[1]..[N]``. ``constraint`` (a :class:`snapkv_rag.request.structured.Constraint`)
    restricts the answer to a response format; ``cite`` is ``"json"`` in the cited-answer mode.
    ``spans``: where each document and the question lie in ``input_ids`` (``None`` without
    documents, or with a tokenizer that cannot map characters to tokens)."""

    input_ids: list[int]
    documents: list[Document]
    text: str = ""
    constraint: Any = None
    cite: str = "text"
    spans: PromptSpans | None = None
    stored: Any = None  # a stored compressed document prefix it runs over (snapkv_rag.documents.store)


@dataclass
class RowText:
    """One row's decoded answer."""

    text: str
    finish_reason: str
    token_ids: list[int]
    decode_ms_per_token: float
    decode_step_ms: tuple[float, ...] = ()
    logprobs: list | None = None  # with ``logprobs``: a TokenLogprob per token


def check_question(question) -> str:
    if not isinstance(question, str):
        raise TypeError(f"question: expected a str, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question: must not be empty")
    return question


def normalise_messages(messages: Sequence[Message]) -> list[dict]:
    """``{"role", "content"}`` dicts; an assistant message may carry ``tool_calls`` (then its content
    may be empty or ``None``), a ``tool`` message its ``tool_call_id`` and ``name``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, message in enumerate(messages):
        role, content = (
            (message if isinstance(message, tuple) else (message.get("role"), message.get("content")))
            if isinstance(message, (tuple, Mapping))
            else (None, None)
        )
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {ROLES}, got {role!r}")
        calls = message.get("tool_calls") if isinstance(message, Mapping) and role == "assistant" else None
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a str, got {type(content).__name__}")
        out.append({"role": role, "content": content})
        if calls:
            out[-1]["tool_calls"] = normalise_tool_calls(calls, f"messages[{i}]")
        if role == "tool" and isinstance(message, Mapping):
            out[-1].update({k: str(message[k]) for k in ("tool_call_id", "name") if message.get(k) is not None})
    return out


def encode_request(
    tokenizer,
    messages: Sequence[Message],
    documents: Sequence[DocumentLike] | None,
    instruction: str,
    tools: list[dict] | None = None,
) -> Request:
    """The prompt of a conversation; with ``documents``, the last (user) message becomes the question
    of a RAG prompt (documents first, question last), through the model's chat template. ``tools``
    (checked, see :mod:`snapkv_rag.request.tools`) go through the template's tools section where it has
    one, else into the system message as text."""
    messages = normalise_messages(messages)
    docs = to_documents(documents)
    if docs:
        if messages[-1]["role"] != "user":
            raise ValueError("messages: with documents, the last message must be the user's question")
        check_question(messages[-1]["content"])
        messages[-1] = {"role": "user", "content": rag_user_message(messages[-1]["content"], docs, instruction)}
    template = getattr(tokenizer, "chat_template", None)
    extra = {}
    if template and has_tool_section(tokenizer):
        messages = for_template(messages)
        extra = {"tools": tools} if tools else {}
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = render_without_tool_section(messages, tools)
    if template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    if not docs or not getattr(tokenizer, "is_fast", False):
        return Request(input_ids=tokenizer(text, add_special_tokens=False).input_ids, documents=docs, text=text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return Request(
        input_ids=encoded.input_ids, documents=docs, text=text, spans=prompt_spans(text, encoded.offset_mapping, docs)
    )


def prompt_spans(text: str, offsets: Sequence[tuple[int, int]], documents: Sequence[Document]) -> PromptSpans | None:
    """The token spans of the documents' blocks and where the question starts in ``text``, from
    the tokens' character ``offsets``; ``None`` if a block is not found as written (a chat template
    that rewrites the user turn). A token that straddles a block's edge counts as the block's."""
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    n, cursor, last, spans = len(offsets), 0, 0, []
    for block in document_blocks(documents):
        at = text.find(block, cursor)
        if at < 0:
            return None
        cursor = at + len(block)
        first, stop = max(bisect_right(ends, at), last), bisect_left(starts, cursor)
        if stop > first:
            spans.append((first - n, stop - n))
            last = stop
    question = text.find(QUESTION_MARK, cursor)
    if question < 0:
        return None
    return PromptSpans(documents=tuple(spans), question=max(bisect_right(ends, question + 2), last) - n)


class TextState:
    """Incremental detokenisation of one row, with stop strings that never leak into the text.

    Each :meth:`push` decodes only a short window of tokens, never the whole answer: the tokens
    from ``_prefix`` on, whose first part (up to ``_read``) was decoded already as
    ``_prefix_text``, and the text past it is what the new token added. Decoding from a few
    tokens back, rather than the new token alone, keeps tokenizers whose pieces depend on their
    left neighbour (a sentencepiece word start) right. While the window's text ends in an
    incomplete UTF-8 character (U+FFFD) the window is held open, so that the character comes out
    whole once its last byte arrives; past ``HOLD`` tokens the bytes are taken as they are."""

    HOLD = 8

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.finished: str | None = None
        self._prefix = self._read = 0
        self._prefix_text = ""
        self._committed = ""  # the text of ids[:_read]
        self._searched = 0  # stop strings cannot end before this index of the text any more
        self._longest_stop = max(map(len, self.stop), default=0)

    def push(self, token: int) -> str:
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix :])
        added = window[len(self._prefix_text) :]
        if not added.endswith("\ufffd") or len(self.ids) - self._prefix > self.HOLD:
            self._committed += added
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
            added = ""
        self.text = self._committed + added.rstrip("\ufffd")
        start = max(self._searched - self._longest_stop + 1, 0)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if hits:
            self.text, self.finished = self.text[: min(hits)], "stop"
            return self.flush()
        safe = len(self.text)
        for s in self.stop:  # hold back what may be the start of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        return self._emit(max(safe, self.emitted))

    def flush(self) -> str:
        """The rest of the text once the row is finished (an incomplete last character is dropped)."""
        return self._emit(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, upto: int) -> str:
        piece, self.emitted = self.text[self.emitted : upto], upto
        return piece
