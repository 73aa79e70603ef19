"""Document-aware SnapKV wherever a method is chosen: the engine (per call, with the request's
spans bound), the server's ``snapkv`` field, the CLI, the evals' ``--methods``, LangChain and
LlamaIndex per-call options."""

from __future__ import annotations

import httpx
from server_testing import running_server
from snapkv_testing import filler_documents

from evals.methods import parse_spec
from snapkv_rag import DocSnapKVConfig
from snapkv_rag.cli import _config, build_parser
from snapkv_rag.methods import DEFAULT_COMPRESSION
from snapkv_rag.methods import selection as compression

QUESTION = "Which harbour lies north?"
DOC = DocSnapKVConfig(max_capacity_prompt=128, window_size=8)


def test_the_engine_binds_each_requests_spans(tiny_engine, monkeypatch):
    seen = []

    def spy(query, keys, values, config, *args, **kwargs):
        seen.append(config.spans)
        return real(query, keys, values, config, *args, **kwargs)

    real = compression.doc_snapkv_select
    monkeypatch.setattr(compression, "doc_snapkv_select", spy)
    docs = filler_documents(4)
    result = tiny_engine.generate(QUESTION, docs, snapkv=DOC, max_new_tokens=3)
    expected = tiny_engine.request(QUESTION, docs, "text").spans
    assert result.compression.method == "docsnapkv" and result.compression.kept_tokens[0] == 128
    assert seen and all(spans == expected for spans in seen) and len(expected.documents) == 4
    seen.clear()
    tiny_engine.generate(QUESTION, filler_documents(2), snapkv=DOC, max_new_tokens=3)
    assert len(seen[0].documents) == 2  # the next request's own spans, not the last one's


def test_the_server_takes_the_method_in_its_snapkv_field(tiny_engine):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": filler_documents(4),
        "max_tokens": 3,
    }
    with running_server(tiny_engine) as (url, _):
        good = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={**body, "snapkv": {"method": "docsnapkv", "budget": 128, "window_size": 8}},
        )
        bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={**body, "snapkv": {"method": "tova"}})
    assert good.status_code == 200, good.text
    assert good.json()["snapkv"]["compression"]["method"] == "docsnapkv"
    assert good.json()["snapkv"]["compression"]["kept_tokens"][0] == 128
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "snapkv.method"


def test_the_cli_method_flag_and_the_evals_specs():
    args = build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "docsnapkv", "--budget", "25%"])
    assert _config(args) == DocSnapKVConfig(ratio=0.25)
    assert _config(build_parser().parse_args(["ask", "q?", "--docs", "a.txt"])) == DEFAULT_COMPRESSION
    assert parse_spec("docsnapkv@25%").config(400) == DocSnapKVConfig(max_capacity_prompt=400)


def test_langchain_and_llamaindex_take_it_per_call(tiny_engine):
    from langchain_snapkv import ChatSnapKV
    from llama_index.llms.snapkv import SnapKVLLM

    docs = filler_documents(4)
    request = tiny_engine.request(QUESTION, docs, "text")
    from langchain_core.documents import Document

    chat = ChatSnapKV(engine=tiny_engine, max_new_tokens=3)
    message = chat.invoke(
        QUESTION, documents=[Document(page_content=d["text"], metadata={"title": d["title"]}) for d in docs], snapkv=DOC
    )
    assert message.response_metadata["compression"]["method"] == "docsnapkv"
    llm = SnapKVLLM(engine=tiny_engine, max_new_tokens=3)
    response = llm.complete(request.text, formatted=True, snapkv=DOC)
    assert response.additional_kwargs["compression"]["method"] == "docsnapkv"  # no documents: SnapKV's selection
