"""Query-agnostic selection: the documents decide what is kept, not the question (key norms, and
KVzip's re-read votes). Checked against loop-by-loop references and against the model's own
attention weights, and end to end through the engine."""

from __future__ import annotations

import math

import pytest
import torch
from families import tiny_model
from snapkv_testing import filler_documents, seeded, tiny_llama

from snapkv_rag import KeyNormConfig, KVzipConfig, SnapKVConfig, SnapKVLLM
from snapkv_rag.methods.selection import key_norm_select, reread_scores


def reference_key_norm(k, cfg):
    """One batch row ``[H_kv, L, D]``: per head, the kept positions by a plain-Python ranking of
    minus the pooled key norms (ties to the earlier position), plus the window."""
    h_kv, length, _ = k.shape
    prefix = length - cfg.window_size
    half = cfg.kernel_size // 2
    kept = []
    for head in range(h_kv):
        scores = [-math.sqrt(sum(float(x) ** 2 for x in k[head, j])) for j in range(prefix)]
        pooled = [max(scores[max(0, j - half) : j + half + 1]) for j in range(prefix)]
        best = sorted(range(prefix), key=lambda j: (-pooled[j], j))[: cfg.max_capacity_prompt - cfg.window_size]
        kept.append(sorted(best) + list(range(prefix, length)))
    return kept


@pytest.mark.parametrize("kernel_size", [1, 5])
def test_key_norm_keeps_the_shortest_keys_and_the_window(kernel_size):
    cfg = KeyNormConfig(max_capacity_prompt=16, window_size=4, kernel_size=kernel_size)
    g = seeded(3)
    k = torch.randn(2, 2, 40, 8, generator=g) * torch.rand(2, 2, 40, 1, generator=g) * 3
    v = torch.randn(2, 2, 40, 8, generator=g)
    keys, values, kept = key_norm_select(k, v, cfg)
    assert kept.shape == (2, 2, 16)
    for row in range(2):
        assert kept[row].tolist() == reference_key_norm(k[row], cfg)
        for head in range(2):
            assert torch.equal(keys[row, head], k[row, head, kept[row, head]])
            assert torch.equal(values[row, head], v[row, head, kept[row, head]])


def test_key_norm_does_not_look_at_the_question():
    cfg = KeyNormConfig(max_capacity_prompt=16, window_size=4)
    g = seeded(4)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    picks = {
        tuple(cfg.select(torch.randn(1, 4, 40, 8, generator=g), k, v, None, 0, 2)[2].flatten().tolist())
        for _ in range(3)
    }
    assert len(picks) == 1  # three different "questions", one selection
    snap = SnapKVConfig(max_capacity_prompt=16, window_size=4)
    assert (
        len(
            {
                tuple(snap.select(torch.randn(1, 4, 40, 8, generator=g), k, v, None, 0, 2)[2].flatten().tolist())
                for _ in range(3)
            }
        )
        > 1
    )  # while SnapKV's depends on it


@pytest.mark.parametrize("method", [KeyNormConfig, KVzipConfig], ids=["keynorm", "kvzip"])
def test_through_the_engine_a_batch_equals_single_calls(tiny_engine, method):
    cfg = method(max_capacity_prompt=64, window_size=8)
    questions = ["Which harbour lies north?", "Name the orchard.", "What lies north?"]
    docs = [filler_documents(5), filler_documents(2), filler_documents(3)]
    batch = tiny_engine.generate_batch(questions, docs, snapkv=cfg, max_new_tokens=6)
    single = [tiny_engine.generate(q, d, snapkv=cfg, max_new_tokens=6) for q, d in zip(questions, docs)]
    assert [r.text for r in batch] == [r.text for r in single]
    assert all(r.compression.method == cfg.method for r in single)
    # KVzip's one ranking over all layers and heads: ragged heads, the widest holding the budget (a memory bound)
    assert all(r.compression.kept_tokens == [64, 64] for r in single)
    assert [r.compression.kept_tokens for r in batch] == [r.compression.kept_tokens for r in single]


