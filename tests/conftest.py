"""Shared fixtures: a tiny random-weight Llama (GQA) for plumbing, the embedded model for real answers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from snapkv_rag import SnapKVLLM, loading


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(loading.default_model_dir())


def tiny_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """2 layers, 4 query heads sharing 2 KV heads, head dim 16: the real Llama code at toy size."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                    pad_token_id=2, bos_token_id=1, eos_token_id=2)
    config = LlamaConfig(**{**settings, **overrides})
    return LlamaForCausalLM(config).eval()


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


def filler_documents(count: int, words: int = 60) -> list[dict]:
    """Deterministic documents of about ``words`` words each."""
    topics = ["river", "mountain", "library", "harbour", "orchard", "railway", "castle", "market"]
    return [{"title": f"{topics[i % len(topics)].title()} {i}",
             "text": " ".join(f"The {topics[(i + j) % len(topics)]} number {i * 31 + j} lies north." for j in range(words // 6))}
            for i in range(count)]
