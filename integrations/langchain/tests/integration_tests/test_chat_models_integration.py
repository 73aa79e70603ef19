"""LangChain's standard integration tests for ChatSnapKV, on the embedded SmolLM2 model."""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_snapkv import ChatSnapKV

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
        params = {
            **self.standard_chat_model_params,
            **self.chat_model_params,
            **(getattr(request, "param", None) or {}),
        }
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
