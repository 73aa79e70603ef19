"""The converted default model: a damaged or half-written copy is detected and rebuilt, never loaded."""

from __future__ import annotations

import json
import shutil

import pytest

from snapkv_rag.models import loading


@pytest.fixture(scope="module")
def good_copy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache") / "copy"
    shutil.copytree(loading.default_model_dir(), folder)
    return folder


def test_a_complete_copy_is_valid(good_copy):
    assert loading.is_valid_conversion(good_copy)


def test_a_flipped_byte_is_detected(good_copy):
    weights = good_copy / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    try:
        assert not loading.is_valid_conversion(good_copy)
    finally:
        with open(weights, "r+b") as handle:
            handle.seek(weights.stat().st_size // 2)
            handle.write(byte)
    assert loading.is_valid_conversion(good_copy)


@pytest.mark.parametrize("damage", ["no manifest", "no tokenizer", "bad manifest"])
def test_missing_or_broken_files_are_detected(good_copy, tmp_path, damage):
    folder = tmp_path / "damaged"
    shutil.copytree(
        good_copy,
        folder,
        copy_function=lambda src, dst: (
            shutil.copy2(src, dst) if not src.endswith(".safetensors") else __import__("os").link(src, dst)
        ),
    )
    if damage == "no manifest":
        (folder / "snapkv-rag-manifest.json").unlink()
    elif damage == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "snapkv-rag-manifest.json").write_text("{not json")
    assert not loading.is_valid_conversion(folder)


@pytest.mark.heavy
@pytest.mark.model
def test_a_half_written_cache_is_rebuilt(good_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_RAG_CACHE", str(tmp_path))
    target = loading.converted_dir()
    shutil.copytree(good_copy, target, ignore=shutil.ignore_patterns("model.safetensors"))
    with open(good_copy / "model.safetensors", "rb") as src, open(target / "model.safetensors", "wb") as dst:
        dst.write(src.read(1 << 20))  # a copy cut off after 1 MiB, as a killed process leaves it
    assert not loading.is_valid_conversion(target)
    assert loading.default_model_dir() == target
    assert loading.is_valid_conversion(target)
    manifest = json.loads((target / "snapkv-rag-manifest.json").read_text())
    assert manifest["weights_bytes"] == (good_copy / "model.safetensors").stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or broken leftovers
