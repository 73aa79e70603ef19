"""`snapkv-rag eval` is `python -m evals`: one implementation, the same rows, from any folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evals.__main__ import main as evals_main
from snapkv_rag.cli import build_parser
from snapkv_rag.cli import main as cli_main

ARGS = [
    "--datasets",
    "kv",
    "--num-docs",
    "4",
    "--gold-positions",
    "first,last",
    "--num-questions",
    "1",
    "--methods",
    "full,snapkv@40",
    "--max-new-tokens",
    "3",
    "--no-progress",
]
STABLE = ("example_id", "method", "budget", "text", "f1", "hit_rate", "kept_tokens", "prompt_tokens")


def _rows(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in STABLE) for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())]


def test_snapkv_rag_eval_gives_the_rows_of_python_m_evals(tmp_path, tiny):
    folder = tmp_path / "model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    # the saved model gives the in-memory engine's rows (test_runner checks that for python -m evals)
    assert cli_main(["eval", *ARGS, "--model", str(folder), "--device", "cpu", "--out", str(tmp_path / "cli")]) == 0
    assert evals_main([*ARGS, "--out", str(tmp_path / "module")], engine=tiny) == 0
    assert len(_rows(tmp_path / "cli")) == 4 and _rows(tmp_path / "cli") == _rows(tmp_path / "module")


def test_snapkv_rag_eval_help_and_errors_from_another_folder(tmp_path):
    script = Path(sys.executable).with_name("snapkv-rag")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "snapkv_rag.cli"]
    shown = subprocess.run([*command, "eval", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: snapkv-rag eval")
    assert "--data FILE.jsonl" in shown.stdout and "--ray" in shown.stdout
    listed = build_parser().format_help()
    assert "eval" in listed and "python -m evals" in listed


def test_snapkv_rag_eval_errors_are_the_suites(tmp_path):
    with pytest.raises(SystemExit, match=r"--datasets: unknown \['squad'\]"):
        cli_main(["eval", "--datasets", "squad", "--out", str(tmp_path)])
