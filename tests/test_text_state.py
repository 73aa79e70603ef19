"""Incremental detokenisation with the embedded tokenizer: pieces add up to the full decode, split
UTF-8 characters come out whole, stop strings cut right across pieces, and each push decodes only
a few tokens however long the answer is."""

from __future__ import annotations

import pytest

from snapkv_rag.request.text import TextState

UNICODE = [
    "東京は日本の首都です。富士山は高い。",
    "Crème brûlée à la française, s'il vous plaît",
    "👨‍👩‍👧 family 🎉🚀 done",
    "naïve café — Ελληνικά, русский, हिन्दी",
]


class CountingTokenizer:
    """The real tokenizer, recording how many token ids each ``decode`` call is handed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids, **kwargs):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def run(state: TextState, ids: list[int], reason: str = "length") -> list[str]:
    """Push ``ids`` until the state stops itself, then finish it as the scheduler does."""
    pieces = []
    for token in ids:
        pieces.append(state.push(token))
        if state.finished:
            break
    state.finished = state.finished or reason
    pieces.append(state.flush())
    return [p for p in pieces if p]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", UNICODE)
def test_pieces_add_up_to_the_full_decode_and_hold_split_characters(tokenizer, text):
    ids = encode(tokenizer, text)
    if not text.startswith("Crème"):  # accents are whole tokens; CJK, emoji, Greek, Devanagari are split
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    state = TextState(tokenizer, stop=[])
    pieces = run(state, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text == state.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert state.ids == ids


def test_a_stop_string_split_across_pieces_cuts_the_text_before_it(tokenizer):
    answer = "Paris est la capitale. 東京"
    ids = encode(tokenizer, answer + "\n\nQuestion: encore ?")
    state = TextState(tokenizer, stop=["\n\nQuestion:"])
    pieces = run(state, ids)
    assert state.finished == "stop"
    assert "".join(pieces) == state.text == answer
    assert len(state.ids) < len(ids)  # it stopped as soon as the stop string was complete


def test_a_unicode_stop_string_and_a_near_miss(tokenizer):
    text = "富士山は高い。終わりではない、終了。続き"
    state = TextState(tokenizer, stop=["終了"])
    pieces = run(state, encode(tokenizer, text))
    assert "".join(pieces) == state.text == "富士山は高い。終わりではない、"


def test_a_held_back_stop_prefix_is_released_when_the_stop_string_does_not_follow(tokenizer):
    text = "one\n\nQuick answer, no question"
    state = TextState(tokenizer, stop=["\n\nQuestion:"])
    pieces = run(state, encode(tokenizer, text))
    assert state.finished == "length"
    assert "".join(pieces) == text
    assert not any(piece.endswith("\n\nQu") for piece in pieces[:-1])  # held while it could be the stop


def test_an_incomplete_last_character_is_dropped_at_the_end(tokenizer):
    ids = encode(tokenizer, "emoji 🎉")
    state = TextState(tokenizer, stop=[])
    pieces = run(state, ids[:-1])
    assert "".join(pieces) == state.text == "emoji "


def test_work_per_push_does_not_grow_with_the_answer(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = encode(tokenizer, " ".join(UNICODE) * 12)
    state = TextState(counting, stop=["never appears"])
    pieces = run(state, ids)
    assert len(ids) > 400
    assert "".join(pieces) == tokenizer.decode(ids)
    assert max(counting.calls) <= TextState.HOLD + 1
    assert sum(counting.calls) <= 2 * (TextState.HOLD + 1) * len(ids)
    # the last 50 pushes decode no more than the first 50 did
    per_push = len(counting.calls) / len(ids)
    tail = counting.calls[-int(50 * per_push) :]
    head = counting.calls[: int(50 * per_push)]
    assert sum(tail) <= 1.5 * sum(head)
