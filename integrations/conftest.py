"""Engines shared by the integration tests: a tiny random-weight Llama (fast unit tests) and the
embedded SmolLM2-135M-Instruct (tests marked ``model``), each loaded once per session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from snapkv_rag import SnapKVLLM
from snapkv_rag.models.loading import default_model_dir


@pytest.fixture(scope="session", autouse=True)
def _plain_snapkv(plain_snapkv_default):
    """Every engine here defaults to plain SnapKV at 1,024 tokens (the root conftest's
    ``plain_snapkv_default``) unless a test asks for ``engine_default``."""


def tiny_model_and_tokenizer() -> tuple[LlamaForCausalLM, object]:
    """A fresh tiny random-weight Llama (seeded) and the embedded model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


def build_tiny_engine(**options) -> SnapKVLLM:
    model, tokenizer = tiny_model_and_tokenizer()
    return SnapKVLLM(model=model, tokenizer=tokenizer, **options)


@pytest.fixture(scope="session")
def tiny_engine() -> SnapKVLLM:
    return build_tiny_engine(max_new_tokens=8)


@pytest.fixture(scope="session")
def real_engine() -> SnapKVLLM:
    return SnapKVLLM(max_new_tokens=24)


@pytest.fixture()
def tiny_parts() -> tuple[LlamaForCausalLM, object]:
    """A model and tokenizer of this test's own, for adapters that load their engine from them."""
    return tiny_model_and_tokenizer()
