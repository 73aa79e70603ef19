"""LangChain's standard unit tests for ChatSnapKV, on a tiny random-weight model."""

from __future__ import annotations

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_snapkv import ChatSnapKV


class TestChatSnapKVUnit(ChatModelUnitTests):
    engine = None

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _share_engine(cls, tiny_engine) -> None:
        cls.engine = tiny_engine

    @property
    def chat_model_class(self) -> type[ChatSnapKV]:
        return ChatSnapKV

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self.engine}

    @property
    def supports_model_override(self) -> bool:
        return False  # the adapter serves the one model its engine loaded
