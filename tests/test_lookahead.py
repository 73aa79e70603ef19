"""Lookahead SnapKV on a tiny random-weight Llama: the queries of the model's own drafted answer
vote beside the prompt's window, the draft is dropped, and the answer is decoded from the
compressed cache. (Every family, batches and ``compare``: ``tests/test_families.py``.)"""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import AdaSnapKVConfig, KVzipConfig, LookaheadSnapKVConfig, SnapKVConfig
from snapkv_rag.runtime import draft as lookahead

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "Which harbour lies north?"
DOCS = filler_documents(6)
AHEAD = LookaheadSnapKVConfig(max_capacity_prompt=64, window_size=8, lookahead=4, floor=0.0)


def kept(engine, ids, config) -> dict:
    """Per attention layer the prompt positions ``config`` keeps of ``ids`` (one prefill)."""
    return engine.runner.prefill([ids], {"m": config}).compressed["m"][0].kept_positions()


def test_the_draft_is_the_full_caches_greedy_answer_and_votes_as_the_end_of_a_longer_prompt(tiny_engine, monkeypatch):
    """Reference: head-adaptive SnapKV over the prompt with the full cache's first answer tokens
    appended, window and budget widened by them, those positions then dropped."""
    ids = tiny_engine.request(QUESTION, DOCS, "text").input_ids
    full = tiny_engine.model.generate(
        torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=2
    )[0, len(ids) :].tolist()  # transformers' own greedy answer
    seen = []
    real = lookahead.draft_and_vote
    monkeypatch.setattr(lookahead, "draft_and_vote", lambda *args: seen.append(real(*args)) or seen[-1])
    ours = kept(tiny_engine, ids, AHEAD)
    assert [tokens for tokens, _ in seen] == [full] and len(full) == 4
    seen = [full]
    wider = AdaSnapKVConfig(max_capacity_prompt=64 + 4, window_size=8 + 4, floor=0.0)
    reference = kept(tiny_engine, ids + seen[0], wider)
    plain = kept(tiny_engine, ids, AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=0.0))
    assert ours.keys() == reference.keys()
    for layer, positions in ours.items():
        expected = reference[layer][..., :-4]  # each head's last slots: the drafted positions
        assert (reference[layer][..., -4:] >= len(ids)).all()
        assert torch.equal(positions, expected), layer
        assert positions.shape[-1] == 64  # the widest head holds the layer's budget: a memory bound
        assert (positions >= 0).sum() <= positions.shape[1] * 64  # the budget shared by the heads, within it
    assert any(not torch.equal(ours[i], plain[i]) for i in ours)  # the draft did change what is kept


def test_kept_whole_it_is_the_full_cache_and_drafts_nothing(tiny_engine, monkeypatch):
    full = tiny_engine.generate(QUESTION, DOCS, snapkv=False, max_new_tokens=10, ignore_eos=True)
    drafts = []
    real = lookahead.draft_and_vote
    monkeypatch.setattr(lookahead, "draft_and_vote", lambda *a, **k: drafts.append(1) or real(*a, **k))
    whole = tiny_engine.generate(
        QUESTION, DOCS, snapkv=LookaheadSnapKVConfig(max_capacity_prompt=4096), max_new_tokens=10, ignore_eos=True
    )
    assert whole.raw_text == full.raw_text and whole.compression.ratio == 1.0
    assert whole.compression.method == "lookahead" and not drafts  # nothing to select: no draft
    both = tiny_engine.compare(
        QUESTION, DOCS, methods={"whole": LookaheadSnapKVConfig(max_capacity_prompt=4096), "ahead": AHEAD}
    )
    assert both.results["whole"].compression.method == "lookahead" and drafts == [1]  # the other one drafts


def test_compare_equals_generate_and_times_the_draft_as_selection(tiny_engine):
    """With the other methods it shares their prompt pass; with KVzip (whose pass runs its re-read on)
    it takes a second one."""
    methods = {
        "full": None,
        "ada": AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=0.0),
        "ahead": AHEAD,
        "kvzip": KVzipConfig(max_capacity_prompt=64, window_size=8),
    }
    both = tiny_engine.compare(QUESTION, DOCS, methods=methods, max_new_tokens=6)
    for name, config in methods.items():
        alone = tiny_engine.generate(QUESTION, DOCS, snapkv=config, max_new_tokens=6)
        assert both.results[name].text == alone.text, name
    assert both.results["ahead"].compression.method == "lookahead"
    assert both.results["ahead"].compression.selection_ms > both.results["ada"].compression.selection_ms


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="lookahead: must be a number of drafted tokens"):
        LookaheadSnapKVConfig(lookahead=0)
    with pytest.raises(ValueError, match="floor"):
        LookaheadSnapKVConfig(floor=2)


