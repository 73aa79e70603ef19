"""The load benchmark's workload and its in-process measurements.

Requests: NQ-open questions from the evals' data (``evals.datasets.nq_examples``), each with its gold
passage in the middle of 5 to 10 passages (BM25-ranked distractors), the number of passages cycling
5, 6, ..., 10 over the questions. The same request becomes a body for our server (the question as
the user message, the passages in the top-level ``documents`` list) and for ``transformers serve``
(the very user turn our engine renders, documents included, as one message), so that both run the
same prompt tokens; the benchmark checks that from the servers' ``usage.prompt_tokens``.

In process (no server running meanwhile): each distinct prompt's prefill alone and the decode step
time at a batch size (our engine), which give the "ideal for this machine", and transformers'
``model.generate`` over left-padded batches of the same prompts.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

DOCS_RANGE = (5, 10)


@dataclass(frozen=True)
class RagRequest:
    question: str
    documents: tuple[dict, ...]


def nq_requests(count: int, seed: int = 0) -> list[RagRequest]:
    """``count`` distinct NQ requests with 5-10 documents each (deterministic for ``seed``)."""
    from evals.datasets import nq_examples

    sizes = list(range(DOCS_RANGE[0], DOCS_RANGE[1] + 1))
    examples = nq_examples(count, sizes, ["middle"], seed)
    by_question: dict[str, dict[int, object]] = {}
    for example in examples:
        by_question.setdefault(example.question_id, {})[example.num_docs] = example
    out = []
    for i, question_id in enumerate(sorted(by_question, key=int)):
        example = by_question[question_id][sizes[i % len(sizes)]]
        out.append(
            RagRequest(example.question, tuple({"title": d["title"], "text": d["text"]} for d in example.documents))
        )
    return out


def engine_forces_length() -> bool:
    """Whether this engine takes ``ignore_eos`` (the scheduler's option); without it answers may end early."""
    from snapkv_rag import engine

    return "ignore_eos" in getattr(engine, "OPTIONS", ())


def ours_body(request: RagRequest, model: str, new_tokens: int) -> dict:
    """Our server: documents in the top-level ``documents`` list, length forced by ``ignore_eos``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": request.question}],
        "documents": list(request.documents),
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    return {**body, "ignore_eos": True} if engine_forces_length() else body


def rendered_user_turn(request: RagRequest, instruction: str | None = None) -> str:
    """The RAG user turn our engine builds (documents, instruction, question)."""
    from snapkv_rag.request.prompts import DEFAULT_INSTRUCTION, rag_user_message, to_documents

    return rag_user_message(request.question, to_documents(list(request.documents)), instruction or DEFAULT_INSTRUCTION)


def transformers_body(request: RagRequest, model: str, new_tokens: int) -> dict:
    """``transformers serve``: the rendered user turn; the length forced by an ``eos_token_id`` of -1
    in the request's generation config (its continuous batching then checks no end token)."""
    config = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": -1}
    return {
        "model": model,
        "messages": [{"role": "user", "content": rendered_user_turn(request)}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "generation_config": json.dumps(config),
    }


def prompt_lengths(model_dir, requests: list[RagRequest]) -> list[int]:
    """Each request's prompt tokens as our engine renders it (chat template applied)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": rendered_user_turn(r)}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in requests
    ]


def _forced(llm) -> dict:
    """The engine option that forces the answer length, where this engine has it."""
    return {"ignore_eos": True} if engine_forces_length() else {}


def prefill_alone_s(llm, requests: list[RagRequest]) -> list[float]:
    """Each request's prefill (selection included) run alone, in order, after one warm-up."""
    llm.generate(requests[0].question, list(requests[0].documents), max_new_tokens=1)
    return [llm.generate(r.question, list(r.documents), max_new_tokens=1).timings.prefill_s for r in requests]


def decode_step_s(llm, requests: list[RagRequest], batch: int, steps: int = 16) -> dict:
    """Seconds per decode step with ``batch`` rows decoding together: ``generate_batch`` submits
    ``batch`` requests (the first ones, cycled) at once, each answering ``batch + steps`` tokens
    (length forced), so that when the last one joins (after the others' prefills, one decode step
    between two prefills) every row still has at least ``steps`` to go; the median of its first
    ``steps`` step times. ``batch_seen`` is the most rows it decoded with."""
    chosen = [requests[i % len(requests)] for i in range(batch)]
    results = llm.generate_batch(
        [r.question for r in chosen],
        [list(r.documents) for r in chosen],
        batch_size=batch,
        max_new_tokens=batch + steps,
        **_forced(llm),
    )
    last = results[-1].timings
    measured = last.decode_step_ms[:steps]
    return {
        "batch": batch,
        "batch_seen": last.batch_size,
        "steps": len(measured),
        "step_s": statistics.median(measured) / 1000 if measured else None,
        "kept_tokens_max": max(max(r.compression.kept_tokens, default=0) for r in results),
    }


def ideal(prefills_s: list[float], requests_sent: int, clients: int, step_s: float, new_tokens: int) -> dict:
    """The bound for ``requests_sent`` requests (cycling the prompts whose lone prefills are given) from
    ``clients`` at once: their prefills one after another, plus the decode steps of batches of
    ``clients`` rows (``new_tokens`` steps per batch, ``requests_sent / clients`` batches)."""
    prefill_total = sum(prefills_s[i % len(prefills_s)] for i in range(requests_sent))
    decode_total = requests_sent / clients * new_tokens * step_s
    wall = prefill_total + decode_total
    return {
        "wall_s": round(wall, 3),
        "prefill_s": round(prefill_total, 3),
        "decode_s": round(decode_total, 3),
        "tokens_per_s": round(requests_sent * new_tokens / wall, 3),
    }


def padded_generate(
    model_dir: str, prompt_ids: list[list[int]], batch: int, new_tokens: int, threads: int | None = None
) -> dict:
    """transformers' ``model.generate`` (greedy, length forced by ``min_new_tokens``) over left-padded
    batches of ``batch`` prompts, the same token ids: output tokens/s over the whole run."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.config.eos_token_id

    def run(group: list[list[int]]) -> int:
        longest = max(len(ids) for ids in group)
        input_ids = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in group])
        mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in group])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
            )
        return (out.shape[1] - longest) * len(group)

    run(prompt_ids[:1])  # warm-up
    start = time.perf_counter()
    tokens = sum(run(prompt_ids[i : i + batch]) for i in range(0, len(prompt_ids), batch))
    wall = time.perf_counter() - start
    return {
        "batch": batch,
        "requests": len(prompt_ids),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3),
    }
