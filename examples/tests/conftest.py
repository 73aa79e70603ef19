"""The examples import their siblings (``rag_data``, ``langchain_rag``) as scripts do."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def engine():
    from snapkv_rag import SnapKVLLM

    return SnapKVLLM()