def test_key_norm_everywhere_a_method_is_chosen():
    from evals.methods import parse_spec
    from snapkv_rag.cli import _config, build_parser
    from snapkv_rag.server.protocol import ServerSettings, _compression

    args = build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "keynorm", "--budget", "25%"])
    assert _config(args) == KeyNormConfig(ratio=0.25)
    assert parse_spec("keynorm@25%").config(400) == KeyNormConfig(max_capacity_prompt=400)
    assert parse_spec("kvzip@300").config(300) == KVzipConfig(max_capacity_prompt=300)
    assert (
        _compression({"method": "kvzip"}, ServerSettings(model_name="tiny", compression=SnapKVConfig()))
        == KVzipConfig()
    )
    got = _compression(
        {"method": "keynorm", "budget": 256}, ServerSettings(model_name="tiny", compression=SnapKVConfig())
    )
    assert got == KeyNormConfig(max_capacity_prompt=256)


def test_reread_votes_are_the_largest_weight_any_reading_query_gives():
    g = seeded(5)
    prompt, reread, d = 12, 7, 8
    q = torch.randn(1, 4, reread, d, generator=g)
    k = torch.randn(1, 2, prompt + reread, d, generator=g)
    got = reread_scores(q, k, prompt, chunk=3)  # three chunks: 3 + 3 + 1 queries
    for kv in range(2):
        for j in range(prompt):
            best = 0.0
            for head in (2 * kv, 2 * kv + 1):
                for i in range(reread):
                    logits = [float(q[0, head, i] @ k[0, kv, m]) / math.sqrt(d) for m in range(prompt + i + 1)]
                    top = max(logits)
                    total = sum(math.exp(x - top) for x in logits)
                    best = max(best, math.exp(logits[j] - top) / total)
            assert got[0, kv, j].item() == pytest.approx(best, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("share", ["head", "model"])
def test_kvzip_keeps_what_the_models_own_attention_weights_say(tokenizer, share):
    """The kept positions against the eager attention weights transformers returns for the prompt
    followed by its re-read: the best re-read weights over the prompt, per KV head (``"head"``) or
    over every layer and head together (``"model"``)."""
    model = tiny_llama(len(tokenizer), attn_implementation="eager")
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, attn_implementation="eager")
    cfg = KVzipConfig(max_capacity_prompt=48, window_size=8, kernel_size=1, share=share, sink_tokens=0)
    ids = llm.request("Which harbour lies north?", filler_documents(3), "text").input_ids
    kept = llm.runner.prefill([ids], {"kvzip": cfg}).compressed["kvzip"][0].kept_positions()
    llm.close()
    full = ids + list(llm.runner.repeat_ids) + ids
    with torch.inference_mode():
        weights = model(torch.tensor([full]), output_attentions=True).attentions
    length = len(ids)
    chosen_votes, rest_votes = [], []
    for layer, attn in enumerate(weights):
        layer_chosen, layer_rest = [], []
        votes = attn[0, :, length:, : length - 8].reshape(2, 2, -1, length - 8).amax(dim=(1, 2))
        for head in range(2):
            positions = [p for p in kept[layer][0, head].tolist() if p >= 0]
            assert positions[-8:] == list(range(length - 8, length))
            chosen = positions[:-8]
            rest = [j for j in range(length - 8) if j not in chosen]
            if share == "head":
                assert len(chosen) == 40
                assert min(votes[head, chosen]) >= max(votes[head, rest]) - 1e-5, (layer, head)
            assert len(chosen) <= 40  # no head above the budget: a memory bound
            layer_chosen += votes[head, chosen].tolist()
            layer_rest += votes[head, rest].tolist()
        if share == "model":  # the layer's part of the one ranking, until its first head is full
            assert min(layer_chosen) >= max(layer_rest) - 1e-5, layer
        chosen_votes += layer_chosen
        rest_votes += layer_rest
    assert len(chosen_votes) <= 2 * 2 * 40  # within every layer's and head's share, however it was spread


