"""``n`` answers from one prompt, and the log-probabilities of the tokens picked.

    result = llm.generate(question, documents, n=4, temperature=0.7, seed=7, logprobs=5)
    [c.text for c in result.choices]              # 4 answers from ONE prefill and ONE selection
    result.choices[2].logprobs[0].top_logprobs    # the 5 most likely first tokens of answer 2

``n`` (1..16): the scheduler prefills and compresses the prompt once, then writes the same
compressed cache into ``n`` rows of the decode batch (rows wait for a free one like any request,
so ``n`` larger than ``max_batch`` decodes in turns). Choice ``i`` samples with seed ``seed + i``
(:func:`choice_sampling`): choice 0 is the answer of the same request with ``n=1``, and each
choice ``i`` the answer of that request alone with seed ``seed + i``. Without a seed the clock
gives one, so the choices differ. Under greedy decoding (temperature 0) the ``n`` answers are the
same answer ``n`` times. Each choice follows its own grammar state (``response_format``, tools).

``logprobs`` (0..20): per generated token, its log-probability and the ``logprobs`` most likely
tokens' under the logits the sampler picked from: after the grammar mask (a token the grammar
forbids has probability 0 and is never listed), before temperature and top-p, as in OpenAI's API.
They are computed on the device for the rows that asked only (the others' step is unchanged but for
giving the sampler the logits), and cost one extra copy to the host per step while such a row runs.
Streamed pieces are :class:`Piece` strings that carry their ``choice`` (index) and the logprobs of
the tokens whose text they complete; the pieces' logprobs, concatenated, are the result's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..request.results import GenerationResult, TokenLogprob, TopLogprob, Usage
from ..request.text import Request
from .sampling import SamplingOptions
from .sampling import logprobs as log_probabilities


class Piece(str):
    """A streamed text piece of answer ``choice`` (its index); ``logprobs``: the tokens it completes
    (with ``logprobs`` asked; else ``None``). A piece may be empty when it only carries logprobs."""

    choice: int = 0
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, text: str, choice: int, logprobs: list[TokenLogprob] | None) -> Piece:
        piece = cls(text)
        piece.choice, piece.logprobs = choice, logprobs
        return piece


def choice_sampling(sampling: SamplingOptions, index: int) -> SamplingOptions:
    """Choice ``index``'s sampling: seed ``seed + index`` (the request's seed already fixed)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)


def choice_request(request: Request, index: int) -> Request:
    """Choice ``index``'s request: the same prompt with a grammar state of its own."""
    if index == 0 or request.constraint is None:
        return request
    return dataclasses.replace(request, constraint=request.constraint.fresh())


def own_request(request: Request, outcome: Any) -> Request:
    """``request`` as one choice (its scheduler ``Outcome``) decoded it: with its grammar state."""
    constraint = outcome.constraint
    return request if constraint is None else dataclasses.replace(request, constraint=constraint)


def combine(results: list[GenerationResult]) -> GenerationResult:
    """The result of ``n`` choices: choice 0's fields, ``choices`` all of them, and ``usage`` with
    the prompt once and every choice's completion tokens."""
    first = results[0]
    usage = Usage(
        prompt_tokens=first.usage.prompt_tokens,
        completion_tokens=sum(r.usage.completion_tokens for r in results),
        cached_tokens=first.usage.cached_tokens,
    )
    return dataclasses.replace(first, usage=usage, choices=list(results))


class TokenTexts:
    """A token id's text and UTF-8 bytes (decoded once per id, then remembered)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._seen.get(token)
        if found is None:
            text = self.tokenizer.decode([token])
            found = self._seen[token] = (text, list(text.encode("utf-8")))
        return found


class ChoiceLog:
    """One row's choice index and, with ``k`` (its ``logprobs``), the entries of its tokens: all
    of them, and those no piece has carried yet."""

    def __init__(self, index: int, k: int | None, texts: TokenTexts):
        self.index, self.k, self.texts = index, k, texts
        self.entries: list[TokenLogprob] = []
        self.sent = 0

    @classmethod
    def of(cls, index: int, sampling: SamplingOptions, texts: TokenTexts) -> ChoiceLog | None:
        """``None`` for a request that needs neither (one answer, no logprobs): plain ``str`` pieces."""
        if sampling.n == 1 and sampling.logprobs is None:
            return None
        return cls(index, sampling.logprobs, texts)

    def add(self, token: int, found: tuple[float, list[tuple[int, float]]] | None) -> None:
        """The token just picked and what :func:`to_host` found for its row."""
        if self.k is None or found is None:
            return
        logprob, top = found
        self.entries.append(
            TokenLogprob(*self._fields(token, logprob), [TopLogprob(*self._fields(i, lp)) for i, lp in top])
        )

    def _fields(self, token: int, logprob: float) -> tuple[str, int, float, list[int]]:
        text, raw = self.texts(token)
        return text, token, logprob, raw

    def piece(self, text: str, final: bool = False) -> Piece | None:
        """The piece to send for ``text`` (``None``: nothing to send); it takes the entries not sent yet."""
        pending = self.entries[self.sent :]
        if not text and not (final and pending):
            return None
        self.sent = len(self.entries)
        return Piece.of(text, self.index, pending if self.k is not None else None)

    @property
    def all(self) -> list[TokenLogprob] | None:
        return self.entries if self.k is not None else None


def wanted(jobs: list[Any]) -> list[int | None]:
    """Per row, the alternatives its request asked for (``None``: no logprobs, or no request)."""
    return [job.log.k if job is not None and job.log is not None else None for job in jobs]


def on_device(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]) -> tuple | None:
    """The logprobs of the rows that asked for them (``ks[row]`` not ``None``), still on the device:
    ``(rows, ks, chosen [R], top ids [R, k], top logprobs [R, k])`` with ``k`` their largest; ``None``
    when no row asked."""
    rows = [row for row, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    return (
        rows,
        [ks[row] for row in rows],
        *log_probabilities(logits.index_select(0, index), tokens.index_select(0, index), max(ks[r] for r in rows)),
    )


def to_host(found: tuple | None) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """:func:`on_device`'s figures on the host: row -> (chosen logprob, [(id, logprob)] of its top
    ``k``); tokens the grammar forbade (logprob -inf) are left out."""
    if found is None:
        return {}
    rows, ks, chosen, ids, values = found
    chosen, ids, values = chosen.tolist(), ids.tolist(), values.tolist()
    return {
        row: (chosen[i], [(t, v) for t, v in zip(ids[i][: ks[i]], values[i][: ks[i]]) if v != float("-inf")])
        for i, row in enumerate(rows)
    }
