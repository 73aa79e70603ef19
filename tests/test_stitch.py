"""Per-document reuse at any position on a tiny random-weight Llama: each document's K/V computed
once alone, stitched into prompts that order the documents differently, keys re-rotated."""

from __future__ import annotations

import pytest
import torch
from families import tiny_model as family_model
from snapkv_testing import filler_documents
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from snapkv_rag import SnapKVConfig, SnapKVLLM
from snapkv_rag.documents.stitch import common_suffix, most_deviating, rotary_of, rotate_keys

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["What lies north?", "Which castle is number 40?"]
DOCS = filler_documents(5)


@pytest.fixture()
def llm(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)


def test_a_rotated_key_is_the_key_computed_at_its_new_position(tiny_model):
    """Moving a RoPE key by d positions is the same as rotating the raw key at position p + d."""
    rotary = rotary_of(tiny_model)
    raw = torch.randn(1, 2, 5, 16)
    at = torch.arange(3, 8)[None]

    def rope(positions):
        cos, sin = rotary(raw, positions)
        return apply_rotary_pos_emb(raw, raw, cos, sin)[0]

    for shift in (11, -2):
        cos, sin = rotary(raw, torch.tensor([[shift]]))
        assert torch.allclose(rotate_keys(rope(at), cos[0, 0], sin[0, 0]), rope(at + shift), atol=1e-5)


def test_pure_parts():
    assert common_suffix([5, 1, 2, 3], [9, 9, 2, 3]) == 2 and common_suffix([1], [2]) == 0
    fresh, reused = torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4)
    fresh[:, :, [1, 4]] = 1.0
    assert most_deviating(fresh, reused, 0.3).tolist() == [1, 4]


def test_recomputing_everything_is_a_full_prefill(llm):
    """With every reused token recomputed, the stitched prompt answers exactly as a full prefill:
    the masked prefill over the stitched cache is the model's own computation."""
    handle = llm.reuse_documents(DOCS, recompute=1.0)
    for question in QUESTIONS:
        assert handle.generate(question).raw_text == llm.generate(question, DOCS, snapkv=False).raw_text


def test_one_document_is_reused_exactly(llm):
    """A lone document sits where it was computed (right after the opening): nothing is recomputed
    and the answer is the full prefill's, its block's tokens taken from the store."""
    handle = llm.reuse_documents(DOCS[:1], recompute=0.0)
    result = handle.generate(QUESTIONS[0])
    assert result.raw_text == llm.generate(QUESTIONS[0], DOCS[:1], snapkv=False).raw_text
    assert result.usage.cached_tokens > 50


def test_documents_are_computed_once_and_reused_in_any_order(llm):
    """Each document's cache is computed once; another order (other positions, other [n] labels)
    reuses it, and only the labels, the instruction and the question are prefilled."""
    first = llm.reuse_documents(DOCS, recompute=0.0)
    assert first.warm() == len(DOCS) and first.warm() == 0
    shuffled = [DOCS[i] for i in (3, 0, 4, 2, 1)]
    again = llm.reuse_documents(shuffled, recompute=0.0)
    assert again.warm() == 0
    result = again.generate(QUESTIONS[0])
    whole = llm.generate(QUESTIONS[0], shuffled, snapkv=False)
    assert result.usage.prompt_tokens == whole.usage.prompt_tokens
    assert 0.8 * whole.usage.prompt_tokens < result.usage.cached_tokens < whole.usage.prompt_tokens
    assert result.compression.kept_tokens == [whole.usage.prompt_tokens] * 2
    recomputed = llm.reuse_documents(shuffled, recompute=0.25).generate(QUESTIONS[0])
    assert recomputed.usage.cached_tokens < result.usage.cached_tokens


def test_batch_equals_single_over_stitched_handles(llm):
    handles = [llm.reuse_documents(DOCS), llm.reuse_documents(DOCS[::-1])]
    batch = llm.generate_batch(QUESTIONS, handles, batch_size=2)
    assert [r.raw_text for r in batch] == [h.generate(q).raw_text for q, h in zip(QUESTIONS, handles)]


def test_bad_input(llm, tokenizer):
    with pytest.raises(ValueError, match="recompute: expected a share"):
        llm.reuse_documents(DOCS, recompute=1.5)
    with pytest.raises(ValueError, match="documents: give at least one document"):
        llm.reuse_documents([])
    with pytest.raises(ValueError, match="snapkv: a question over a document handle"):
        llm.reuse_documents(DOCS).generate(QUESTIONS[0], snapkv=SnapKVConfig())
    window = SnapKVLLM(model=family_model("mistral-window", len(tokenizer)), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="reuse_documents: every layer must be a full-attention layer"):
        window.reuse_documents(DOCS)
