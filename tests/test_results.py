"""What results look like to a user who prints them."""

from __future__ import annotations

from snapkv_testing import filler_documents

from snapkv_rag import SnapKVConfig


def test_a_result_prints_as_one_short_line(tiny_engine):
    docs = filler_documents(8)
    result = tiny_engine.generate(
        "What lies north?", docs, snapkv=SnapKVConfig(max_capacity_prompt=64, window_size=8), max_new_tokens=4
    )
    shown = repr(result)
    assert "\n" not in shown and len(shown) < 400
    assert f"kept 64/{result.usage.prompt_tokens} prompt tokens" in shown and "8 documents" in shown
    assert docs[0]["text"][:30] not in shown  # the documents are counted, not dumped


def test_the_prompt_the_model_sees_is_public(tiny_engine, tokenizer):
    docs = filler_documents(3)
    request = tiny_engine.request("What lies north?", docs)
    assert request.input_ids == tokenizer(request.text, add_special_tokens=False).input_ids
    assert request.text.rstrip().endswith(
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
        .split("x")[-1]
        .rstrip()
    )
    assert request.text.index(docs[2]["title"]) < request.text.index("What lies north?")  # question last
    result = tiny_engine.generate("What lies north?", docs, max_new_tokens=2)
    assert result.usage.prompt_tokens == len(request.input_ids)


def test_batch_results_carry_their_own_decode_timings_and_say_the_prefill_was_shared(tiny_engine):
    questions = ["What lies north?", "Which harbour is it?", "Name the orchard."]
    docs = [filler_documents(6), filler_documents(2), filler_documents(4)]
    results = tiny_engine.generate_batch(questions, docs, max_new_tokens=6, stop=["."])
    assert [r.timings.batch_size for r in results] == [3, 3, 3]
    for result in results:  # each row's decode figure covers the steps it ran until it finished
        assert (
            len(result.timings.decode_step_ms) == result.usage.completion_tokens - 1 or result.finish_reason == "stop"
        )
    alone = tiny_engine.generate(questions[0], docs[0], max_new_tokens=6, stop=["."])
    assert alone.timings.batch_size == 1


def test_a_comparison_prints_one_line_per_method(tiny_engine):
    docs = filler_documents(8)
    shown = repr(
        tiny_engine.compare(
            "What lies north?",
            docs,
            max_new_tokens=3,
            methods={"full": None, "snapkv": SnapKVConfig(max_capacity_prompt=64, window_size=8)},
        )
    )
    lines = shown.splitlines()
    assert len(lines) == 3 and lines[1].startswith("  full: ") and "kept 64/" in lines[2] and "hit rate" in lines[2]
    assert docs[0]["text"][:30] not in shown


def test_info_logging_says_what_each_request_kept(tiny_engine, caplog):
    with caplog.at_level("INFO", logger="snapkv_rag"):
        result = tiny_engine.generate(
            "What lies north?",
            filler_documents(8),
            snapkv=SnapKVConfig(max_capacity_prompt=64, window_size=8),
            max_new_tokens=3,
        )
    assert f"kept 64 of {result.usage.prompt_tokens} prompt tokens per layer (snapkv)" in caplog.text
