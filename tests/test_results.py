"""What results look like to a user who prints them."""

from __future__ import annotations

from snapkv_rag import SnapKVConfig

from snapkv_testing import filler_documents


def test_a_result_prints_as_one_short_line(tiny_engine):
    docs = filler_documents(8)
    result = tiny_engine.generate("What lies north?", docs, snapkv=SnapKVConfig(max_capacity_prompt=64, window_size=8),
                                  max_new_tokens=4)
    shown = repr(result)
    assert "\n" not in shown and len(shown) < 400
    assert f"kept 64/{result.usage.prompt_tokens} prompt tokens" in shown and "8 documents" in shown
    assert docs[0]["text"][:30] not in shown  # the documents are counted, not dumped
