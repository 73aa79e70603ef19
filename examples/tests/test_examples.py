"""Each example runs offline on the embedded model and prints real results, with no deprecation
warning from what it uses on the pinned versions (a warning fails the test)."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.model, pytest.mark.filterwarnings("error::DeprecationWarning")]


def test_langchain_rag(engine, capsys):
    import langchain_rag

    langchain_rag.main(engine, questions=1)
    out = capsys.readouterr().out
    answer = re.search(r"^A: (.+)$", out, re.M)
    assert answer and answer.group(1).strip()
    kept, prompt = map(int, re.search(r"kept (\d+)/(\d+) prompt tokens", out).groups())
    assert kept <= 128 < prompt  # the retrieved prompt was compressed to the budget


def test_llama_index_rag(engine, capsys):
    import llama_index_rag

    llama_index_rag.main(engine, questions=1)
    out = capsys.readouterr().out
    assert re.search(r"^A: \S", out, re.M)
    assert re.search(r"Source 1: \S", out)
    assert "List of Nobel laureates in Physics" in out  # the gold passage was retrieved


def test_compare_full_vs_snapkv(engine, capsys):
    import compare_full_vs_snapkv

    compare_full_vs_snapkv.main(engine, questions=1)
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\s+(full cache|snapkv-128): kept (\d+)/\d+ tokens", out, re.M))
    assert int(rows["snapkv-128"]) == 128 < int(rows["full cache"])
    assert len(re.findall(r"ms/token", out)) == 2


def test_structured_citations(engine, capsys):
    import structured_citations

    structured_citations.main(engine, questions=2)
    out = capsys.readouterr().out
    answers = re.findall(r"^A: (.*)$", out, re.M)
    citations = re.findall(r"^   citations: \[([\d, ]+)\]$", out, re.M)
    assert len(answers) == len(citations) == 2  # every answer parsed, each with at least one citation
    for listed in citations:
        numbers = [int(n) for n in listed.split(",")]
        assert all(1 <= n <= structured_citations.K for n in numbers)
        for n in numbers:  # each citation is shown with the retrieved document it names
            assert re.search(rf"^   \[{n}\] \S.* \(\S+\)$", out, re.M)
