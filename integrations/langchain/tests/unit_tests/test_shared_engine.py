"""Adapters that name the same model and settings share one loaded engine (LangChain and LlamaIndex
alike), each call still runs with its own instance's options, and the engine is closed when the
last holder lets go."""

from __future__ import annotations

import gc
import time

import pytest

from langchain_snapkv import ChatSnapKV
from snapkv_rag.frameworks import shared as adapters
from snapkv_rag.runtime import attention


def attached(model) -> bool:
    """Whether an open engine routes ``model``'s attention (closing one switches it back)."""
    return model.config._attn_implementation.startswith(attention.PREFIX)


def test_same_spec_shares_one_engine_and_options_stay_per_instance(tiny_parts):
    model, tokenizer = tiny_parts
    short = ChatSnapKV(model=model, tokenizer=tokenizer, max_tokens=3)
    long = ChatSnapKV(model=model, tokenizer=tokenizer, max_tokens=7, stop=["\n\n\n"])
    other = ChatSnapKV(model=model, tokenizer=tokenizer, instruction="Answer briefly.")
    assert short.engine is long.engine and other.engine is not short.engine
    alone = short.invoke("Hello").content
    assert long.invoke("Hello").usage_metadata["output_tokens"] == 7  # long's own max_tokens
    again = short.invoke("Hello")
    assert again.usage_metadata["output_tokens"] == 3 and again.content == alone  # nothing of long's leaked
    assert short.invoke("Hello", max_tokens=5).usage_metadata["output_tokens"] == 5
    assert short.invoke("Hello").usage_metadata["output_tokens"] == 3  # a call's own option was that call's
    for chat in (short, long, other):
        chat.close()


def test_llama_index_adapters_share_the_engine_of_the_same_spec(tiny_parts):
    snapkv_llm = pytest.importorskip("llama_index.llms.snapkv").SnapKVLLM
    model, tokenizer = tiny_parts
    chat = ChatSnapKV(model=model, tokenizer=tokenizer, max_tokens=4)
    llm = snapkv_llm(model=model, tokenizer=tokenizer, max_new_tokens=4)
    assert llm.engine is chat.engine
    assert llm.complete("Hello").text == chat.invoke("Hello").content
    chat.close()
    llm.close()


def test_the_engine_closes_when_the_last_holder_closes_or_is_collected(tiny_parts, monkeypatch):
    model, tokenizer = tiny_parts
    first, second = (ChatSnapKV(model=model, tokenizer=tokenizer, max_tokens=2) for _ in range(2))
    engine = first.engine
    first.close()
    assert attached(model) and second.invoke("Hi").usage_metadata["output_tokens"] == 2  # still held
    second.close()
    assert not attached(model)  # the last holder closed it: at once
    third = ChatSnapKV(model=model, tokenizer=tokenizer, max_tokens=2)
    assert third.engine is not engine and attached(model)  # a new spec holder loads anew
    monkeypatch.setattr(adapters, "IDLE_CLOSE_S", 0.05)
    del third
    gc.collect()
    deadline = time.monotonic() + 30
    while attached(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not attached(model)  # collected: closed once the idle grace period ran out
