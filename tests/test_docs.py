"""The docs' numbers come from the committed result files: every generated table, every figure's
values (``docs/generated/plots.json``) and the README's headline table are what
``python -m docs.generate`` makes from them now. Also: each page's includes and pictures exist, and
the README's quickstart is what CI runs. Seconds: nothing is drawn and Sphinx is not run (CI builds
the site after the tests, ``.ci/run``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_and_figures_match_the_result_files():
    stale = generator().stale()
    assert not stale, f"stale or missing: {stale}; run `python -m docs.generate` and commit docs/generated"


def test_every_generated_file_is_shown_and_every_reference_exists():
    pages = {p.name: p.read_text(encoding="utf-8") for p in DOCS.glob("*.md")}
    referenced = {m for text in pages.values() for m in re.findall(r"generated/([\w.]+\.(?:md|png))", text)}
    made = {p.name for p in (DOCS / "generated").iterdir() if p.suffix in (".md", ".png")}
    assert referenced <= made, f"pages refer to files docs.generate does not make: {referenced - made}"
    assert made <= referenced, f"generated but shown on no page: {made - referenced}"
    for name, text in pages.items():
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", text):  # links to other pages
            assert (DOCS / target).exists(), f"docs/{name} links to a missing page {target}"


def test_readme_quickstart_is_what_ci_runs_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/install.sh && .venv/bin/snapkv-rag demo" in readme
    assert "bash scripts/install.sh --test && .venv/bin/python -m pytest -q -n auto" in readme
    assert "bash scripts/install.sh --test\n" in ci and "\n.venv/bin/python -m pytest -q -n auto\n" in ci
    assert "\n.venv/bin/sphinx-build -W -b html docs docs/_build/html\n" in ci
    for target in re.findall(r"\]\(((?:docs|evals|benchmarks)/[^)#]*)", readme):  # the README's links resolve
        assert (ROOT / target).exists(), f"README links to a missing {target}"
