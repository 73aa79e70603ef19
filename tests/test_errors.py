"""Bad input gets an error that names the problem, and the engine keeps working afterwards."""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents, tiny_llama

from snapkv_rag import ContextLengthError, ModelLoadError, SnapKVConfig, SnapKVLLM


def still_works(engine):
    result = engine.generate("Is it still working?", ["A short document."], max_new_tokens=3)
    assert result.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda e: e.generate(""), ValueError, "question"),
        (lambda e: e.generate("   "), ValueError, "question"),
        (lambda e: e.generate(42), TypeError, "question"),
        (lambda e: e.generate("q", [1, 2]), TypeError, "documents[0]"),
        (lambda e: e.generate("q", ["ok", {"title": "no text"}]), TypeError, "documents[1]"),
        (lambda e: e.generate("q", "a single string"), TypeError, "documents"),
        (lambda e: e.generate("q", max_new_tokens=0), ValueError, "max_new_tokens"),
        (lambda e: e.generate("q", max_new_tokens=-3), ValueError, "max_new_tokens"),
        (lambda e: e.generate("q", temperature=-1), ValueError, "temperature"),
        (lambda e: e.generate("q", top_p=0), ValueError, "top_p"),
        (lambda e: e.generate("q", snapkv="yes"), TypeError, "snapkv"),
        (lambda e: e.generate("q", budget=3), TypeError, "budget"),
        (lambda e: e.chat([{"role": "robot", "content": "hi"}]), ValueError, "role"),
        (lambda e: e.chat([]), ValueError, "messages"),
    ],
)
def test_bad_requests_name_the_problem(tiny_engine, call, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call(tiny_engine)
    still_works(tiny_engine)


def test_prompt_over_the_context_window_gives_count_and_limit(tokenizer):
    engine = SnapKVLLM(model=tiny_llama(len(tokenizer), max_position_embeddings=256), tokenizer=tokenizer)
    with pytest.raises(ContextLengthError) as info:
        engine.generate("What lies north?", filler_documents(10), max_new_tokens=8)
    message = str(info.value)
    tokens = engine.prompt_tokens("What lies north?", filler_documents(10))
    assert f"prompt is {tokens} tokens" in message and "context window of 256 tokens" in message
    still_works(engine)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (
            {"snapkv": SnapKVConfig(max_capacity_prompt=64, window_size=8), "attn_implementation": "flash_attention_2"},
            ValueError,
            "flash-attn",
        ),
        ({"attn_implementation": "paged"}, ValueError, "attn_implementation"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"device": "gpu0"}, ValueError, "device: 'gpu0' is not a torch device"),
        ({"device": "cuda:99"}, ValueError, "device: 'cuda:99' was asked"),
    ],
)
def test_engine_options_are_checked(tiny_model, tokenizer, kwargs, error, words):
    with pytest.raises(error, match=words):
        SnapKVLLM(model=tiny_model, tokenizer=tokenizer, **kwargs)


def test_unusable_device_is_refused_before_loading_weights():
    with pytest.raises(ValueError, match="device: 'cuda:99' was asked"):
        SnapKVLLM("/no/such/model", device="cuda:99")  # the device is checked before the path


def test_unknown_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        SnapKVLLM(model=str(missing))
    with pytest.raises(ModelLoadError, match="does not exist"):
        SnapKVLLM(model=str(tmp_path / "weights.gguf"))
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="empty-folder"):
        SnapKVLLM(model=str(empty))


def test_inputs_are_not_modified(tiny_engine):
    docs = [{"title": "T", "text": "Some text [3] Question: x", "id": 7, "lang": "en"}, "plain"]
    messages = [{"role": "user", "content": "What lies north?"}]
    snapshot = [dict(docs[0]), docs[1]], [dict(messages[0])]
    result = tiny_engine.chat(messages, docs, max_new_tokens=3)
    assert ([dict(docs[0]), docs[1]], [dict(messages[0])]) == snapshot
    assert result.documents[0].id == "7" and result.documents[0].metadata == {"lang": "en"}


def test_device_and_dtype_given_with_a_loaded_model_are_applied(tokenizer):
    engine = SnapKVLLM(model=tiny_llama(len(tokenizer)), tokenizer=tokenizer, device="cpu", dtype="bfloat16")
    assert engine.device == torch.device("cpu") and engine.model.dtype == torch.bfloat16
    still_works(engine)


@pytest.mark.parametrize(
    "native,given,expected,warned",
    [
        (True, None, torch.float32, False),  # the CPU default stays float32: bfloat16 changes answers
        (False, None, torch.float32, False),
        (True, "bfloat16", torch.bfloat16, False),  # a dtype given always wins
        (False, "bfloat16", torch.bfloat16, True),  # ... and where it is only emulated, the log says so
    ],
)
def test_cpu_dtype_default_and_emulated_bfloat16(monkeypatch, caplog, native, given, expected, warned):
    from snapkv_rag.models import loading

    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: native)
    with caplog.at_level("WARNING", logger="snapkv_rag.models.loading"):
        assert loading.resolve_dtype(given, "cpu") == expected
    assert ("emulated" in caplog.text) == warned
