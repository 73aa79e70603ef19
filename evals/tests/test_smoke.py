"""The --smoke preset end to end on the embedded model (what CI runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.model
def test_smoke_preset_runs_in_under_three_minutes(tmp_path):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "evals", "--smoke", "--no-progress", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 3 * 6
    assert (tmp_path / "summary.md").exists() and (tmp_path / "plots" / "answer_f1_vs_n.png").exists()
    print(f"smoke preset: {elapsed:.0f} s")
    assert elapsed < 180, f"--smoke took {elapsed:.0f} s"
