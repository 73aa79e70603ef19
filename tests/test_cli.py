"""The command line: document collection, path validation, and a real answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snapkv_rag.cli import collect_documents, main


def test_documents_from_jsonl_json_text_files_and_folders(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"title": "A", "text": "alpha"}\n"beta"\n\n')
    (tmp_path / "b.json").write_text(json.dumps([{"text": "gamma", "id": "g"}]))
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "2.md").write_text("delta")
    (folder / "1.txt").write_text("epsilon")
    (folder / "skip.bin").write_bytes(b"\0")
    docs = collect_documents([str(tmp_path / "a.jsonl"), str(tmp_path / "b.json"), str(folder)])
    assert [d.text for d in docs] == ["alpha", "beta", "gamma", "epsilon", "delta"]
    assert docs[0].title == "A" and docs[2].id == "g" and docs[3].title == "1"


@pytest.mark.parametrize("setup,words", [
    (lambda p: str(p / "missing.jsonl"), "does not exist"),
    (lambda p: (p / "x.pdf").write_bytes(b"%PDF") and str(p / "x.pdf"), "is not one of"),
    (lambda p: (p / "bad.jsonl").write_text("{oops\n") and str(p / "bad.jsonl"), "not valid JSON Lines"),
    (lambda p: (p / "obj.json").write_text('{"text": "x"}') and str(p / "obj.json"), "JSON list"),
    (lambda p: (p / "num.jsonl").write_text("3\n") and str(p / "num.jsonl"), "record 1"),
    (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no"),
    (lambda p: (p / "latin.txt").write_bytes("caf\xe9".encode("latin-1")) and str(p / "latin.txt"), "UTF-8"),
])
def test_bad_paths_give_one_line_and_status_2(tmp_path, capsys, setup, words):
    path = setup(tmp_path)
    assert main(["ask", "question?", "--docs", path]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_bad_budget_is_named(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha")
    assert main(["ask", "q?", "--docs", str(tmp_path / "a.txt"), "--budget", "16"]) == 2
    assert "max_capacity_prompt" in capsys.readouterr().err


@pytest.mark.model
def test_ask_answers_with_citations_and_figures(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        '{"title": "Mount Fuji", "text": "Mount Fuji is the highest mountain in Japan."}\n'
        '{"title": "Lake Biwa", "text": "Lake Biwa is the largest lake in Japan."}\n')
    out = subprocess.run([sys.executable, "-m", "snapkv_rag.cli", "ask", "What is the highest mountain in Japan?",
                          "--docs", str(tmp_path / "docs.jsonl"), "--json", "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "fuji" in result["text"].lower()
    assert result["usage"]["prompt_tokens"] > 20 and result["compression"]["method"] == "snapkv"
