"""Sphinx settings for the snapkv-rag docs: Markdown pages (MyST), the API from the docstrings
(autodoc + napoleon). Build from the repository root:

    python -m docs.generate                        # tables and plots from the committed result files
    sphinx-build -W -b html docs docs/_build/html  # or: make docs
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package from this tree, and docs.generate for the OpenAPI page

project = "snapkv-rag"
author = "the snapkv-rag authors"
copyright = "the snapkv-rag authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
# generated/ and _openapi/ hold what the pages include, not pages of their own
exclude_patterns = ["_build", "generated", "_openapi", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "snapkv-rag"
html_static_path: list[str] = []


def _openapi(app) -> None:
    """The server's routes, read from the FastAPI app itself (no model is loaded); a build without
    the server extra, or an app that cannot be built, gets a page that says so instead."""
    from docs.generate import write_openapi

    write_openapi(Path(app.srcdir) / "_openapi")


def setup(app):
    app.connect("builder-inited", _openapi)
