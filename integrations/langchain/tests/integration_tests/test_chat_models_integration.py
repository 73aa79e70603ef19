"""LangChain's standard integration tests for ChatSnapKV, on the embedded SmolLM2 model."""

from __future__ import annotations

import pytest
from langchain_snapkv import ChatSnapKV
from langchain_tests.integration_tests import ChatModelIntegrationTests

pytestmark = pytest.mark.model


class TestChatSnapKVIntegration(ChatModelIntegrationTests):
    engine = None

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _share_engine(cls, real_engine) -> None:
        cls.engine = real_engine

    @property
    def chat_model_class(self) -> type[ChatSnapKV]:
        return ChatSnapKV

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self.engine, "max_tokens": 8}

    @property
    def supports_model_override(self) -> bool:
        return False  # the adapter serves the one model its engine loaded
