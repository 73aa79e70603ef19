"""The embedded SmolLM2-135M-Instruct held to JSON schemas: every answer parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.model

DOCS = [
    "The Eiffel Tower is in Paris, France. It was completed in 1889 and is 330 metres tall.",
    "Mount Fuji, 3776 metres high, is the highest mountain in Japan.",
    "Hamlet is a tragedy written by William Shakespeare around 1600.",
]


class Landmark(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=30)


SCHEMAS = {
    "enum + integer range": {
        "type": "object",
        "properties": {
            "country": {"enum": ["France", "Japan", "England"]},
            "year": {"type": "integer", "minimum": 1800, "maximum": 1950},
        },
        "required": ["country", "year"],
        "additionalProperties": False,
    },
    "nested objects + array min/max items": {
        "type": "object",
        "properties": {
            "place": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "height": {
                        "type": "object",
                        "properties": {"metres": {"type": "integer", "minimum": 1, "maximum": 9000}},
                        "required": ["metres"],
                        "additionalProperties": False,
                    },
                },
                "required": ["city", "height"],
                "additionalProperties": False,
            },
            "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 2, "maxItems": 3},
        },
        "required": ["place", "facts"],
        "additionalProperties": False,
    },
    "pydantic model": Landmark,
    "json_object": {"type": "json_object"},
}


@pytest.mark.parametrize(
    "labels, sampling",
    [
        (list(SCHEMAS), {}),
        (
            ["enum + integer range", "nested objects + array min/max items"],
            {"temperature": 0.9, "top_p": 0.95, "seed": 7},
        ),
    ],
    ids=["greedy", "sampled"],
)
def test_answers_parse_and_validate_against_each_schema(engine, labels, sampling):
    for label in labels:
        response_format = SCHEMAS[label]
        result = engine.generate(
            "Tell me about the Eiffel Tower.", DOCS, response_format=response_format, max_new_tokens=120, **sampling
        )
        assert result.finish_reason == "stop", (label, result.raw_text)
        assert result.parsed == json.loads(result.text), label
        if response_format == {"type": "json_object"}:
            assert isinstance(result.parsed, dict), label
        elif isinstance(response_format, dict):
            jsonschema.validate(result.parsed, response_format)
        else:
            response_format.model_validate(result.parsed)


def test_cited_answer_mode(engine):
    result = engine.generate("Who wrote Hamlet?", DOCS, cite="json", max_new_tokens=80)
    assert result.finish_reason == "stop"
    assert result.parsed["answer"].strip() == result.text and "Shakespeare" in result.text
    assert result.citations and all(1 <= n <= len(DOCS) for n in result.citations)
    assert len(set(result.citations)) == len(result.citations)
    assert result.cited_documents[0].text in DOCS
    chat = engine.chat([{"role": "user", "content": "Who wrote Hamlet?"}], DOCS, cite="json", max_new_tokens=80)
    assert (chat.text, chat.citations) == (result.text, result.citations)
    streamed = "".join(engine.stream("Who wrote Hamlet?", DOCS, cite="json", max_new_tokens=80))
    assert streamed == result.raw_text
