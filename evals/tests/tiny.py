"""A tiny random-weight Llama engine for plumbing tests, and a CLI wrapper around it so that a test
can run (and SIGKILL) an eval in a subprocess: ``python -m evals.tests.tiny ARGS``."""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from snapkv_rag import SnapKVLLM
from snapkv_rag.models import loading


def tiny_engine() -> SnapKVLLM:
    """2 layers, 4 query heads sharing 2 KV heads, the embedded model's tokenizer; seeded weights."""
    tokenizer = AutoTokenizer.from_pretrained(loading.default_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
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
    return SnapKVLLM(model=LlamaForCausalLM(config), tokenizer=tokenizer)


if __name__ == "__main__":
    from evals.__main__ import main

    raise SystemExit(main(sys.argv[1:], engine=tiny_engine()))
