"""Constrained decoding: the output follows a JSON schema, token by token (xgrammar).

    fmt = compile_format(tokenizer, {"type": "object", ...}, vocab_size=model_vocab, stop_ids={2})
    constraint = fmt.new_constraint(budget=96)     # one per request: a stateful matcher
    apply_masks(logits, [constraint, None])        # before sampling: row 0 may only continue the JSON
    constraint.accept(token_id)                    # after sampling, for every token (EOS included)

``compile_format`` turns a pydantic model class, a JSON-schema dict, ``{"type": "json_object"}`` or
OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}`` into a compiled grammar, or
raises :class:`SchemaError` before any model work. The tokenizer's vocabulary is indexed once per
(tokenizer, vocabulary width, stop tokens), and a schema compiled once is reused.

An answer that ends: a constraint given its ``budget`` (the request's ``max_new_tokens``) works out,
near the end of it, the cheapest way to complete the JSON from where it is (close the open string,
fill the required fields left with empty values, close the brackets: :func:`closing_path`). Once
that path needs all the tokens left, :func:`apply_masks` allows only tokens along it, then the
end-of-sequence token, so an answer that ran long (a small model repeating itself inside an
unbounded string) is cut short but still parses.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

ANY_OBJECT = {"type": "object", "additionalProperties": True}  # {"type": "json_object"}: any JSON object
CLOSERS = ('"', "}", "]", "0", "n", "f", "[", "{")
"""Tried in order where the grammar forces nothing: end a string, an object, an array; start the
smallest value of the kind the grammar wants (a string, a number, null, false, a list, an object)."""
LOOKAHEAD = 256
"""Tokens left below which a constraint works out its closing path (above it, no answer's is that long)."""
_REASON_PREFIX = re.compile(r'^"?(\[[0-9:]+\] )?\S+\.cc:[0-9]+: ')


@functools.cache  # looked up once: the masks call it at every constrained step
def _xgrammar():
    """xgrammar, imported on first use: the engine runs without it (e.g. a GPU image that lacks it);
    only a request with ``response_format`` or tools needs it."""
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError(
            "structured output (response_format, tools) needs xgrammar: pip install xgrammar==0.2.9"
        ) from error
    return xgrammar


class SchemaError(ValueError):
    """``response_format`` is not a schema the grammar compiler accepts (or not a schema at all)."""


def schema_of(response_format: Any) -> dict | None:
    """The JSON schema of ``response_format`` (``None`` for free-form JSON: ``{"type": "json_object"}``)."""
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return response_format.model_json_schema()
    if not isinstance(response_format, dict):
        raise SchemaError(
            f"response_format: expected a pydantic model class, a JSON-schema dict, "
            f"{{'type': 'json_object'}} or {{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}; "
            f"got {type(response_format).__name__}"
        )
    if response_format.get("type") == "json_object":
        return None
    if response_format.get("type") == "json_schema":
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise SchemaError(
                "response_format: {'type': 'json_schema'} needs 'json_schema': {'name': ..., "
                "'schema': {...}} with the schema as a dict"
            )
        return schema
    return response_format


class CompiledFormat:
    """A compiled grammar for one response format; :meth:`new_constraint` gives each request its matcher."""

    def __init__(
        self,
        grammar: Any,
        schema: dict | None,
        vocab_size: int,
        stop_ids: Sequence[int],
        by_bytes: Mapping[bytes, list[int]],
    ):
        self.grammar, self.schema = grammar, schema
        self.vocab_size, self.stop_ids = vocab_size, sorted(stop_ids)
        self.by_bytes = by_bytes  # token ids by their text, to find the tokens along a closing path

    def new_constraint(self, budget: int | None = None) -> Constraint:
        """``budget``: the tokens the request may generate (``None``: no closing, cut where it ends)."""
        return Constraint(self, budget)


class Constraint:
    """One request's place in the grammar. ``done`` once the grammar has accepted an end-of-sequence
    token; until then :func:`apply_masks` allows only tokens that keep the output valid (and an
    end-of-sequence token only where the JSON is complete). With a ``budget``, the last tokens of it
    close the JSON (see the module's docstring); ``accepted`` counts the tokens taken so far."""

    def __init__(self, compiled: CompiledFormat, budget: int | None = None):
        self.format, self.budget, self.accepted = compiled, budget, 0
        self.matcher = _xgrammar().GrammarMatcher(compiled.grammar, override_stop_tokens=compiled.stop_ids)

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(int(token_id)):
            raise RuntimeError(
                f"token {token_id} was sampled outside the grammar: apply_masks must run before sampling for this row"
            )
        self.accepted += 1

    def closing_tokens(self) -> list[int] | None:
        """The only tokens to allow next, when the tokens left are just enough to complete the JSON
        along :func:`closing_path` (plus an end-of-sequence token); ``None`` while there is room."""
        if self.budget is None or self.budget - self.accepted > LOOKAHEAD:
            return None
        path = closing_path(self.matcher)
        if path is None or len(path) + 1 < self.budget - self.accepted:  # a token is at least a byte
            return None
        if not path:
            return list(self.format.stop_ids)
        return [i for end in range(1, len(path) + 1) for i in self.format.by_bytes.get(path[:end], ())]

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def fresh(self) -> Constraint:
        """A new constraint for the same format and budget (the same request decoded again, e.g. by
        another method)."""
        return self.format.new_constraint(self.budget)


def closing_path(matcher: Any, limit: int = 4 * LOOKAHEAD) -> bytes | None:
    """The text that completes the JSON from ``matcher``'s place most cheaply: what the grammar forces
    (a required key), else the first of :data:`CLOSERS` it accepts, until the JSON is complete.
    ``None`` when no such path is found within ``limit`` bytes (the matcher itself is not moved)."""
    probe, path = matcher.fork(), ""
    while not probe.is_completed():
        forced = probe.find_jump_forward_string()
        step = forced or next((c for c in CLOSERS if probe.accept_string(c)), None)
        if step is None or len(path) > limit:
            return None
        if forced:
            probe.accept_string(forced)
        path += step
    return path.encode()


def apply_masks(logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> None:
    """Set the disallowed tokens of every constrained row of ``logits`` ``[B, V]`` to -inf, in place.
    Columns beyond the grammar's vocabulary (padding of the model's output layer) are disallowed too,
    and so is, on a row whose budget is nearly spent, every token off its closing path."""
    rows = [row for row, c in enumerate(constraints) if c is not None and not c.done]
    if not rows:
        return
    with torch.inference_mode():  # the logits of a forward pass are inference tensors
        _apply(logits, rows, constraints)
        for row in rows:
            closing = constraints[row].closing_tokens()
            if closing:
                _keep_only(logits, row, closing)


def _keep_only(logits: torch.Tensor, row: int, ids: list[int]) -> None:
    """Leave row ``row`` only ``ids`` (those of them the grammar allowed); unchanged if it allowed none."""
    index = torch.tensor(ids, device=logits.device)
    kept = logits[row, index].clone()
    if torch.isinf(kept).all():
        return
    logits[row] = float("-inf")
    logits[row, index] = kept


def _apply(logits: torch.Tensor, rows: list[int], constraints: Sequence[Constraint | None]) -> None:
    vocab = min(constraints[rows[0]].format.vocab_size, logits.shape[-1])
    bitmask = _xgrammar().allocate_token_bitmask(logits.shape[0], vocab)
    for row in rows:
        constraints[row].matcher.fill_next_token_bitmask(bitmask, row)
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")
    # xgrammar's CPU kernel takes float32 logits; other dtypes and devices go through torch
    backend = "cpu" if logits.device.type == "cpu" and logits.dtype == torch.float32 else "torch_native"
    view = logits[:, :vocab]
    if view.is_contiguous():
        _xgrammar().apply_token_bitmask_inplace(view, bitmask.to(logits.device), indices=rows, backend=backend)
    else:
        part = view.contiguous()
        _xgrammar().apply_token_bitmask_inplace(part, bitmask.to(logits.device), indices=rows, backend=backend)
        view.copy_(part)


class _Compilers:
    """Per tokenizer (weakly held) and (vocabulary width, stop tokens): one grammar compiler and the
    formats it compiled, keyed by the schema's canonical JSON, and the token ids by their text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> tuple[Any, dict, dict]:
        with self.lock:
            entries = self.by_tokenizer.setdefault(tokenizer, {})
            key = (vocab_size, stop_ids)
            if key not in entries:
                info = _xgrammar().TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
                )
                by_bytes: dict[bytes, list[int]] = {}
                for token_id, text in enumerate(info.decoded_vocab):
                    if text and token_id not in stop_ids:
                        by_bytes.setdefault(text, []).append(token_id)
                entries[key] = (_xgrammar().GrammarCompiler(info, max_threads=1), {}, by_bytes)
            return entries[key]


_COMPILERS = _Compilers()


def compile_format(tokenizer, response_format: Any, vocab_size: int, stop_ids: Sequence[int]) -> CompiledFormat:
    """Compile ``response_format`` for ``tokenizer`` (``vocab_size``: the model's logits width, which
    may exceed the tokenizer's; ``stop_ids``: the end-of-sequence tokens). Raises :class:`SchemaError`."""
    schema = schema_of(response_format)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    stops = tuple(sorted(int(i) for i in stop_ids))
    if not stops:
        raise ValueError("stop_ids: give at least one end-of-sequence token id")
    try:
        key = "json_object" if schema is None else json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise SchemaError(f"response_format: the schema is not JSON-serialisable: {error}") from None
    compiler, formats, by_bytes = _COMPILERS.get(tokenizer, max(vocab_size, len(tokenizer)), stops)
    if key not in formats:
        try:
            grammar = compiler.compile_json_schema(
                json.dumps(ANY_OBJECT if schema is None else schema), any_whitespace=False, strict_mode=True
            )
        except Exception as error:  # xgrammar raises RuntimeError / ValueError subclasses with its reason
            reason = _REASON_PREFIX.sub("", str(error).strip().splitlines()[-1] if str(error).strip() else repr(error))
            raise SchemaError(f"response_format: the schema cannot be compiled to a grammar: {reason}") from None
        formats[key] = CompiledFormat(grammar, schema, max(vocab_size, len(tokenizer)), stops, by_bytes)
    return formats[key]
