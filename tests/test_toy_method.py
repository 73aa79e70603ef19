"""A new method is one file and one registry entry: ``tests/toy_method.py`` (a method that keeps the
prompt's last positions) runs through the engine, the server, the document store and the evals with
no other change, and each of them keeps what it says it keeps."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_testing import running_server
from snapkv_testing import filler_documents
from toy_method import RecentConfig

from evals.__main__ import main as evals_main
from snapkv_rag.methods import METHODS, method_class

QUESTION = "Which harbour lies north?"


@pytest.fixture()
def registered(monkeypatch):
    """The registry entry (what a method in the package adds to ``METHODS``' tuple)."""
    monkeypatch.setitem(METHODS, RecentConfig.method, RecentConfig)
    return RecentConfig


def test_the_engine_keeps_the_last_positions(registered, tiny_engine):
    docs = filler_documents(4)
    result = tiny_engine.generate(QUESTION, docs, snapkv=RecentConfig(max_capacity_prompt=40), max_new_tokens=4)
    stats = result.compression
    assert stats.method == "recent" and stats.kept_tokens == [40, 40] and stats.prompt_tokens > 200
    request = tiny_engine.request(QUESTION, docs)
    with torch.inference_mode():
        pre = tiny_engine.runner.prefill([request.input_ids], {"recent": RecentConfig(max_capacity_prompt=40)})
    for positions in pre.compressed["recent"][0].kept_positions().values():
        assert positions[0, 0].tolist() == list(range(stats.prompt_tokens - 40, stats.prompt_tokens))
    assert method_class("recent") is RecentConfig


def test_a_query_agnostic_method_is_stored_and_asked_again(registered, tiny_engine):
    docs = filler_documents(4)
    handle = tiny_engine.index_documents(docs, method=RecentConfig(max_capacity_prompt=64))
    first, second = handle.generate(QUESTION, max_new_tokens=3), handle.generate("What lies east?", max_new_tokens=3)
    assert first.usage.cached_tokens > 200 and second.usage.cached_tokens == first.usage.cached_tokens


def test_the_server_takes_it_by_name(registered, tiny_engine):
    with running_server(tiny_engine) as (url, _):
        long = " ".join(d["text"] for d in filler_documents(3)) + " " + QUESTION  # no documents: no stored-set path
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": long}],
            "max_tokens": 3,
            "snapkv": {"method": "recent", "budget": 48},
        }
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        compression = reply.json()["snapkv"]["compression"]
        assert compression["method"] == "recent" and compression["kept_tokens"] == [48, 48]
        bad = httpx.post(
            url + "/v1/chat/completions", json={**body, "snapkv": {"method": "recent", "window_size": 8}}, timeout=60
        )
        assert bad.status_code == 400 and "not a setting of method recent" in bad.json()["error"]["message"]


def test_the_evals_run_it(registered, tmp_path, tiny_engine):
    args = [
        "--datasets",
        "kv",
        "--num-docs",
        "5",
        "--gold-positions",
        "first",
        "--num-questions",
        "1",
        "--methods",
        "full,recent@64",
        "--max-new-tokens",
        "3",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert evals_main(args, engine=tiny_engine) == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    recent = [r for r in rows if r["method"] == "recent@64"]
    assert recent and all(r["kept_tokens"] == 64 or r["kept_tokens"] == [64, 64] for r in recent), recent
