"""Reading ``CitationQueryEngine``'s prompt back into numbered sources and a query.

``CitationQueryEngine`` writes its retrieved chunks into the prompt as ``Source 1:`` ..
``Source N:`` blocks between ``------`` rules, then ``Query: ...``. Passing those sources to the
engine as documents, in the same order, puts the question last (where SnapKV's observation
window reads it) and makes the engine's citation ``[n]`` mean ``Source n`` (= the query
engine's ``response.source_nodes[n - 1]``).
"""

from __future__ import annotations

import re

_LAYOUT = re.compile(r"\n------\n(?P<context>.*)\n------\nQuery: (?P<query>.*?)\nAnswer:\s*\Z", re.S)
_HEADER = re.compile(r"^Source (\d+):\n", re.M)


def split_sources(prompt: str) -> tuple[list[str], str] | None:
    """``(sources, query)`` when ``prompt`` is a citation QA prompt, else ``None``.

    Refine prompts (which carry an existing answer) are left alone, as is anything whose sources
    are not numbered 1..N in order.
    """
    match = _LAYOUT.search(prompt)
    if match is None or "existing answer" in prompt[: match.start()]:
        return None
    parts = _HEADER.split(match["context"])
    numbers, texts = [int(n) for n in parts[1::2]], [t.strip() for t in parts[2::2]]
    if parts[0].strip() or not numbers or numbers != list(range(1, len(numbers) + 1)) or not match["query"].strip():
        return None
    return texts, match["query"].strip()
