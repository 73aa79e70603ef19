"""Test helpers shared by the core tests (a unique module name: other test folders have a conftest)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """2 layers, 4 query heads sharing 2 KV heads, head dim 16: the real Llama code at toy size."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlamaConfig(**{**settings, **overrides})
    return LlamaForCausalLM(config).eval()


def seeded(seed: int) -> torch.Generator:
    """A seeded generator on the device tensors are made on (the GPU check runs these tests on CUDA)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def cache_kwarg(model) -> str:
    """The name a model's forward takes its KV cache under (``past_key_values`` in older transformers 5)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def filler_documents(count: int, words: int = 60) -> list[dict]:
    """Deterministic documents of about ``words`` words each."""
    topics = ["river", "mountain", "library", "harbour", "orchard", "railway", "castle", "market"]
    return [
        {
            "title": f"{topics[i % len(topics)].title()} {i}",
            "text": " ".join(
                f"The {topics[(i + j) % len(topics)]} number {i * 31 + j} lies north." for j in range(words // 6)
            ),
        }
        for i in range(count)
    ]


def capture_caches(model):
    """Record, at every forward call, how many tokens each cache layer holds (a public torch hook and
    the cache layers' own ``get_seq_length``, no engine internals)."""
    seen = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append([layer.get_seq_length() for layer in cache.layers] if cache is not None and cache.layers else [])

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def poisoning_empty_slots(select, seen: list):
    """``select`` (a function returning ``(keys, values, kept_positions)``) with every empty slot
    (position < 0) filled with huge keys and values; appends the count of empty slots to ``seen``."""

    def poisoned(*args, **kwargs):
        keys, values, kept = select(*args, **kwargs)
        empty = (kept < 0)[..., None]
        seen.append(int(empty.sum()))
        return keys.masked_fill(empty, 1e4), values.masked_fill(empty, -1e4), kept

    return poisoned
