"""The HTTP layer over a tiny random-weight model: OpenAI's shapes, documents, per-request
compression, errors, limits, keys, metrics, and a disconnect that cancels its request."""

from __future__ import annotations

import contextlib
import io
import json
import time

import httpx
import pytest
from server_testing import running_server, sse_events
from snapkv_testing import filler_documents

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Which river is number 3?"}]


@pytest.fixture()
def server(tiny_engine):
    with running_server(tiny_engine, max_documents=8) as (url, app):
        yield url, app


def post(url, path=CHAT, **body):
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)


def test_chat_answer_is_the_engines_answer_with_usage_citations_and_compression(server, tiny_engine):
    url, _ = server
    docs = filler_documents(4)
    reply = post(url, messages=ASK, documents=docs, max_tokens=10, snapkv={"max_capacity_prompt": 96})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    from snapkv_rag import SnapKVConfig

    alone = tiny_engine.chat(ASK, docs, max_new_tokens=10, snapkv=SnapKVConfig(max_capacity_prompt=96))
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": alone.text}
    assert body["choices"][0]["finish_reason"] == alone.finish_reason
    assert body["usage"] == {
        "prompt_tokens": alone.usage.prompt_tokens,
        "completion_tokens": 10,
        "total_tokens": alone.usage.prompt_tokens + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # (the server's request came first)
    assert alone.usage.cached_tokens > 0  # the same documents again: their prefix came from the cache
    compression = body["snapkv"]["compression"]
    assert compression["kept_tokens"] == [96, 96] and compression["prompt_tokens"] > 96
    assert body["snapkv"]["citations"] == alone.citations


def test_documents_inside_a_message_and_per_request_full_cache(server, tiny_engine):
    url, _ = server
    docs = filler_documents(3)
    inside = post(url, messages=[{**ASK[0], "documents": docs}], max_tokens=6, snapkv=False).json()
    top = post(url, messages=ASK, documents=docs, max_tokens=6, snapkv=False).json()
    assert inside["choices"][0]["message"]["content"] == top["choices"][0]["message"]["content"]
    assert inside["snapkv"]["compression"]["method"] == "full"
    assert inside["usage"]["prompt_tokens"] == len(tiny_engine.request(ASK, docs).input_ids)
    share = post(url, messages=ASK, documents=docs, max_tokens=2, snapkv={"budget": "50%"}).json()
    prompt = share["usage"]["prompt_tokens"]  # 376 tokens: half of it is over the 128-token floor
    assert prompt > 256 and share["snapkv"]["compression"]["kept_tokens"] == [-(-prompt // 2)] * 2


def test_completions_and_models_and_health(server, tiny_engine):
    url, _ = server
    body = post(url, "/v1/completions", prompt="Which river is number 3?", max_tokens=5).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == tiny_engine.generate("Which river is number 3?", max_new_tokens=5).text
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_streaming_concatenates_to_the_answer_and_ends_with_usage(server, tiny_engine):
    url, _ = server
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(reply))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == tiny_engine.chat(ASK, max_new_tokens=8).text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "compression" in chunks[-2]["snapkv"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "body,status,param,words",
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        ({"messages": ASK}, 400, "model", "model"),
        ({"model": "gpt-4", "messages": ASK}, 404, "model", "not served here"),
        ({"model": "tiny", "messages": []}, 400, "messages", "non-empty"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "one of"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
        ({"model": "tiny", "messages": ASK, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
        ({"model": "tiny", "messages": ASK, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"model": "tiny", "messages": ASK, "temperature": True}, 400, "temperature", "number"),
        ({"model": "tiny", "messages": ASK, "top_p": 0}, 400, "top_p", "(0, 1]"),
        ({"model": "tiny", "messages": ASK, "stop": [1]}, 400, "stop", "strings"),
        ({"model": "tiny", "messages": ASK, "n": 17}, 400, "n", "from 1 to 16"),
        ({"model": "tiny", "messages": ASK, "n": 0}, 400, "n", "from 1 to 16"),
        ({"model": "tiny", "messages": ASK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "from 0 to 20"),
        ({"model": "tiny", "messages": ASK, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
        ({"model": "tiny", "messages": ASK, "logprobs": 3}, 400, "logprobs", "boolean"),
        ({"model": "tiny", "messages": ASK, "tools": [{"type": "function"}]}, 400, "tools[0]", "expected"),
        ({"model": "tiny", "messages": ASK, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
        ({"model": "tiny", "messages": ASK, "documents": "one"}, 400, "documents", "list"),
        ({"model": "tiny", "messages": ASK, "documents": [{"title": "x"}]}, 400, "documents[0]", "text"),
        (
            {"model": "tiny", "messages": ASK, "snapkv": {"max_capacity_prompt": 8}},
            400,
            "snapkv.max_capacity_prompt",
            "larger than window_size",
        ),
        ({"model": "tiny", "messages": ASK, "snapkv": {"keep": 3}}, 400, "snapkv.keep", "unknown field"),
        (
            {"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}], "documents": ["d"]},
            400,
            "messages",
            "last message",
        ),
        ({"model": "tiny", "messages": ASK, "max_tokens": 8190}, 400, "messages", "context window is 8192"),
        (
            {"model": "tiny", "messages": ASK, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
            "needs 'json_schema'",
        ),
    ],
)
def test_bad_input_gets_openai_error_bodies_never_a_500(server, body, status, param, words):
    url, _ = server
    reply = httpx.post(url + CHAT, content=body if isinstance(body, bytes) else json.dumps(body), timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert post(url, messages=ASK, max_tokens=2).status_code == 200  # still serving


def test_too_many_documents_and_too_large_bodies_are_refused_before_tokenising(server, tiny_engine, monkeypatch):
    url, _ = server
    calls = []
    monkeypatch.setattr(tiny_engine.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or "never")
    reply = post(url, messages=ASK, documents=filler_documents(9))
    assert (
        reply.status_code == 400 and "9 documents, more than this server takes (8)" in reply.json()["error"]["message"]
    )
    with running_server(tiny_engine, max_body_bytes=1000) as (small, _):
        big = post(small, messages=[{"role": "user", "content": "x" * 2000}])
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: counted as it arrives
            yield json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "y" * 3000}]}).encode()

        assert httpx.post(small + CHAT, content=chunked()).status_code == 413
    assert calls == []


def test_api_key_guards_every_endpoint_but_health(tiny_engine):
    with running_server(tiny_engine, api_key="s3cret") as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", CHAT)):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                reply = httpx.request(method, url + path, headers=headers, json={})
                assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_no_cors_unless_configured(tiny_engine, server):
    url, _ = server
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(url + CHAT, headers=preflight).headers
    with running_server(tiny_engine, cors_origins=("http://app.example",)) as (cors, _):
        reply = httpx.options(cors + CHAT, headers=preflight)
        assert reply.headers["access-control-allow-origin"] == "http://app.example"


def _count_forwards(model):
    calls = []
    return calls, model.register_forward_pre_hook(lambda *a: calls.append(time.monotonic()))


def test_a_full_queue_gets_429_and_a_disconnected_stream_stops_generating(tiny_engine):
    calls, hook = _count_forwards(tiny_engine.model)
    try:
        with running_server(tiny_engine, max_batch=1, max_queue=0) as (url, app):
            body = {"model": "tiny", "messages": ASK, "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + CHAT, json=body, timeout=60) as reply:
                events = sse_events(reply)
                pieces = [next(events) for _ in range(6)]
                assert all(p["choices"][0]["finish_reason"] is None for p in pieces)
                full = post(url, messages=ASK, max_tokens=2)
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
                assert "max batch 1 + queue 0; --max-batch and --max-queue" in full.json()["error"]["message"]
            # the client is gone: the engine stops within a step or two, and the slot is free again
            deadline = time.monotonic() + 10
            while (app.state.status["in_flight"] or tiny_engine.stats().running) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert app.state.status["in_flight"] == 0 and tiny_engine.stats().running == 0
            time.sleep(0.3)
            stopped_at = len(calls)
            time.sleep(0.5)
            assert len(calls) == stopped_at < 1000
            assert post(url, messages=ASK, max_tokens=2).status_code == 200
            metrics = httpx.get(url + "/metrics").text
            assert 'snapkv_rag_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0' in metrics
    finally:
        hook.remove()


def test_metrics_count_tokens_and_latency(server):
    url, _ = server
    body = post(
        url, messages=ASK, documents=filler_documents(4), max_tokens=4, snapkv={"max_capacity_prompt": 64}
    ).json()
    text = httpx.get(url + "/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["snapkv_rag_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert values["snapkv_rag_kept_prompt_tokens_total"] == 64
    assert values["snapkv_rag_generation_tokens_total"] == 4
    assert values['snapkv_rag_request_duration_seconds_count{endpoint="/v1/chat/completions"}'] == 1
    assert values['snapkv_rag_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"}'] == 1
    assert values["snapkv_rag_queue_depth"] == 0 and values["snapkv_rag_running_requests"] == 0


def test_ignore_eos_decodes_exactly_max_tokens(tokenizer):
    import torch
    from snapkv_testing import tiny_llama

    from snapkv_rag import SnapKVLLM

    model = tiny_llama(len(tokenizer), seed=1)
    model.lm_head = torch.nn.Linear(64, len(tokenizer), bias=True)  # a model that always says end-of-sequence
    torch.nn.init.zeros_(model.lm_head.weight)
    with torch.no_grad():
        model.lm_head.bias.zero_()
        model.lm_head.bias[tokenizer.eos_token_id] = 1.0
    with running_server(SnapKVLLM(model=model, tokenizer=tokenizer)) as (url, _):
        plain = post(url, messages=ASK, max_tokens=9).json()
        forced = post(url, messages=ASK, max_tokens=9, ignore_eos=True).json()
    assert plain["usage"]["completion_tokens"] == 0 and plain["choices"][0]["finish_reason"] == "stop"
    assert forced["usage"]["completion_tokens"] == 9 and forced["choices"][0]["finish_reason"] == "length"


def test_each_limit_names_itself_and_the_option_that_sets_it(tiny_engine):
    """Body size (413), documents and prompt tokens (400), streams open (429; the queue's: above): each
    error names the limit's value and its ``serve`` option, whose default ``serve --help`` gives."""
    limits = {"max_body_bytes": 3000, "max_documents": 2, "max_prompt_tokens": 60, "max_streams": 1}
    with running_server(tiny_engine, max_batch=2, max_queue=0, **limits) as (url, app):
        big = post(url, messages=[{"role": "user", "content": "x" * 4000}])
        assert big.status_code == 413 and "limit of 3000 bytes; --max-body-bytes" in big.json()["error"]["message"]
        many = post(url, messages=ASK, documents=["a", "b", "c"])
        assert many.status_code == 400 and "takes (2); --max-documents" in many.json()["error"]["message"]
        long = post(url, messages=[{"role": "user", "content": "river " * 80}])
        error = long.json()["error"]
        assert long.status_code == 400 and error["code"] == "prompt_too_long"
        assert "limit of 60 prompt tokens; --max-prompt-tokens" in error["message"]
        body = {"model": "tiny", "messages": ASK, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        slow = tiny_engine.model.register_forward_pre_hook(lambda *a: time.sleep(0.02))  # the stream stays open
        with httpx.stream("POST", url + CHAT, json=body, timeout=60) as reply, contextlib.ExitStack() as undo:
            undo.callback(slow.remove)
            events = sse_events(reply)  # kept: a generator collected would close the stream
            next(events)
            second = httpx.post(url + CHAT, json=body, timeout=60)
            assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_streams"
            assert "limit is 1; --max-streams" in second.json()["error"]["message"]
            assert post(url, messages=ASK, max_tokens=2).status_code == 200  # not a stream: let in
        deadline = time.monotonic() + 10  # the closed stream is cancelled within a step or two
        while app.state.server.streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.server.streams == 0 and app.state.server.in_flight == 0
    from snapkv_rag.cli import main

    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        main(["serve", "--help"])
    words = " ".join(out.getvalue().split())
    for option, default in (
        ("--max-body-bytes", "default 4 MiB"),
        ("--max-documents", "default 64"),
        ("--max-prompt-tokens", "default: the model's context window"),
        ("--max-streams", "default 64"),
        ("--max-queue", "default 64"),
        ("--doc-store-disk-bytes", "default 4 GiB"),
    ):
        assert option in words and default in words, (option, default)
