"""Constrained decoding on a tiny random-weight Llama: the plumbing (masks, batching, streaming,
errors before any work). Whether a real model's answers validate: tests/test_structured_model.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import SchemaError, SnapKVConfig, StreamingLLMConfig
from snapkv_rag.request import cited
from snapkv_rag.request.structured import apply_masks, closing_path, compile_format
from snapkv_rag.runtime.sampling import SamplingOptions
from snapkv_rag.runtime.scheduler import Outcome

# bounded: enums, integers in a range and booleans, so that even random weights finish the JSON
BOUNDED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}


def _format(engine, response_format=BOUNDED):
    return engine._compile_format(response_format)


def test_masks_disallow_padding_columns_and_leave_free_rows_alone(tiny_engine, tokenizer):
    fmt = compile_format(tokenizer, BOUNDED, len(tokenizer), tiny_engine.runner.eos_ids)
    logits = torch.randn(3, len(tokenizer) + 64)  # an output layer padded past the tokenizer
    before = logits.clone()
    apply_masks(logits, [None, fmt.new_constraint(), None])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isinf(logits[1, len(tokenizer) :]).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([i]).startswith("{") for i in allowed)  # a JSON object starts
    untouched = before.clone()
    apply_masks(untouched, [None, None, None])
    assert torch.equal(untouched, before)


def test_same_schema_compiles_once(tiny_engine):
    assert _format(tiny_engine) is _format(tiny_engine, json.loads(json.dumps(BOUNDED)))


def test_constrained_and_free_rows_in_one_batch(tiny_engine):
    """Row 0 is held to the schema and parses; row 1, in the same decode steps, decodes exactly as
    it would alone."""
    scheduler = tiny_engine.scheduler
    constrained = tiny_engine.request("Pick a colour.")
    constrained.constraint = _format(tiny_engine).new_constraint()
    free = tiny_engine.request("What lies north?", filler_documents(2))
    options = SamplingOptions(max_new_tokens=40)

    def outcome(ticket) -> Outcome:
        return next(item for item in ticket if isinstance(item, Outcome))

    alone = outcome(scheduler.submit(free, options, [], None))
    both = [outcome(ticket) for ticket in [scheduler.submit(r, options, [], None) for r in (constrained, free)]]
    assert both[0].row.finish_reason == "stop" and both[0].batch_size == 2
    jsonschema.validate(json.loads(both[0].row.text), BOUNDED)
    assert both[1].row.token_ids == alone.row.token_ids


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}])
def test_generate_parses_and_stream_concatenates(tiny_engine, sampling):
    options = {"response_format": BOUNDED, "max_new_tokens": 40, **sampling}
    result = tiny_engine.generate("Pick a colour.", **options)
    assert result.finish_reason == "stop"
    assert result.parsed == json.loads(result.text)
    jsonschema.validate(result.parsed, BOUNDED)
    assert "".join(tiny_engine.stream("Pick a colour.", **options)) == result.text
    *pieces, last = tiny_engine.stream_result("Pick a colour.", **options)
    assert "".join(pieces) == last.text and last.parsed == result.parsed


def test_batch_and_compare_hold_every_row_to_the_schema(tiny_engine):
    results = tiny_engine.generate_batch(
        ["Pick a colour.", "What lies north?"], [None, filler_documents(3)], response_format=BOUNDED, max_new_tokens=40
    )
    comparison = tiny_engine.compare(
        "What lies north?",
        filler_documents(8),
        response_format=BOUNDED,
        max_new_tokens=40,
        methods={
            "full": None,
            "snapkv": SnapKVConfig(max_capacity_prompt=64, window_size=8),
            "streaming": StreamingLLMConfig(max_capacity_prompt=64),
        },
    )
    for result in [*results, *comparison.results.values()]:
        assert result.finish_reason == "stop"
        jsonschema.validate(result.parsed, BOUNDED)


def test_unconstrained_result_has_no_parsed(tiny_engine):
    result = tiny_engine.generate("What lies north?", max_new_tokens=4)
    assert result.parsed is None and result.raw_text == result.text


def test_cut_short_says_length_and_does_not_parse(tiny_engine):
    result = tiny_engine.generate("Pick a colour.", response_format=BOUNDED, max_new_tokens=3)
    assert result.finish_reason == "length" and result.parsed is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_structured_default_max_new_tokens(tiny_model, tokenizer):
    from snapkv_rag import SnapKVLLM

    engine = SnapKVLLM(model=tiny_model, tokenizer=tokenizer)  # no max_new_tokens anywhere
    sampling, _, _ = engine._options({"response_format": BOUNDED}, engine.request("q?"))
    assert sampling.max_new_tokens == 256
    assert engine._options({}, engine.request("q?"))[0].max_new_tokens == 128
    given = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=20)
    assert given._options({"response_format": BOUNDED}, given.request("q?"))[0].max_new_tokens == 20


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "cannot be compiled"),
        ("a string", "expected a pydantic model class"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "'schema'"),
    ],
)
def test_bad_schema_raises_before_prefill(tiny_engine, monkeypatch, bad, message):
    def no_prefill(*args, **kwargs):
        raise AssertionError("prefill ran")

    monkeypatch.setattr("snapkv_rag.runtime.runner.Runner.prefill", no_prefill)
    calls = [
        lambda: tiny_engine.generate("q?", response_format=bad),
        lambda: tiny_engine.stream("q?", response_format=bad),
        lambda: tiny_engine.generate_batch(["q?"], response_format=bad),
        lambda: tiny_engine.compare("q?", methods={"full": None}, response_format=bad),
    ]
    for call in calls:
        with pytest.raises(SchemaError, match=message) as caught:
            call()
        assert "response_format" in str(caught.value)


async def test_async_calls_take_response_format(tiny_engine):
    result = await tiny_engine.agenerate("Pick a colour.", response_format=BOUNDED, max_new_tokens=40)
    jsonschema.validate(result.parsed, BOUNDED)
    pieces = [p async for p in tiny_engine.astream("Pick a colour.", response_format=BOUNDED, max_new_tokens=40)]
    assert "".join(pieces) == result.text
    with pytest.raises(SchemaError):
        async for _ in tiny_engine.astream("q?", response_format={"type": "json_schema"}):
            pass


def test_cite_json_errors(tiny_engine):
    with pytest.raises(ValueError, match="cite: 'json' .* needs documents"):
        tiny_engine.generate("q?", cite="json")
    with pytest.raises(ValueError, match="cite: expected one of"):
        tiny_engine.generate("q?", ["a doc"], cite="yes")
    with pytest.raises(ValueError, match="cannot be combined with cite='json'"):
        tiny_engine.generate("q?", ["a doc"], cite="json", response_format=BOUNDED)


def test_cite_json_prompt_keeps_the_question_last(tiny_engine):
    request = tiny_engine.request("What lies north?", filler_documents(3), cite="json")
    user_turn = request.text.rsplit("Question:", 1)
    assert '"citations"' in user_turn[0] and user_turn[1].strip().startswith("What lies north?")


def _result_after(tokenizer, text: str, documents: int, end: bool):
    """A result whose constraint has read ``text`` (and an end-of-sequence token if ``end``)."""
    from snapkv_rag.request.prompts import Document
    from snapkv_rag.request.results import CompressionStats, GenerationResult, Timings, Usage

    constraint = compile_format(tokenizer, cited.cite_schema(documents), len(tokenizer), {2}).new_constraint()
    for token in tokenizer(text, add_special_tokens=False).input_ids + ([2] if end else []):
        constraint.accept(token)
    result = GenerationResult(
        text=text,
        citations=[],
        usage=Usage(1, 1),
        compression=CompressionStats("full", 1, [1], 1.0, 1, 1, 0.0),
        timings=Timings(0.0, 0.0),
        finish_reason="stop" if end else "length",
        documents=[Document(f"doc {i}") for i in range(documents)],
        raw_text=text,
    )
    return cited.finish(result, constraint, "json")


def test_cited_answer_fields_come_from_the_json(tokenizer):
    result = _result_after(tokenizer, '{"answer": " Paris ", "citations": [2, 2, 1]}', 3, end=True)
    assert (result.text, result.citations) == ("Paris", [2, 1])
    assert result.parsed == {"answer": " Paris ", "citations": [2, 2, 1]}
    assert result.raw_text.startswith('{"answer"')
    cut = _result_after(tokenizer, '{"answer": "Par\\u00eds is', 3, end=False)
    assert (cut.text, cut.citations, cut.parsed, cut.finish_reason) == ("París is", [], None, "length")


# unbounded strings: random weights, left alone, wander inside the first one until max_new_tokens
UNBOUNDED = {
    "type": "object",
    "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}, "rating": {"type": "integer"}},
    "required": ["setup", "punchline"],
}


def test_closing_path_is_the_cheapest_way_to_complete_the_json(tokenizer):
    fmt = compile_format(tokenizer, UNBOUNDED, len(tokenizer), [2])
    constraint = fmt.new_constraint(budget=100)
    for token in tokenizer('{"setup": "Why did the', add_special_tokens=False).input_ids:
        constraint.accept(token)
    assert constraint.accepted == len(tokenizer('{"setup": "Why did the', add_special_tokens=False).input_ids)
    assert closing_path(constraint.matcher) == b'", "punchline": ""}'
    assert constraint.closing_tokens() is None  # room left: the model writes on
    assert constraint.fresh().budget == 100 and constraint.fresh().accepted == 0


def test_an_unbounded_string_is_closed_before_the_budget_ends_and_parses(tiny_engine):
    for budget in (24, 40):
        result = tiny_engine.generate("Tell me a joke.", response_format=UNBOUNDED, max_new_tokens=budget)
        assert result.finish_reason == "stop" and result.usage.completion_tokens <= budget
        jsonschema.validate(result.parsed, UNBOUNDED)
    # the same request compared across methods: each decode closes within the budget
    comparison = tiny_engine.compare(
        "Tell me a joke.",
        filler_documents(4),
        response_format=UNBOUNDED,
        max_new_tokens=24,
        methods={"full": None, "snapkv": SnapKVConfig(max_capacity_prompt=64, window_size=8)},
    )
    for result in comparison.results.values():
        assert result.finish_reason == "stop" and result.parsed is not None
