"""Constrained decoding: the output follows a JSON schema, token by token (xgrammar).

    fmt = compile_format(tokenizer, {"type": "object", ...}, vocab_size=model_vocab, stop_ids={2})
    constraint = fmt.new_constraint()              # one per request: a stateful matcher
    apply_masks(logits, [constraint, None])        # before sampling: row 0 may only continue the JSON
    constraint.accept(token_id)                    # after sampling, for every token (EOS included)

``compile_format`` turns a pydantic model class, a JSON-schema dict, ``{"type": "json_object"}`` or
OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}`` into a compiled grammar, or
raises :class:`SchemaError` before any model work. The tokenizer's vocabulary is indexed once per
(tokenizer, vocabulary width, stop tokens), and a schema compiled once is reused.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any, Sequence

import torch
import xgrammar

ANY_OBJECT = {"type": "object", "additionalProperties": True}  # {"type": "json_object"}: any JSON object
_REASON_PREFIX = re.compile(r'^"?(\[[0-9:]+\] )?\S+\.cc:[0-9]+: ')


class SchemaError(ValueError):
    """``response_format`` is not a schema the grammar compiler accepts (or not a schema at all)."""


def schema_of(response_format: Any) -> dict | None:
    """The JSON schema of ``response_format`` (``None`` for free-form JSON: ``{"type": "json_object"}``)."""
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return response_format.model_json_schema()
    if not isinstance(response_format, dict):
        raise SchemaError(f"response_format: expected a pydantic model class, a JSON-schema dict, "
                          f"{{'type': 'json_object'}} or {{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}; "
                          f"got {type(response_format).__name__}")
    if response_format.get("type") == "json_object":
        return None
    if response_format.get("type") == "json_schema":
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise SchemaError("response_format: {'type': 'json_schema'} needs 'json_schema': {'name': ..., "
                              "'schema': {...}} with the schema as a dict")
        return schema
    return response_format


class CompiledFormat:
    """A compiled grammar for one response format; :meth:`new_constraint` gives each request its matcher."""

    def __init__(self, grammar: Any, schema: dict | None, vocab_size: int, stop_ids: Sequence[int]):
        self.grammar, self.schema = grammar, schema
        self.vocab_size, self.stop_ids = vocab_size, sorted(stop_ids)

    def new_constraint(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One request's place in the grammar. ``done`` once the grammar has accepted an end-of-sequence
    token; until then :func:`apply_masks` allows only tokens that keep the output valid (and an
    end-of-sequence token only where the JSON is complete)."""

    def __init__(self, compiled: CompiledFormat):
        self.format = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled.grammar, override_stop_tokens=compiled.stop_ids)

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(int(token_id)):
            raise RuntimeError(f"token {token_id} was sampled outside the grammar: apply_masks must run before "
                               "sampling for this row")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def fresh(self) -> Constraint:
        """A new constraint for the same format (the same request decoded again, e.g. by another method)."""
        return self.format.new_constraint()


def apply_masks(logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> None:
    """Set the disallowed tokens of every constrained row of ``logits`` ``[B, V]`` to -inf, in place.
    Columns beyond the grammar's vocabulary (padding of the model's output layer) are disallowed too."""
    rows = [row for row, c in enumerate(constraints) if c is not None and not c.done]
    if not rows:
        return
    with torch.inference_mode():  # the logits of a forward pass are inference tensors
        _apply(logits, rows, constraints)


def _apply(logits: torch.Tensor, rows: list[int], constraints: Sequence[Constraint | None]) -> None:
    vocab = min(constraints[rows[0]].format.vocab_size, logits.shape[-1])
    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], vocab)
    for row in rows:
        constraints[row].matcher.fill_next_token_bitmask(bitmask, row)
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")
    # xgrammar's CPU kernel takes float32 logits; other dtypes and devices go through torch
    backend = "cpu" if logits.device.type == "cpu" and logits.dtype == torch.float32 else "torch_native"
    view = logits[:, :vocab]
    if view.is_contiguous():
        xgrammar.apply_token_bitmask_inplace(view, bitmask.to(logits.device), indices=rows, backend=backend)
    else:
        part = view.contiguous()
        xgrammar.apply_token_bitmask_inplace(part, bitmask.to(logits.device), indices=rows, backend=backend)
        view.copy_(part)


class _Compilers:
    """Per tokenizer (weakly held) and (vocabulary width, stop tokens): one grammar compiler and the
    formats it compiled, keyed by the schema's canonical JSON."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> tuple[Any, dict]:
        with self.lock:
            entries = self.by_tokenizer.setdefault(tokenizer, {})
            key = (vocab_size, stop_ids)
            if key not in entries:
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                               stop_token_ids=list(stop_ids))
                entries[key] = (xgrammar.GrammarCompiler(info, max_threads=1), {})
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
    compiler, formats = _COMPILERS.get(tokenizer, max(vocab_size, len(tokenizer)), stops)
    if key not in formats:
        try:
            grammar = compiler.compile_json_schema(json.dumps(ANY_OBJECT if schema is None else schema),
                                                   any_whitespace=False, strict_mode=True)
        except Exception as error:  # xgrammar raises RuntimeError / ValueError subclasses with its reason
            reason = _REASON_PREFIX.sub("", str(error).strip().splitlines()[-1] if str(error).strip() else repr(error))
            raise SchemaError(f"response_format: the schema cannot be compiled to a grammar: {reason}") from None
        formats[key] = CompiledFormat(grammar, schema, max(vocab_size, len(tokenizer)), stops)
    return formats[key]
