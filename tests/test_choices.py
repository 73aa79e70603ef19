"""``n`` choices from one prefill and per-token logprobs, on the tiny random-weight Llama."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import SnapKVLLM

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "What lies north?"


@pytest.fixture()
def small_batch(tiny_model, tokenizer):
    """Two rows at most: four choices must take turns."""
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10, max_batch=2)


def test_each_choice_is_the_request_alone_with_seed_plus_i_from_one_prefill(small_batch):
    docs = filler_documents(4)
    before = small_batch.stats().prefills
    result = small_batch.generate(QUESTION, docs, n=4, temperature=0.9, seed=7)
    assert small_batch.stats().prefills - before == 1  # one prefill, one selection for the four rows
    alone = [small_batch.generate(QUESTION, docs, temperature=0.9, seed=7 + i) for i in range(4)]
    assert [c.text for c in result.choices] == [a.text for a in alone]
    assert len({c.text for c in result.choices}) > 1
    assert result.text == result.choices[0].text
    assert result.usage.prompt_tokens == alone[0].usage.prompt_tokens  # counted once
    assert result.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert all(c.choices == [] for c in result.choices)
    assert len(result.to_dict()["choices"]) == 4


def test_without_a_seed_the_choices_differ_and_greedy_gives_one_answer_n_times(tiny_engine):
    docs = filler_documents(3)
    sampled = tiny_engine.generate(QUESTION, docs, n=3, temperature=1.0)
    assert len({c.text for c in sampled.choices}) == 3
    greedy = tiny_engine.generate(QUESTION, docs, n=3)
    assert [c.text for c in greedy.choices] == [tiny_engine.generate(QUESTION, docs).text] * 3


@pytest.mark.parametrize(
    "options, words",
    [
        ({"n": 0}, "n: must be an integer from 1 to 16"),
        ({"n": 17}, "n: must be an integer from 1 to 16"),
        ({"n": True}, "n: must be"),
        ({"logprobs": 21}, "logprobs: must be None or an integer from 0 to 20"),
        ({"logprobs": -1}, "logprobs: must be"),
        ({"logprobs": True}, "logprobs: must be"),
    ],
)
def test_bad_n_or_logprobs_is_a_value_error_naming_it(tiny_engine, options, words):
    with pytest.raises(ValueError, match=words):
        tiny_engine.generate(QUESTION, **options)


def test_compare_refuses_n(tiny_engine):
    with pytest.raises(ValueError, match="n: compare gives one answer per method"):
        tiny_engine.compare(QUESTION, filler_documents(2), methods={"full": None}, n=2)


def test_logprobs_are_the_log_softmax_of_a_plain_forward_at_each_step(tiny_engine):
    """Greedy over the full cache: every generated token's logprob (the first one, picked from the
    prefill's logits, included) is that of a plain transformers forward over prompt + answer;
    the alternatives are sorted and the chosen token is the first of them."""
    docs = filler_documents(3)
    result = tiny_engine.generate(QUESTION, docs, snapkv=False, logprobs=5, ignore_eos=True)
    ids = tiny_engine.request(QUESTION, docs).input_ids
    answer = [entry.id for entry in result.logprobs]
    model = tiny_engine.model
    with torch.inference_mode():
        logits = model(torch.tensor([ids + answer]), use_cache=False).logits[0].float()
    expected = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    assert len(result.logprobs) == result.usage.completion_tokens == 12
    for step, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(expected[step, entry.id].item(), abs=1e-4)
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].id == entry.id
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert values == pytest.approx(expected[step].topk(5).values.tolist(), abs=1e-4)
        assert entry.token == tiny_engine.tokenizer.decode([entry.id]) and entry.bytes == list(entry.token.encode())


def test_rows_in_one_batch_each_get_their_own_logprobs_as_alone(tiny_model, tokenizer):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10, max_batch=4)
    docs = filler_documents(3)
    asks = [dict(logprobs=None), dict(logprobs=0), dict(logprobs=3, temperature=0.8, seed=1), dict(logprobs=1)]
    alone = [llm.generate(f"{QUESTION} {i}", docs, **ask) for i, ask in enumerate(asks)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: llm.generate(f"{QUESTION} {i}", docs, **asks[i]), range(4)))
    assert max(r.timings.batch_size for r in together) > 1
    assert together[0].logprobs is None and alone[0].logprobs is None
    for a, t, ask in zip(alone, together, asks):
        assert t.text == a.text
        if ask["logprobs"] is not None:
            assert [e.id for e in t.logprobs] == [e.id for e in a.logprobs]
            assert [e.logprob for e in t.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-4)
            assert all(len(e.top_logprobs) == ask["logprobs"] for e in t.logprobs)


def test_streamed_pieces_carry_their_choice_and_the_results_logprobs(tiny_engine):
    docs = filler_documents(3)
    items = list(tiny_engine.stream_result(QUESTION, docs, n=3, temperature=0.9, seed=3, logprobs=2))
    result, pieces = items[-1], items[:-1]
    for index, choice in enumerate(result.choices):
        mine = [p for p in pieces if p.choice == index]
        assert "".join(mine) == choice.text
        assert [e for p in mine for e in p.logprobs] == choice.logprobs
    plain = tiny_engine.generate(QUESTION, docs, n=3, temperature=0.9, seed=3, logprobs=2)
    assert [c.logprobs for c in plain.choices] == [c.logprobs for c in result.choices]


def test_each_choice_follows_its_own_grammar_and_masked_tokens_are_never_listed(tiny_engine):
    result = tiny_engine.generate(
        QUESTION, n=2, temperature=0.9, seed=2, logprobs=20, max_new_tokens=60, response_format={"type": "json_object"}
    )
    for choice in result.choices:
        assert choice.finish_reason != "stop" or isinstance(choice.parsed, dict)
        first = choice.logprobs[0]
        assert all(t.token.strip()[:1] in ("{", "") for t in first.top_logprobs)
        assert sum(torch.tensor([t.logprob for t in first.top_logprobs]).exp()) <= 1 + 1e-4
