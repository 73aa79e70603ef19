"""Document-aware SnapKV on hand-built tensors: the spans, the budget shares, the selection."""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents, seeded

from snapkv_rag import DocSnapKVConfig, PromptSpans, SnapKVConfig
from snapkv_rag.methods.selection import doc_snapkv_select, share_budget, snapkv_select
from snapkv_rag.request.prompts import DEFAULT_INSTRUCTION, to_documents
from snapkv_rag.request.text import encode_request

LENGTH, DIM = 48, 8
# documents at 4..19 and 20..35; 0..3 (system turn) and 36..47 (instruction, question) lie outside
SPANS = PromptSpans(documents=((4 - LENGTH, 20 - LENGTH), (20 - LENGTH, 36 - LENGTH)), question=40 - LENGTH)


def hot_spot(position: int, heads: int = 2, kv_heads: int = 2, window: int = 8):
    """Queries that all point one way and keys that are zero but at ``position``: every vote but
    the causal window's own goes to ``position``."""
    direction = torch.ones(DIM)
    q = direction.expand(1, heads, window, DIM).clone()
    k = torch.zeros(1, kv_heads, LENGTH, DIM)
    k[..., position, :] = 4 * direction
    v = torch.randn(1, kv_heads, LENGTH, DIM, generator=seeded(0))
    return q, k, v


def config(capacity: int, **settings) -> DocSnapKVConfig:
    return DocSnapKVConfig(
        **{"max_capacity_prompt": capacity, "window_size": 8, "kernel_size": 7, "spans": SPANS, **settings}
    )


def test_votes_are_not_pooled_across_a_document_boundary():
    q, k, v = hot_spot(20)  # the first token of the second document
    _, _, kept = doc_snapkv_select(q, k, v, config(20))
    doc_kept = sorted(set(kept[0, 0].tolist()) & set(range(4, 36)))
    assert doc_kept == [20, 21, 22, 23]  # the 4 tokens left after 16 outside the documents
    # plain SnapKV's max pooling lifts the first document's last tokens too (ties go earlier)
    _, _, plain = snapkv_select(q, k, v, SnapKVConfig(max_capacity_prompt=20, window_size=8))
    assert set(plain[0, 0].tolist()) & {17, 18, 19}


def test_instruction_and_question_are_always_kept_and_the_count_is_the_budget():
    q, k, v = hot_spot(10)
    for capacity in (17, 24, 40):
        keys, values, kept = doc_snapkv_select(q, k, v, config(capacity))
        assert kept.shape == (1, 2, capacity) and keys.shape == (1, 2, capacity, DIM)
        for head in range(2):
            positions = kept[0, head].tolist()
            assert positions == sorted(positions) and len(set(positions)) == capacity
            assert set(range(4)) | set(range(36, 48)) <= set(positions)  # outside the documents: every one
        assert torch.equal(values, v.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, DIM)))


def test_a_document_without_votes_goes_whole():
    q, k, v = hot_spot(10)  # the first document holds the votes
    _, _, kept = doc_snapkv_select(q, k, v, config(26))
    assert not set(kept.flatten().tolist()) & set(range(20, 36))
    assert len(set(kept[0, 0].tolist()) & set(range(4, 20))) == 10


@pytest.mark.parametrize(
    "mass, lengths, total, shares",
    [
        ([0.0, 3.0, 1.0], [10, 10, 10], 8, [0, 6, 2]),  # in proportion; a zero mass gets nothing
        ([0.0, 100.0, 1.0], [5, 3, 10], 8, [0, 3, 5]),  # a capped share passes the rest on
        ([0.0, 1.0], [5, 3], 6, [3, 3]),  # what no positive mass can take goes to the others by length
        ([1.0, 1.0, 1.0], [4, 4, 4], 5, [2, 2, 1]),  # largest remainder, the earlier first on ties
        ([1.0, 2.0], [3, 3], 10, [3, 3]),  # never more than the documents hold
    ],
)
def test_shares_follow_the_vote_mass_and_add_up_to_the_budget(mass, lengths, total, shares):
    assert share_budget(mass, lengths, total) == shares


def test_without_spans_it_is_plain_snapkv():
    g = seeded(3)
    q, k, v = (
        torch.randn(2, 4, 8, DIM, generator=g),
        torch.randn(2, 2, LENGTH, DIM, generator=g),
        torch.randn(2, 2, LENGTH, DIM, generator=g),
    )
    doc = DocSnapKVConfig(max_capacity_prompt=20, window_size=8)
    plain = SnapKVConfig(max_capacity_prompt=20, window_size=8)
    ours, reference = doc.select(q, k, v, None, 0, 2), plain.select(q, k, v, None, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_spans_count_from_the_end_so_a_later_slice_maps_them():
    assert SPANS.in_slice(LENGTH) == [(4, 20), (20, 36)]
    assert SPANS.in_slice(30) == [(0, 2), (2, 18)]  # a 30-token slice starts at 18: the first is cut
    assert SPANS.in_slice(12) == []  # the instruction and question only
    q, k, v = hot_spot(20)
    _, _, kept = doc_snapkv_select(q[..., :, :], k[..., 6:, :], v[..., 6:, :], config(20))
    assert set(kept[0, 0].tolist()) >= {14, 15, 16, 17}  # position 20 of the prompt is 14 of the slice


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="spans"):
        PromptSpans(documents=((-5, -8),), question=-2)
    with pytest.raises(ValueError, match="spans"):
        DocSnapKVConfig(spans=[(-5, -3)])


def test_the_prompt_builder_finds_every_document_and_the_question(tokenizer):
    docs = filler_documents(3)
    request = encode_request(
        tokenizer, [{"role": "user", "content": "Which harbour lies north?"}], docs, DEFAULT_INSTRUCTION
    )
    n = len(request.input_ids)
    for (start, stop), doc in zip(request.spans.documents, to_documents(docs)):
        text = tokenizer.decode(request.input_ids[n + start : n + stop])
        assert doc.title in text and text.strip().endswith(doc.text.strip()[-20:])
    assert tokenizer.decode(request.input_ids[n + request.spans.question :]).startswith("Question: Which harbour")
    plain = encode_request(tokenizer, [{"role": "user", "content": "Hi"}], None, DEFAULT_INSTRUCTION)
    assert plain.spans is None
