"""``n`` and ``logprobs`` through the server, with the official ``openai`` client on a loopback
port: choices equal to the engine's answers with seed + i, usage counted once, OpenAI's logprob
shapes parsed by the client, streamed == plain."""

from __future__ import annotations

import openai
import pytest
from server_testing import running_server
from snapkv_testing import filler_documents

pytestmark = pytest.mark.usefixtures("one_thread")
ASK = [{"role": "user", "content": "Which river is number 3?"}]
DOCS = filler_documents(3)


@pytest.fixture()
def client(tiny_engine):
    with running_server(tiny_engine) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused")


def _streamed(stream, n):
    """Per choice: its text, its logprob entries (as dicts) and its finish reason."""
    texts, entries, reasons, usage = [""] * n, [[] for _ in range(n)], [None] * n, None
    for event in stream:
        usage = event.usage or usage
        for choice in event.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            if choice.logprobs is not None:
                if hasattr(choice.logprobs, "content"):
                    entries[choice.index] += [e.model_dump() for e in choice.logprobs.content]
                else:
                    entries[choice.index].append(choice.logprobs.model_dump())
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, entries, reasons, usage


def test_chat_n_choices_are_the_engines_with_seed_plus_i_and_usage_counts_the_prompt_once(client, tiny_engine):
    before = tiny_engine.stats().prefills
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        n=3,
        temperature=0.9,
        seed=5,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body={"documents": DOCS},
    )
    assert tiny_engine.stats().prefills - before == 1
    alone = [tiny_engine.chat(ASK, DOCS, temperature=0.9, seed=5 + i, max_new_tokens=8, logprobs=2) for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [a.text for a in alone]
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    for choice, answer in zip(reply.choices, alone):
        content = choice.logprobs.content
        assert [e.token for e in content] == [e.token for e in answer.logprobs]
        assert [e.logprob for e in content] == pytest.approx([e.logprob for e in answer.logprobs], abs=1e-5)
        assert all(bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 2 for e in content)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)


def test_chat_stream_with_n_and_logprobs_equals_the_plain_response(client):
    options = dict(
        model="tiny",
        messages=ASK,
        n=2,
        temperature=0.8,
        seed=11,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"documents": DOCS},
    )
    plain = client.chat.completions.create(**options)
    texts, entries, reasons, usage = _streamed(
        client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}), 2
    )
    assert texts == [c.message.content for c in plain.choices]
    assert entries == [[e.model_dump() for e in c.logprobs.content] for c in plain.choices]
    assert reasons == [c.finish_reason for c in plain.choices]
    assert usage.prompt_tokens == plain.usage.prompt_tokens and usage.completion_tokens == plain.usage.completion_tokens


def test_greedy_logprobs_list_the_chosen_token_first(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, logprobs=True, top_logprobs=4)
    for entry in reply.choices[0].logprobs.content:
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content


def test_completions_legacy_logprobs_plain_and_streamed(client, tiny_engine):
    options = dict(model="tiny", prompt="Where is the castle?", max_tokens=7, logprobs=3, n=2, temperature=0.7, seed=4)
    plain = client.completions.create(**options)
    alone = tiny_engine.generate("Where is the castle?", max_new_tokens=7, temperature=0.7, seed=5, logprobs=3)
    second = plain.choices[1]
    assert second.index == 1 and second.text == alone.text
    lp = second.logprobs
    assert lp.tokens == [e.token for e in alone.logprobs]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)
    assert [list(top) for top in lp.top_logprobs] == [[t.token for t in e.top_logprobs] for e in alone.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    texts, pieces, _, _ = _streamed(client.completions.create(**options, stream=True), 2)
    assert texts == [c.text for c in plain.choices]
    for index, choice in enumerate(plain.choices):
        joined = {key: [v for piece in pieces[index] for v in piece[key]] for key in choice.logprobs.model_dump()}
        assert joined == choice.logprobs.model_dump()


def test_n_larger_than_the_batch_takes_turns(tiny_model, tokenizer):
    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=6, max_batch=2)
    with running_server(llm, max_batch=2) as (url, _):
        reply = openai.OpenAI(base_url=url + "/v1", api_key="unused").chat.completions.create(
            model="tiny", messages=ASK, n=5, temperature=1.0, seed=1, max_tokens=6
        )
    assert [c.index for c in reply.choices] == list(range(5))
    assert [c.message.content for c in reply.choices] == [
        llm.chat(ASK, temperature=1.0, seed=1 + i, max_new_tokens=6).text for i in range(5)
    ]