def test_chosen_by_name_in_the_server_the_cli_and_the_evals(tiny_engine):
    import httpx
    from server_testing import running_server

    from evals.methods import parse_spec
    from snapkv_rag.cli import _config, build_parser
    from snapkv_rag.server.protocol import ServerSettings
    from snapkv_rag.server.protocol import _compression as snapkv_config

    args = build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "lookahead", "--budget", "25%"])
    assert _config(args) == LookaheadSnapKVConfig(ratio=0.25)
    assert parse_spec("lookahead@25%").config(400) == LookaheadSnapKVConfig(max_capacity_prompt=400)
    four = parse_spec("lookahead/lookahead=4/floor=0.5@25%")  # settings of the method in the spec
    assert four.name == "lookahead/lookahead=4/floor=0.5@25%"
    assert four.config(400) == LookaheadSnapKVConfig(max_capacity_prompt=400, lookahead=4, floor=0.5)
    with pytest.raises(ValueError, match="'sink_tokens=4' is not FIELD=VALUE"):
        parse_spec("lookahead/sink_tokens=4@25%")
    settings = ServerSettings(model_name="tiny", compression=SnapKVConfig())
    assert snapkv_config({"method": "lookahead", "lookahead": 4}, settings) == LookaheadSnapKVConfig(lookahead=4)
    with pytest.raises(Exception, match="not a setting of method adasnapkv"):
        snapkv_config({"method": "adasnapkv", "lookahead": 4}, settings)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": DOCS,
        "max_tokens": 3,
        "snapkv": {"method": "lookahead", "budget": 64, "window_size": 8, "lookahead": 2},
    }
    with running_server(tiny_engine) as (url, _):
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["snapkv"]["compression"]["method"] == "lookahead"


def test_an_even_split_holds_snapkvs_cache_shapes_so_it_decodes_as_fast(tiny_engine):
    """``floor=1.0``: every head keeps the same count, no slot padded, so each layer's K/V has the
    shape (and bytes) of SnapKV's at the same budget; only which positions differ."""
    ids = tiny_engine.request(QUESTION, DOCS, "text").input_ids
    even = LookaheadSnapKVConfig(max_capacity_prompt=64, window_size=8, lookahead=4, floor=1.0)
    ahead, plain = (
        tiny_engine.runner.prefill([ids], {"m": c}).compressed["m"][0]
        for c in (even, SnapKVConfig(max_capacity_prompt=64, window_size=8))
    )
    assert ahead.kv_bytes() == plain.kv_bytes()
    for layer, positions in ahead.kept_positions().items():
        assert positions.shape == plain.kept_positions()[layer].shape and (positions >= 0).all(), layer
        assert ahead.layers[layer].keys.shape == plain.layers[layer].keys.shape, layer
    assert any(not torch.equal(p, plain.kept_positions()[i]) for i, p in ahead.kept_positions().items())


def test_guess_is_what_followed_the_last_three_tokens_in_the_prompt_or_the_draft_in_earlier_drafts():
    prompt = (5, 6, 7, 8, 9, 4, 6, 7, 1, 2, 3, 4)
    assert lookahead.guess(prompt, [6, 7], most=3) == [1, 2, 3]  # the latest "4 6 7", not the first "6 7"
    assert lookahead.guess(prompt, [6, 7], most=1) == [1]
    assert lookahead.guess(prompt, [9, 6], most=3) == []  # "4 9 6" never occurs: shorter matches are chance
    past = [[9, 6, 5, 5], [1, 9, 6, 2, 8], [6, 1]]  # latest first
    assert lookahead.guess(prompt, [9, 6], most=3, past=past) == [5, 5]  # the first earlier draft with "9 6"
    assert lookahead.guess(prompt, [3, 1], most=3, past=past) == [9, 6, 2]  # no "3 1": the last token alone
    assert lookahead.guess(prompt, [6, 7], most=0, past=past) == [] and lookahead.guess(prompt, [0], 3, past) == []


@pytest.mark.parametrize("right, passes", [(4, [4]), (1, [4, 2]), (0, [4, 3, 2, 1])])
def test_guessed_tokens_count_only_while_the_pass_predicts_them(tiny_engine, monkeypatch, right, passes):
    """Speculating changes how many passes the draft takes, never the draft or what is kept: guesses
    whose first ``right`` tokens are the greedy draft's, the rest wrong; ``passes``: the tokens each
    draft pass runs (the next token, then the guesses)."""
    ids = tiny_engine.request(QUESTION, DOCS, "text").input_ids
    real, drafts = lookahead.draft_and_vote, []
    monkeypatch.setattr(
        lookahead, "draft_and_vote", lambda *args: drafts.append(real(*args, speculate=False)) or drafts[-1]
    )
    one_by_one = kept(tiny_engine, ids, AHEAD)
    draft = drafts[0][0]
    assert len(draft) == 4 and lookahead.PAST_DRAFTS[tiny_engine.runner][-1] == draft  # for later guesses

    def guess(prompt, so_far, most, past):
        wanted = draft[len(so_far) : len(so_far) + most]
        return wanted[:right] + [(token + 1) % 100 for token in wanted[right:]]

    runner, lengths = tiny_engine.runner, []
    forward = runner.forward

    def counting(tokens, mask, positions, *rest, **kw):  # the passes after the prompt
        if int(positions[0, 0]) >= len(ids):
            lengths.append(tokens.shape[-1])
        return forward(tokens, mask, positions, *rest, **kw)

    monkeypatch.setattr(runner, "forward", counting)
    monkeypatch.setattr(lookahead, "draft_and_vote", lambda *args: drafts.append(real(*args)) or drafts[-1])
    monkeypatch.setattr(lookahead, "guess", guess)
    guessed = kept(tiny_engine, ids, AHEAD)
    assert drafts[-1][0] == draft and lengths == passes
    for layer, positions in one_by_one.items():
        assert torch.equal(guessed[layer], positions), layer