def test_kvzip_beside_other_methods_leaves_them_as_alone(tiny_engine):
    """One pass holds the prompt and its re-read: the full cache, SnapKV and the first token must
    be those of a pass without it."""
    docs = filler_documents(4)
    methods = {
        "full": None,
        "snapkv": SnapKVConfig(max_capacity_prompt=64, window_size=8),
        "kvzip": KVzipConfig(max_capacity_prompt=64, window_size=8, share="head"),
    }
    both = tiny_engine.compare("Which harbour lies north?", docs, methods=methods, max_new_tokens=8)
    for name, config in methods.items():
        alone = tiny_engine.generate("Which harbour lies north?", docs, snapkv=config, max_new_tokens=8)
        assert both.results[name].text == alone.text, name
        assert both.results[name].compression.kept_tokens == alone.compression.kept_tokens, name
    assert both.results["kvzip"].compression.method == "kvzip"
    assert both.results["kvzip"].compression.kept_tokens[0] == 64


def test_kvzip_at_several_budgets_in_one_pass_keeps_what_each_keeps_alone(tiny_engine):
    """Budgets of the same settings share each layer's re-read scores; other settings get their own."""
    ids = tiny_engine.request("Which harbour lies north?", filler_documents(4), "text").input_ids
    methods = {
        f"{b}{sinks}": KVzipConfig(max_capacity_prompt=b, window_size=8, sink_tokens=sinks)
        for b in (48, 96)
        for sinks in (0, 4)
    }
    both = tiny_engine.runner.prefill([ids], methods).compressed
    for name, config in methods.items():
        alone = tiny_engine.runner.prefill([ids], {name: config}).compressed[name][0].kept_positions()
        assert all(torch.equal(alone[i], p) for i, p in both[name][0].kept_positions().items()), name
    first, second = (both[n][0].kept_positions() for n in ("480", "484"))
    assert any(not torch.equal(first[i], second[i]) for i in first)  # the sinks did change what is kept


@pytest.mark.parametrize("family", ["lfm2", "qwen3-next", "falcon-h1", "zamba2"])
def test_kvzip_on_models_with_recurrent_layers_keeps_the_states_after_the_prompt(family, tokenizer):
    """The re-read pass runs the recurrent states on through the re-read; the states a request
    decodes from are those after the prompt alone (one more pass): kept whole, KVzip's answer is
    the full cache's, token for token; compressed, it answers, and compare equals generate."""
    llm = SnapKVLLM(model=tiny_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=8)
    docs = filler_documents(3)
    whole = llm.generate("Which harbour?", docs, snapkv=KVzipConfig(ratio=1.0, window_size=8), ignore_eos=True)
    full = llm.generate("Which harbour?", docs, snapkv=False, ignore_eos=True)
    assert whole.compression.method == "kvzip" and whole.raw_text == full.raw_text
    half = KVzipConfig(ratio=0.5, window_size=8)
    alone = llm.generate("Which harbour?", docs, snapkv=half, ignore_eos=True)
    both = llm.compare("Which harbour?", docs, methods={"kvzip": half, "full": None}, max_new_tokens=8, ignore_eos=True)
    assert alone.usage.completion_tokens == 8 and 0 < alone.compression.ratio < 0.7
    assert both.results["kvzip"].raw_text == alone.raw_text and both.results["full"].raw_text == full.raw_text
    ids = llm.request("Which harbour?", docs, "text").input_ids
    plain = llm.runner.prefill([ids], {"full": None}).compressed["full"][0]
    reread = llm.runner.prefill([ids], {"kvzip": KVzipConfig(max_capacity_prompt=64, window_size=8)}).compressed[
        "kvzip"
    ][0]
    held = [
        (getattr(a, "state", a), getattr(b, "state", b))
        for a, b, spec in zip(plain.layers, reread.layers, llm.runner.specs)
        if spec.state
    ]
    assert held and all(
        (x[k] is None and y[k] is None) or torch.equal(x[k], y[k])
        for a, b in held
        for name in ("conv_states", "recurrent_states")
        for x, y in [(getattr(a, name), getattr(b, name))]
        if isinstance(x, dict)
        for k in x
    )
