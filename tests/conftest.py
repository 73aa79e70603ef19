"""Shared fixtures: a tiny random-weight Llama (GQA) for plumbing, the embedded model for real answers."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from snapkv_rag import SnapKVLLM, loading

from snapkv_testing import tiny_llama


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(loading.default_model_dir())


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture()
def tiny_engine(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12)


@pytest.fixture(scope="session")
def engine():
    """The embedded SmolLM2-135M-Instruct, loaded once for the session."""
    return SnapKVLLM(max_new_tokens=32)
