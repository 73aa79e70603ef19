"""Structured answers on top of the core: which format each request is held to, and what the result
says afterwards.

``response_format=`` holds the answer to a JSON schema: ``result.parsed`` is the parsed JSON (the
text is the JSON itself). ``cite="json"`` (the cited-answer mode) holds it to
``{"answer": str, "citations": [int, ...]}`` with 1 to :data:`MAX_CITATIONS` document numbers in
``1..N``; ``result.text`` is then the answer, ``result.citations`` the numbers (deduplicated, in the
order given) and ``result.raw_text`` the JSON. An answer cut by ``max_new_tokens`` (``finish_reason``
``"length"``) or by a stop string has ``parsed`` ``None``; in the cited-answer mode its text is the
part of the answer written so far and its citations are empty.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from .results import GenerationResult

CITE_MODES = ("text", "json")
MAX_CITATIONS = 5
STRUCTURED_MAX_NEW_TOKENS = 256
"""``max_new_tokens`` of a structured request when neither the call nor the engine set one."""
CITE_INSTRUCTION = (
    'Answer the question using only the documents above. Reply in JSON with two keys: "answer", a short '
    'answer to the question, and "citations", the numbers of the documents that support the answer.'
)
_PARTIAL_ANSWER = re.compile(r'^\s*\{\s*"answer"\s*:\s*"((?:[^"\\]|\\.)*)')


def check_cite(cite: Any, documents: Sequence[Any]) -> str:
    if cite not in CITE_MODES:
        raise ValueError(f"cite: expected one of {CITE_MODES}, got {cite!r}")
    if cite == "json" and not documents:
        raise ValueError("cite: 'json' cites documents by number, so it needs documents; none were given")
    return cite


def cite_schema(num_documents: int) -> dict:
    """``{"answer": str, "citations": [1..N, ...]}``: at least one citation, at most MAX_CITATIONS."""
    return {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "citations": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": num_documents},
                "minItems": 1,
                "maxItems": min(num_documents, MAX_CITATIONS),
                "uniqueItems": True,
            },
        },
        "required": ["answer", "citations"],
        "additionalProperties": False,
    }


def constrain(requests: Sequence[Any], response_format: Any, cite: str, compile: Callable[[Any], Any]) -> bool:
    """Give each request its constraint (``compile`` turns a response format into a compiled one);
    True if any request is constrained. ``response_format`` and ``cite="json"`` exclude each other."""
    if response_format is not None and cite == "json":
        raise ValueError("response_format: cannot be combined with cite='json', which sets its own format")
    if response_format is None and cite != "json":
        for request in requests:
            request.constraint = None
        return False
    formats = {}
    for request in requests:
        wanted = cite_schema(len(request.documents)) if cite == "json" else response_format
        key = len(request.documents) if cite == "json" else 0
        if key not in formats:
            formats[key] = compile(wanted)
        request.constraint = formats[key].new_constraint()
    return True


def finish(result: GenerationResult, constraint: Any, cite: str) -> GenerationResult:
    """Fill ``parsed`` (and, in the cited-answer mode, ``text`` and ``citations``) from the JSON."""
    if constraint is None:
        return result
    complete = result.finish_reason == "stop" and constraint.done
    result.parsed = json.loads(result.raw_text) if complete else None
    if cite == "json":
        if result.parsed is not None:
            numbers = result.parsed["citations"]
            result.text = result.parsed["answer"].strip()
        else:
            partial = _PARTIAL_ANSWER.match(result.raw_text)
            result.text = _unescape(partial.group(1)).strip() if partial else ""
            numbers = []
        result.citations = [
            n for i, n in enumerate(numbers) if 1 <= n <= len(result.documents) and n not in numbers[:i]
        ]
    return result


def _unescape(fragment: str) -> str:
    """A JSON string's content cut anywhere: decode what can be decoded."""
    for cut in range(len(fragment), max(len(fragment) - 6, -1), -1):
        try:
            return json.loads(f'"{fragment[:cut]}"')
        except json.JSONDecodeError:
            continue
    return fragment
