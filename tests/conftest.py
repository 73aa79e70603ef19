"""Shared fixtures: a tiny random-weight Llama (GQA) for plumbing, the embedded model for real answers."""

from __future__ import annotations

import os

import pytest
import torch
from snapkv_testing import tiny_llama
from transformers import AutoTokenizer

from snapkv_rag import SnapKVLLM
from snapkv_rag.models import loading

# The engine's tiny-model tests can run on another device and dtype (the GPU check does, on CUDA
# in bfloat16), with a tokenizer folder of their own where the embedded model is not installed.
if os.environ.get("SNAPKV_TEST_DEVICE"):
    torch.set_default_device(os.environ["SNAPKV_TEST_DEVICE"])
if os.environ.get("SNAPKV_TEST_DTYPE"):
    torch.set_default_dtype(getattr(torch, os.environ["SNAPKV_TEST_DTYPE"]))


@pytest.fixture(scope="session", autouse=True)
def _plain_snapkv(plain_snapkv_default):
    """Every engine here defaults to plain SnapKV at 1,024 tokens (the root conftest's
    ``plain_snapkv_default``) unless a test asks for ``engine_default``."""


@pytest.fixture(scope="module")
def one_thread():
    """Toy models are all overhead: one thread is ~10x faster than two on a busy machine (a module
    uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.environ.get("SNAPKV_TEST_TOKENIZER") or loading.default_model_dir())


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
