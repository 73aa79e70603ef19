"""The default compression (:mod:`snapkv_rag.methods.default`): lookahead SnapKV keeping half of each
prompt, never fewer than ``FLOOR`` tokens, wherever a caller does not choose one: ``SnapKVLLM()``,
``snapkv=True``, the command line, the server and both framework adapters. A config asked for is
unchanged: ``SnapKVConfig()`` is plain SnapKV at 1,024 tokens, as before."""

from __future__ import annotations

import math

import httpx
import pytest
from server_testing import running_server
from snapkv_testing import filler_documents

from snapkv_rag import AdaSnapKVConfig, LookaheadSnapKVConfig, SnapKVConfig, SnapKVLLM
from snapkv_rag.cli import _config, build_parser
from snapkv_rag.methods import DEFAULT_COMPRESSION
from snapkv_rag.methods.default import FLOOR, RATIO
from snapkv_rag.runtime import draft
from snapkv_rag.server.protocol import ServerSettings
from snapkv_rag.server.protocol import _compression as server_config

pytestmark = pytest.mark.usefixtures("one_thread", "engine_default")
QUESTION = "Which harbour lies north?"
DOCS = filler_documents(6)  # a 701-token RAG prompt with the embedded tokenizer
LONG = filler_documents(10)  # 1,146 tokens: past twice the floor, half of it kept


@pytest.fixture()
def llm(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=4)


def test_the_default_is_lookahead_at_half_of_each_prompt_above_a_floor():
    assert DEFAULT_COMPRESSION == LookaheadSnapKVConfig(ratio=RATIO, min_capacity_prompt=FLOOR, lookahead=4)
    assert RATIO == 0.5 and DEFAULT_COMPRESSION.floor == 1.0  # an even split: SnapKV's bytes
    assert FLOOR == 512 and DEFAULT_COMPRESSION.for_prompt(701).max_capacity_prompt == FLOOR
    assert DEFAULT_COMPRESSION.for_prompt(1146).max_capacity_prompt == 573
    assert SnapKVConfig() == SnapKVConfig(max_capacity_prompt=1024)  # asked for: plain SnapKV, as before


def test_an_engine_compresses_a_700_token_rag_prompt_by_default(llm):
    assert llm.default_snapkv == DEFAULT_COMPRESSION
    result = llm.generate(QUESTION, DOCS)
    prompt, c = result.usage.prompt_tokens, result.compression
    assert 600 <= prompt <= 1100
    assert c.method == "lookahead" and c.kept_tokens == [FLOOR] * 2 and c.ratio == pytest.approx(FLOOR / prompt)
    long = llm.generate(QUESTION, LONG).compression
    assert long.kept_tokens == [math.ceil(long.prompt_tokens / 2)] * 2  # half of a longer one
    again = llm.generate(QUESTION, DOCS, snapkv=True).compression  # True: the default
    assert (again.method, again.kept_tokens) == (c.method, c.kept_tokens)
    plain = llm.generate(QUESTION, DOCS, snapkv=SnapKVConfig()).compression
    assert plain.method == "snapkv" and plain.ratio == 1.0  # 1,024 tokens hold this prompt whole


def test_a_prompt_under_the_floor_is_kept_whole_without_a_draft_and_one_above_keeps_the_floor(llm, monkeypatch):
    drafts = []
    real = draft.draft_and_vote
    monkeypatch.setattr(draft, "draft_and_vote", lambda *a, **k: drafts.append(1) or real(*a, **k))
    short = llm.generate(QUESTION, filler_documents(3)).compression
    assert short.prompt_tokens < FLOOR and short.ratio == 1.0 and short.method == "lookahead" and not drafts
    middle = llm.generate(QUESTION, DOCS).compression
    assert FLOOR < middle.prompt_tokens < 2 * FLOOR and middle.kept_tokens == [FLOOR] * 2 and drafts == [1]


def test_the_cli_the_server_and_the_adapters_default_to_it(llm):
    assert _config(build_parser().parse_args(["ask", "q?", "--docs", "a.txt"])) == DEFAULT_COMPRESSION
    assert _config(build_parser().parse_args(["serve"])) == DEFAULT_COMPRESSION
    quarter = _config(build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--budget", "25%"]))
    assert quarter == LookaheadSnapKVConfig(ratio=0.25, lookahead=4)  # the default method, its own settings
    named = _config(build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "lookahead"]))
    assert named.lookahead == 8  # a method named: its own defaults
    settings = ServerSettings(model_name="tiny")
    assert settings.compression == settings.base_compression == DEFAULT_COMPRESSION
    # another method named in a request takes the default's budget and floor, and its own settings
    switched = server_config({"method": "adasnapkv"}, settings)
    assert switched == AdaSnapKVConfig(ratio=RATIO, min_capacity_prompt=FLOOR)
    assert server_config(True, settings) == DEFAULT_COMPRESSION
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "documents": DOCS, "max_tokens": 2}
    with running_server(llm) as (url, _):
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["snapkv"]["compression"]["method"] == "lookahead"

    from langchain_core.documents import Document

    from langchain_snapkv import ChatSnapKV
    from llama_index.llms.snapkv import SnapKVLLM as LlamaIndexSnapKV

    chat = ChatSnapKV(engine=llm, max_new_tokens=2)
    documents = [Document(page_content=d["text"], metadata={"title": d["title"]}) for d in DOCS]
    message = chat.invoke(QUESTION, documents=documents)
    assert message.response_metadata["compression"]["method"] == "lookahead"
    response = LlamaIndexSnapKV(engine=llm, max_new_tokens=2).complete(llm.request(QUESTION, DOCS).text, formatted=True)
    assert response.additional_kwargs["compression"]["method"] == "lookahead"


@pytest.mark.model
def test_the_embedded_model_compresses_a_700_token_rag_prompt_by_default():
    from evals.datasets import build

    llm = SnapKVLLM(max_new_tokens=8)
    try:
        example = next(
            e
            for e in build("nq", 10, [5], ["middle"], 0)
            if 600 <= llm.prompt_tokens(e.question, list(e.documents)) <= 800
        )
        result = llm.generate(example.question, list(example.documents))
    finally:
        llm.close()
    prompt, c = result.usage.prompt_tokens, result.compression
    assert c.method == "lookahead" and c.kept_tokens == [FLOOR] * 30 and FLOOR < prompt
    assert c.ratio == pytest.approx(FLOOR / prompt) and result.text
