"""Ragged heads stored without padding (:mod:`snapkv_rag.kv.ragged`): packing keeps exactly the kept
slots and unpacking gives the padded layer back bit for bit; a document set saved in the first file
format (padded layers) still loads and answers the same."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from snapkv_testing import filler_documents

from snapkv_rag import KVzipConfig, SnapKVLLM
from snapkv_rag.documents.files import META, _checksum
from snapkv_rag.kv.prompt_cache import LayerKV
from snapkv_rag.kv.ragged import pack, unpack
from snapkv_rag.methods.adaptive import EMPTY, keep_ranked

pytestmark = pytest.mark.usefixtures("one_thread")


def _ragged_layer() -> LayerKV:
    torch.manual_seed(0)
    keys, values = torch.randn(1, 3, 30, 8), torch.randn(1, 3, 30, 8)
    order = torch.stack([torch.randperm(26) for _ in range(3)])[None]
    return LayerKV(*keep_ranked(order, keys, values, torch.tensor([[2, 11, 6]]), 4))


def test_pack_keeps_the_kept_slots_and_unpack_gives_the_layer_back():
    kv = _ragged_layer()
    packed = pack(kv)
    assert packed.padded is None and packed.counts.tolist() == [6, 15, 10]  # each head's count + the window
    assert packed.keys.shape == (31, 8) and (packed.positions >= 0).all()
    assert packed.kept_bytes == 2 * 31 * 8 * 4 < kv.keys.nbytes + kv.values.nbytes
    again = unpack(packed)
    for a, b in zip((again.keys, again.values, again.positions), (kv.keys, kv.values, kv.positions)):
        assert torch.equal(a, b)
    dense = LayerKV(kv.keys[:, :, -6:], kv.values[:, :, -6:], kv.positions[:, :, -6:])  # no empty slot
    assert pack(dense).padded is None and torch.equal(unpack(pack(dense)).keys, dense.keys)


def test_a_layout_with_empty_slots_after_kept_ones_stays_padded():
    kv = _ragged_layer()
    flipped = LayerKV(kv.keys.flip(2), kv.values.flip(2), kv.positions.flip(2))  # empty slots last
    assert (flipped.positions[0, 0, -1] == EMPTY) and pack(flipped).padded is flipped
    assert unpack(pack(flipped)) is flipped


def test_a_set_saved_in_the_first_format_loads_and_answers_the_same(tiny_model, tokenizer, tmp_path):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=8)
    handle = llm.index_documents(filler_documents(5), method=KVzipConfig(ratio=0.5, window_size=8))
    answer = handle.generate("Which harbour lies north?").raw_text
    path = tmp_path / "new.safetensors"
    handle.save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[META])
    old = {}  # what the first format wrote: every layer padded
    for i, kv in enumerate(handle.entry().layers):
        if kv is not None:
            old.update(
                {
                    f"layer.{i}.keys": kv.keys[0].contiguous(),
                    f"layer.{i}.values": kv.values[0].contiguous(),
                    f"layer.{i}.positions": kv.positions[0].contiguous(),
                }
            )
    meta.update(format="snapkv-rag-documents/1", checksum=_checksum(old))
    save_file(old, str(tmp_path / "old.safetensors"), metadata={META: json.dumps(meta)})
    fresh = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=8)
    loaded = fresh.load_documents(tmp_path / "old.safetensors")
    assert loaded.kept_bytes == handle.kept_bytes  # packed on loading
    assert loaded.generate("Which harbour lies north?").raw_text == answer
