"""LangChain's standard integration tests for ChatSnapKV, on the embedded SmolLM2 model."""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_snapkv import ChatSnapKV
from langchain_tests.integration_tests import ChatModelIntegrationTests

pytestmark = pytest.mark.model

JSON_TESTS = ("tool", "structured", "json", "agent")
"""Tests whose answer is a tool call or a structured object: they get room for the whole JSON."""


class TestChatSnapKVIntegration(ChatModelIntegrationTests):
    engine = None

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _share_engine(cls, real_engine) -> None:
        cls.engine = real_engine

    @pytest.fixture
    def model(self, request) -> BaseChatModel:
        """Short answers keep the suite fast; a JSON answer cut short would not parse, so the
        tool-calling and structured-output tests decode up to 96 tokens."""
        params = {**self.standard_chat_model_params, **self.chat_model_params, **(getattr(request, "param", None) or {})}
        if any(word in request.node.name for word in JSON_TESTS):
            params["max_tokens"] = 96
        return self.chat_model_class(**params)

    @property
    def chat_model_class(self) -> type[ChatSnapKV]:
        return ChatSnapKV

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self.engine, "max_tokens": 8}

    @property
    def supports_model_override(self) -> bool:
        return False  # the adapter serves the one model its engine loaded

    @property
    def has_tool_choice(self) -> bool:
        return True  # "auto", "any"/"required", a tool name, "none"

    @property
    def supports_json_mode(self) -> bool:
        return True  # response_format={"type": "json_object"}, or the schema when one is given

    # The standard suites' provision for what a model cannot do: the test overridden and marked.
    # The 135M model, asked for a pydantic Joke, repeats one word inside the first (unbounded) string
    # field until max_tokens: the constrained JSON is valid so far but never closed, so it does not
    # parse. The TypedDict and JSON-schema variants pass because the suite accepts partial JSON.
    LOOPS = pytest.mark.xfail(reason="the 135M model loops inside an unbounded JSON string until max_tokens (pydantic "
                                     "Joke); TypedDict/JSON-schema pass only because the suite accepts partial JSON",
                              strict=False)

    # (the suite requires the mark on the whole method: the TypedDict and JSON-schema cases XPASS)
    @LOOPS
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @LOOPS
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @LOOPS
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason="no tool call came back for the unicode prompt within max_tokens (cause not confirmed)",
                       strict=False)
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice=None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
