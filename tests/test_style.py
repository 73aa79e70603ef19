"""The project's code passes its own lint and format settings (``[tool.ruff]`` in pyproject.toml):
the same check a contributor runs with ``ruff check . && ruff format --check .``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is in the test extra: pip install -e '.[test]'"
    return subprocess.run([found, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_lint_passes():
    out = ruff("check", ".", "--output-format", "concise")
    assert out.returncode == 0, out.stdout + out.stderr


def test_code_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr
