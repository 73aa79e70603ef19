"""``kv_dtype="int8"``: an 8-bit kept cache with per-token, per-head scales (:mod:`snapkv_rag.kv.quantized`).

What users rely on: the error of each number is within half a quantization step of its (token, head);
the selection is the unquantized one (same kept positions); the kept cache, the slot cache's buffers
and the document store hold int8 tensors and their scales, at about half of bf16's bytes and a quarter
of float32's; answers stay those of the unquantized cache on a tiny model (first decode logits within
1% of their range); rows batch, compile, reuse a prefix and load from files as without it; a hybrid
model's recurrent states stay in floats; bad values are refused naming ``kv_dtype``.
"""

from __future__ import annotations

import json

import pytest
import torch
from families import tiny_model as family_model
from safetensors import safe_open
from safetensors.torch import save_file
from snapkv_testing import filler_documents, tiny_llama

from snapkv_rag import AdaSnapKVConfig, KeyNormConfig, SnapKVConfig, SnapKVLLM, StreamingLLMConfig
from snapkv_rag.kv import quantized
from snapkv_rag.kv.prefix_cache import boundary
from snapkv_rag.kv.prompt_cache import LayerKV
from snapkv_rag.runtime.runner import Runner

BUDGET = SnapKVConfig(max_capacity_prompt=64, window_size=8)
QUESTIONS = ["Which castle lies north?", "Name the orchard.", "What lies north of the river?"]
DOCS = [3, 1, 5]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engines(tiny_model, tokenizer):
    """The tiny Llama (float32, head dim 16) without and with an int8 kept cache."""
    plain = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, max_new_tokens=12)
    int8 = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, max_new_tokens=12, kv_dtype="int8")
    yield plain, int8
    plain.close()
    int8.close()


def _prefill(llm, question: str, docs: int, methods) -> dict:
    ids = llm.request(question, filler_documents(docs)).input_ids
    return llm.runner.prefill([ids], methods).compressed


def _layers(compressed) -> list[LayerKV]:
    return [layer for layer in compressed.layers if isinstance(layer, LayerKV)]


@pytest.mark.parametrize("dtype, steps", [(torch.float32, 0.5), (torch.bfloat16, 1.0)])
def test_quantize_error_is_within_half_a_step_of_each_token_head_and_group(dtype, steps):
    """|x - dequantize(quantize(x))| <= scale / 2 = absmax / 254 per (token, head, 32 channels)
    (bf16: plus its own rounding of the scale and the product, within one step); a head's outlier
    does not widen another head's step, nor an outlier channel the step of the head's other
    channels; a zero row has scale 0 and reads back as zeros."""
    x = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(0))
    x[0, 1, 5] *= 50  # an outlier token in one head
    x[0, 2, 9, 40] = 80.0  # an outlier channel in the second group of one token
    x[1, 2, 7] = 0
    x = x.to(dtype)
    q, scale = quantized.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == dtype and scale.shape == (2, 3, 40, 2)
    assert int(q.abs().max()) <= 127
    back = quantized.dequantize(q, scale)
    assert back.dtype == dtype and back.shape == x.shape
    step = x.float().unflatten(-1, (2, 32)).abs().amax(-1) / 127  # [..., 2]: per group
    error = (back.float() - x.float()).unflatten(-1, (2, 32)).abs().amax(-1)
    assert bool((error <= steps * step + 1e-7).all()), float((error / step.clamp(min=1e-12)).max())
    assert float(step[0, 0, 5].max()) < float(step[0, 1, 5].min()) / 10  # the outlier's scale is its head's alone
    assert float(step[0, 2, 9, 0]) < float(step[0, 2, 9, 1]) / 10  # ... and the outlier channel's its group's
    assert bool((scale[1, 2, 7] == 0).all()) and bool((back[1, 2, 7] == 0).all())


def test_a_head_size_that_32_does_not_divide_has_one_scale_per_token_and_head():
    x = torch.randn(1, 2, 5, 48, generator=torch.Generator().manual_seed(2))
    q, scale = quantized.quantize(x)
    assert quantized.groups(48) == 1 and quantized.groups(128) == 4 and scale.shape == (1, 2, 5, 1)
    step = x.abs().amax(-1) / 127
    assert bool(((quantized.dequantize(q, scale) - x).abs().amax(-1) <= step / 2 + 1e-7).all())


def test_fp8_quantize_keeps_each_number_within_its_relative_step():
    """float8 e4m3 (the function runs anywhere; the engine takes it on CUDA only): 3 mantissa bits,
    so each number within 1/16 of itself, or within the scale's smallest step near zero."""
    x = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(1))
    q, scale = quantized.quantize(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (*x.shape[:-1], 1)
    back = quantized.dequantize(q, scale)
    floor = scale * 2.0**-9
    assert bool(((back - x).abs() <= x.abs() / 16 + floor).all())


def test_the_fp8_path_decodes_where_it_is_allowed(tiny_model, tokenizer, engines, monkeypatch):
    """fp8 is refused off CUDA (below); with that check lifted, the CPU runs its code path too: the
    kept cache and the slot buffers are float8 with scales, answers those of the float cache."""
    plain, _ = engines
    monkeypatch.setattr(quantized, "check_kv_dtype", lambda value, device=None: value)
    fp8 = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, max_new_tokens=8, kv_dtype="fp8")
    try:
        (c,) = _prefill(fp8, QUESTIONS[0], 3, {"": BUDGET})[""]
        assert c.kv_dtype == "fp8" and all(layer.keys.dtype == torch.float8_e4m3fn for layer in _layers(c))
        slots = fp8.runner.new_slots(1)
        slots.join(0, c, room=4, token=7)
        fp8.runner.decode_step(slots, 1)
        assert slots.attention[0].keys.dtype == torch.float8_e4m3fn
        assert bool(slots.attention[0].key_scale[0, :, int(slots.write_at[0]) - 1].gt(0).all())
        slots.leave(0)
        docs = [filler_documents(d) for d in DOCS]
        got = fp8.generate_batch(QUESTIONS, docs, ignore_eos=True)
        want = [plain.generate(q, d, max_new_tokens=8, ignore_eos=True) for q, d in zip(QUESTIONS, docs)]
        assert sum(a.raw_text == b.raw_text for a, b in zip(got, want)) >= 2
    finally:
        fp8.close()


def test_bad_values_are_refused_naming_kv_dtype(tiny_model, tokenizer):
    for bad in ("int4", "float16", 8, True):
        with pytest.raises(ValueError, match=r"kv_dtype: must be one of \(None, 'int8', 'fp8'\)"):
            SnapKVLLM(model=tiny_model, tokenizer=tokenizer, kv_dtype=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_dtype: 'fp8'.*needs CUDA.*use kv_dtype='int8'"):
            SnapKVLLM(model=tiny_model, tokenizer=tokenizer, kv_dtype="fp8")
        with pytest.raises(ValueError, match="kv_dtype: 'fp8'.*needs CUDA"):
            Runner(tiny_model, eos_ids=frozenset({2}), pad_id=2, kv_dtype="fp8")


def test_the_selection_is_unchanged_and_the_kept_cache_is_int8_with_scales(engines):
    """Every method keeps the positions it keeps without kv_dtype (ragged heads included); the kept
    keys/values are int8, their scales the model's dtype, one per token and head, and they read
    back within half a step of the unquantized cache."""
    plain, int8 = engines
    methods = {
        "snapkv": BUDGET,
        "stream": StreamingLLMConfig(max_capacity_prompt=48),
        "ada": AdaSnapKVConfig(max_capacity_prompt=64, window_size=8),
        "full": None,
    }
    floats, eights = _prefill(plain, QUESTIONS[0], 4, methods), _prefill(int8, QUESTIONS[0], 4, methods)
    for name in methods:
        (f,), (e,) = floats[name], eights[name]
        assert f.kv_dtype is None and e.kv_dtype == "int8"
        assert e.kept_tokens() == f.kept_tokens()
        for a, b in zip(_layers(f), _layers(e)):
            assert torch.equal(a.positions, b.positions)
            assert b.keys.dtype == b.values.dtype == torch.int8 and a.key_scale is None
            assert b.key_scale.dtype == b.value_scale.dtype == a.keys.dtype
            groups = quantized.groups(a.keys.shape[-1])
            assert b.key_scale.shape == b.value_scale.shape == (*a.keys.shape[:-1], groups)
            back = b.floats()
            for x, y in ((a.keys, back.keys), (a.values, back.values)):
                step = x.unflatten(-1, (groups, -1)).abs().amax(-1, keepdim=True) / 127  # per group
                assert bool(((x - y).unflatten(-1, (groups, -1)).abs() <= step / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype, low, high", [(torch.bfloat16, 0.5, 0.54), (torch.float32, 0.25, 0.29)])
def test_kv_bytes_are_about_half_of_bf16_and_a_quarter_of_float32(tokenizer, dtype, low, high):
    """Head dim 64: (64 + 4) / 128 = 0.531 of bf16, (64 + 8) / 256 = 0.281 of float32 (the 8-bit
    numbers and two scales per token and head, one per 32 channels); the slot cache's buffers
    shrink the same way."""
    model = tiny_llama(len(tokenizer), hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(dtype)
    runners = [Runner(model, frozenset({2}), 2, kv_dtype=k) for k in (None, "int8")]
    try:
        ids = [5 + i % 300 for i in range(200)]
        (f,), (e,) = (r.prefill([ids], {"s": BUDGET}).compressed["s"] for r in runners)
        (full_f, kept_f), (full_e, kept_e) = f.kv_bytes(), e.kv_bytes()
        assert low < kept_e / kept_f < high and low < full_e / full_f < high
        # per token and head: 2 x 64 bytes and 2 x 2 scales, against 2 x 64 numbers of the model's dtype
        assert kept_e / kept_f == pytest.approx((128 + 4 * dtype.itemsize) / (128 * dtype.itemsize))
        slots = [r.new_slots(2) for r in runners]
        for s, c in zip(slots, (f, e)):
            s.join(0, c, room=16, token=7)
        assert low < slots[1].buffer_bytes() / slots[0].buffer_bytes() < high
    finally:
        for r in runners:
            r.close()


def test_slot_buffers_are_int8_and_survive_growth_and_leaving(engines):
    """The slot cache of an int8 engine holds int8 keys/values and compute-dtype scales; a second,
    longer request grows the buffers with the first row's int8 slots copied as they were; the step's
    new token is quantized into the buffer; a row that leaves frees its row."""
    _, int8 = engines
    runner = int8.runner
    first = _prefill(int8, QUESTIONS[0], 1, {"": SnapKVConfig(max_capacity_prompt=400)})[""][0]
    second = _prefill(int8, QUESTIONS[1], 8, {"": SnapKVConfig(max_capacity_prompt=400)})[""][0]
    slots = runner.new_slots(4)
    slots.join(0, first, room=8, token=7)
    layer = slots.attention[0]
    assert layer.keys.dtype == layer.values.dtype == torch.int8
    assert layer.key_scale.dtype == torch.float32 and layer.key_scale.shape == (
        *layer.keys.shape[:-1],
        quantized.groups(layer.keys.shape[-1]),
    )
    runner.decode_step(slots, 1)
    write = int(slots.write_at[0]) - 1  # the slot the step's token went to
    assert bool(layer.keys[0, :, write].ne(0).any()) and bool(layer.key_scale[0, :, write].gt(0).all())
    before = [t[0].clone() for t in layer.buffers()]
    rows, capacity = slots.rows, slots.capacity
    slots.join(1, second, room=8, token=7)
    assert slots.rows > rows and slots.capacity > capacity  # it grew
    assert [t.dtype for t in layer.buffers()] == [torch.int8, torch.int8, torch.float32, torch.float32]
    assert all(torch.equal(t[0, :, :capacity], old) for t, old in zip(layer.buffers(), before))
    tokens = runner.to_host(runner.decode_step(slots, 2))
    assert len(tokens) == 2
    slots.leave(0)
    assert 0 not in slots.held and slots.attention[0].keys is not None
    slots.leave(1)
    assert slots.attention[0].keys is None  # the memory given back


def _first_step_logits(llm, ids) -> torch.Tensor:
    pre = llm.runner.prefill([ids], {"": BUDGET})
    slots = llm.runner.new_slots(1)
    slots.join(0, pre.compressed[""][0], room=4, token=int(pre.logits[0].argmax()))
    seen = []
    llm.runner.decode_step(slots, 1, pick=lambda logits: seen.append(logits.clone()) or logits.argmax(-1))
    slots.leave(0)
    return seen[0]


def test_answers_stay_those_of_the_unquantized_cache(engines):
    """The first decode step's logits (over the int8 cache) within 1% of the logits' range of the
    float ones (measured: ~0.06%), and differing (the int8 cache is what was read); greedy answers
    of 12 tokens identical for at least 5 of 6 prompts."""
    plain, int8 = engines
    for docs in (1, 4):
        ids = plain.request(QUESTIONS[0], filler_documents(docs)).input_ids
        floats, eights = _first_step_logits(plain, ids), _first_step_logits(int8, ids)
        spread = float(floats.max() - floats.min())
        assert 0 < float((floats - eights).abs().max()) < 0.01 * spread
    same = 0
    for docs in range(1, 7):
        question = f"Which castle lies north of number {docs}?"
        a, b = (e.generate(question, filler_documents(docs), ignore_eos=True) for e in (plain, int8))
        same += a.raw_text == b.raw_text
        assert b.compression.kv_bytes_kept < a.compression.kv_bytes_kept / 3  # float32, head dim 16: 0.3125
    assert same >= 5


def test_rows_decoded_together_answer_as_each_alone(engines):
    _, int8 = engines
    docs = [filler_documents(d) for d in DOCS]
    alone = [int8.generate(q, d, max_new_tokens=8, ignore_eos=True) for q, d in zip(QUESTIONS, docs)]
    batch = int8.generate_batch(QUESTIONS, docs, max_new_tokens=8, ignore_eos=True)
    assert [r.raw_text for r in batch] == [r.raw_text for r in alone]
    assert max(r.timings.batch_size for r in batch) > 1


def test_max_kv_bytes_admits_more_rows_of_an_int8_cache(tiny_model, tokenizer):
    """The scheduler's byte bound counts the 8-bit cache: under the same ``max_kv_bytes`` (under two
    float32 rows of this prompt and its answer's room) an int8 engine decodes 3 rows together, the
    float one 1."""
    widest = {}
    for kv_dtype in (None, "int8"):
        llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, max_kv_bytes=60_000, kv_dtype=kv_dtype)
        try:
            done = llm.generate_batch([f"Question {i}?" for i in range(6)], [filler_documents(4)] * 6, max_new_tokens=4)
        finally:
            llm.close()
        widest[kv_dtype] = max(r.timings.batch_size for r in done)
    assert widest == {None: 1, "int8": 3}


def test_the_compiled_step_answers_as_the_eager_one(tiny_model, tokenizer, engines):
    """compile=True (torch.compile on the CPU) over int8 slots: the eager int8 engine's tokens, with
    no fallback to eager."""
    _, int8 = engines
    compiled = SnapKVLLM(
        model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, compile=True, max_batch=4, kv_dtype="int8"
    )
    torch._dynamo.reset()
    try:
        docs = [filler_documents(d) for d in DOCS]
        got = compiled.generate_batch(QUESTIONS, docs, max_new_tokens=6, ignore_eos=True)
        alone = [int8.generate(q, d, max_new_tokens=6, ignore_eos=True) for q, d in zip(QUESTIONS, docs)]
    finally:
        compiled.close()
    assert compiled.runner.fallback is None
    assert [r.raw_text for r in got] == [r.raw_text for r in alone]


def test_a_document_file_keeps_its_int8_tensors_and_another_kv_dtype_is_refused(engines, tmp_path):
    plain, int8 = engines
    method = KeyNormConfig(ratio=0.5)
    handle = int8.index_documents(filler_documents(4), method=method)
    floats = plain.index_documents(filler_documents(4), method=method)
    assert handle.entry().kv_dtype == "int8" and floats.entry().kv_dtype is None
    assert 0.3 < handle.kept_bytes / floats.kept_bytes < 0.33  # the store holds the int8 form
    assert handle.entry().nbytes < floats.entry().nbytes
    path = tmp_path / "docs.safetensors"
    handle.save(path)
    loaded = int8.load_documents(path).entry()
    for a, b in zip(handle.entry().packed, loaded.packed):
        if a is not None:
            assert a.keys.dtype == torch.int8
            for name in ("keys", "values", "positions", "key_scale", "value_scale", "counts"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match=r"kv_dtype='int8'.*this engine has kv_dtype=None"):
        plain.load_documents(path)
    floats.save(tmp_path / "floats.safetensors")
    with pytest.raises(ValueError, match=r"kv_dtype=None.*this engine has kv_dtype='int8'"):
        int8.load_documents(tmp_path / "floats.safetensors")
    question = "Which castle lies north?"
    entry = handle.entry()
    tail = int8.runner.prefill_stored(entry, int8.request(question, handle.documents).input_ids).compressed[""][0]
    for stored, kv in zip(entry.layers, tail.layers):  # the stored int8 slots as they are, the tail's after them
        if stored is not None:
            n = stored.slots
            assert kv.slots > n and kv.keys.dtype == torch.int8
            assert torch.equal(kv.keys[..., :n, :], stored.keys) and torch.equal(
                kv.value_scale[..., :n, :], stored.value_scale
            )
    asked = int8.generate(question, handle, max_new_tokens=6, ignore_eos=True)
    assert asked.usage.cached_tokens == handle.prompt_tokens
    assert int8.generate(question, int8.load_documents(path), max_new_tokens=6, ignore_eos=True).text == asked.text
    # an 8-bit file of the earlier format (one scale per token and head) is refused, naming why
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {name: f.get_tensor(name) for name in f.keys()}, json.loads(f.metadata()["snapkv_rag"])
    meta["format"] = "snapkv-rag-documents/3"
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"snapkv_rag": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"old.safetensors holds an 8-bit cache in an earlier format"):
        int8.load_documents(tmp_path / "old.safetensors")


def test_a_prefix_cache_hit_keeps_the_same_positions(tiny_model, tokenizer, engines):
    """The prefix cache (full precision, consumed by the prefill) is hit under kv_dtype="int8": the
    kept positions are those of a whole prefill, and the kept cache is int8."""
    _, int8 = engines
    cached = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=BUDGET, kv_dtype="int8")
    try:
        docs = filler_documents(4)
        for question in QUESTIONS[:2]:
            request = cached.request(question, docs)
            pre = cached.runner.prefill([request.input_ids], {"": BUDGET}, boundary(request.input_ids, request.spans))
            whole = int8.runner.prefill([request.input_ids], {"": BUDGET})
            (hit,), (ref,) = pre.compressed[""], whole.compressed[""]
            assert hit.kv_dtype == "int8"
            assert all(torch.equal(a.positions, b.positions) for a, b in zip(_layers(hit), _layers(ref)))
        assert cached.prefix_stats().hits == 1 and pre.cached_tokens > 0
        result = cached.generate(QUESTIONS[2], docs, max_new_tokens=4)
        assert result.usage.cached_tokens > 0
        stored = next(iter(cached.prefix_cache._entries.values()))
        assert next(layer for layer in stored.layers if layer is not None).keys.dtype == torch.float32
    finally:
        cached.close()


@pytest.mark.parametrize("family", ["qwen3-next", "falcon-h1"])
def test_a_hybrid_model_keeps_its_states_in_floats(family, tokenizer):
    """Linear attention + full attention layers (Qwen3-Next) and attention + Mamba in one layer
    (Falcon-H1): the attention layers' kept cache is int8, the conv / SSM states stay float32, and
    rows decoded together answer as each alone."""
    model = family_model(family, len(tokenizer))
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, snapkv=SnapKVConfig(max_capacity_prompt=48, window_size=8))
    int8 = SnapKVLLM(model=model, tokenizer=tokenizer, snapkv=llm.default_snapkv, kv_dtype="int8")
    try:
        (c,) = _prefill(int8, QUESTIONS[0], 3, {"": llm.default_snapkv})[""]
        held = (layer.state if isinstance(layer, LayerKV) else layer for layer in c.layers)
        states = [s for s in held if s is not None]
        assert states and all(
            t.dtype == torch.float32 for s in states for t in s.recurrent_states.values() if t is not None
        )
        assert all(layer.keys.dtype == torch.int8 for layer in _layers(c))
        docs = [filler_documents(d) for d in DOCS]
        alone = [int8.generate(q, d, max_new_tokens=6, ignore_eos=True) for q, d in zip(QUESTIONS, docs)]
        batch = int8.generate_batch(QUESTIONS, docs, max_new_tokens=6, ignore_eos=True)
        assert [r.raw_text for r in batch] == [r.raw_text for r in alone]
        floats = [llm.generate(q, d, max_new_tokens=6, ignore_eos=True) for q, d in zip(QUESTIONS, docs)]
        assert sum(a.raw_text == b.raw_text for a, b in zip(alone, floats)) >= 2
    finally:
        llm.close()
        int8.close()
