"""The README's Python snippets run as written, offline, on the embedded model: each ```python block
is executed in a fresh namespace and must print an answer (a deprecation warning fails it, as in
the examples' tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [pytest.mark.model, pytest.mark.filterwarnings("error::DeprecationWarning")]


def snippets() -> dict[str, str]:
    """The README's ```python blocks, named by the heading above each."""
    found, heading = {}, "top"
    text = README.read_text(encoding="utf-8")
    for match in re.finditer(r"^(#+ [^\n]+)$|^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
        elif match.group(2) == "python":
            found[heading] = match.group(3)
    return found


def test_the_readme_shows_the_engine_and_both_integrations():
    code = "\n".join(snippets().values())
    assert set(snippets()) == {"Quickstart", "LangChain", "LlamaIndex"}
    assert "SnapKVLLM(" in code and "ChatSnapKV(" in code and "CitationQueryEngine" in code


@pytest.fixture
def clean_llama_index_settings():
    """The LlamaIndex snippet sets the global ``Settings``; put them back for the tests after it."""
    from llama_index.core import Settings

    saved = (Settings._llm, Settings._embed_model)
    yield
    Settings._llm, Settings._embed_model = saved


@pytest.mark.parametrize("name", ["Quickstart", "LangChain", "LlamaIndex"])
def test_readme_snippet_runs_as_written(name, capsys, monkeypatch, clean_llama_index_settings):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the embedding model is a packaged local folder
    namespace: dict = {"__name__": f"readme_{name.lower()}"}
    try:
        exec(compile(snippets()[name], f"README.md ({name})", "exec"), namespace)
    finally:
        for value in namespace.values():  # the engines the snippet built
            if type(value).__name__ in ("SnapKVLLM", "ChatSnapKV") and hasattr(value, "close"):
                value.close()
    out = capsys.readouterr().out
    assert out.strip(), f"the README's {name} snippet printed nothing"
    if name != "LlamaIndex":  # the engine and LangChain print the answer, then the citations and kept tokens
        assert re.search(r"\[[\d, ]*\] \d+", out), out
