"""The kvpress half of ``peer_kvpress.py``: runs in its own virtual environment (kvpress pins
transformers < 5.3), so it imports nothing from snapkv_rag.

Reads JSON lines on stdin, one request each: ``{"input_ids": [...], "budget": int, "window_size":
int, "kernel_size": int, "max_new_tokens": int, "eos_ids": [...]}``, optionally ``"press"`` (one of
:data:`PRESSES`, default ``"snapkv"``; ``null``: no press, the full cache), ``"stop_ids"`` (tokens
that end the answer once written, e.g. those holding a newline) and, for Finch, ``"question_start"``
and ``"delimiter_id"`` (Finch reads the question after a delimiter token that its embedding hook
removes again: the model sees the very same ids). For each, prefills the token ids under the press
(its documented use: the press as a context manager around the model's forward), then decodes
greedily from the compressed cache at the original positions, and writes one JSON line: the new
token ids, the time for the whole answer, its prefill and decode parts, and how many positions the
cache holds (AdaKV-style presses mask per head instead: their cache keeps every position). The
first line it writes is ``{"ready": true}`` once the model is loaded.

A request with ``"context_ids"`` and ``"tails"`` instead is a follow-up one (:func:`follow_up`):
the context compressed once by a query-agnostic press, several questions answered over it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from importlib import metadata

import torch
from kvpress import (
    AdaKVPress,
    ChunkKVPress,
    CriticalAdaKVPress,
    ExpectedAttentionPress,
    FinchPress,
    KnormPress,
    KVzipPress,
    SnapKVPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, DynamicCache

PRESSES = ("snapkv", "adakv", "criticaladakv", "finch", "chunkkv", "tova")
CONTEXT_PRESSES = {"kvzip": KVzipPress, "expected_attention": ExpectedAttentionPress, "knorm": KnormPress}
"""Query-agnostic presses for a ``"tails"`` request: the context compressed once, every question over it."""


def make_press(request: dict, ratio: float):
    """The named press at ``ratio``, its scorer SnapKV with the request's window and kernel (kvpress's
    own defaults otherwise: AdaKV's safeguard 0.2, ChunkKV's 20-token chunks). Finch keeps its keys
    at their positions (``rerotate_keys=False``), as every other press here does."""
    name = request.get("press", "snapkv")
    snap = SnapKVPress(compression_ratio=ratio, window_size=request["window_size"], kernel_size=request["kernel_size"])
    if name == "snapkv":
        return snap
    if name == "adakv":
        return AdaKVPress(snap)
    if name == "criticaladakv":
        return CriticalAdaKVPress(snap)
    if name == "chunkkv":
        return ChunkKVPress(snap)
    if name == "tova":
        return TOVAPress(compression_ratio=ratio)
    if name == "finch":
        press = FinchPress(compression_ratio=ratio, rerotate_keys=False)
        press.delimiter_token_id = request["delimiter_id"]
        return press
    raise ValueError(f"press: expected one of {PRESSES} or null, got {name!r}")


def answer(model, request: dict) -> dict:
    ids = request["input_ids"]
    length = len(ids)
    # kvpress keeps int(length * (1 - ratio)) positions per head: choose the ratio that keeps `budget`
    ratio = max(0.0, 1.0 - (request["budget"] + 0.5) / length)
    press = None if request.get("press", "snapkv") is None else make_press(request, ratio)
    if isinstance(press, FinchPress):  # the delimiter goes before the question; the hook removes it
        ids = ids[: request["question_start"]] + [request["delimiter_id"]] + ids[request["question_start"] :]
    cache = DynamicCache()
    with torch.inference_mode():
        start = time.perf_counter()
        with press(model) if press is not None else nullcontext():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1).logits
        prefill_s = time.perf_counter() - start
        kept = cache.layers[0].keys.shape[-2]
        decode_start = time.perf_counter()
        tokens, steps = decode(model, cache, logits, length, request)
        decode_s = time.perf_counter() - decode_start
    return {
        "tokens": tokens,
        "answer_s": time.perf_counter() - start,
        "prefill_s": prefill_s,
        "decode_ms_per_token": 1000 * decode_s / steps if steps else 0.0,
        "kept": kept,
        "compression_ratio": ratio,
    }


def decode(model, cache, logits, position: int, request: dict) -> tuple[list[int], int]:
    """Greedy tokens from the next-token ``logits``, fed at positions ``position ..`` over ``cache``
    (which grows), until an end-of-sequence or stop token or ``max_new_tokens``; and the forward
    steps that took."""
    eos, stops, tokens, steps = set(request["eos_ids"]), set(request.get("stop_ids", ())), [], 0
    for step in range(request["max_new_tokens"]):
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        tokens.append(token)
        if token in stops or step == request["max_new_tokens"] - 1:
            break
        logits = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            position_ids=torch.tensor([[position + step]]),
            logits_to_keep=1,
        ).logits
        steps += 1
    return tokens, steps


def follow_up(model, request: dict) -> dict:
    """kvpress's own multi-question use (its pipeline's): ``context_ids`` prefilled once under a
    query-agnostic press (:data:`CONTEXT_PRESSES`, or none: the full cache) keeping ``budget``
    positions on average, then each of ``tails`` (a question's tokens) run over that cache at the
    positions after the context and answered greedily; the cache is cut back to the context after
    each. Returns per tail its tokens and the seconds to its first token."""
    context = request["context_ids"]
    ratio = max(0.0, 1.0 - (request["budget"] + 0.5) / len(context))
    name = request.get("press")
    press = None if name is None else CONTEXT_PRESSES[name](compression_ratio=ratio)
    cache = DynamicCache()
    with torch.inference_mode():
        start = time.perf_counter()
        with press(model) if press is not None else nullcontext():
            model.model(input_ids=torch.tensor([context]), past_key_values=cache)
        build_s = time.perf_counter() - start
        lengths = [layer.keys.shape[-2] for layer in cache.layers]
        answers, first = [], []
        for tail in request["tails"]:
            begin = time.perf_counter()
            logits = model(
                input_ids=torch.tensor([tail]),
                past_key_values=cache,
                logits_to_keep=1,
                position_ids=torch.arange(len(context), len(context) + len(tail))[None],
            ).logits
            first.append(time.perf_counter() - begin)
            answers.append(decode(model, cache, logits, len(context) + len(tail), request)[0])
            for layer, n in zip(cache.layers, lengths):
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return {
        "answers": answers,
        "first_token_s": first,
        "build_s": build_s,
        "kept": sum(lengths) / len(lengths),
        "compression_ratio": ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model folder (the same one the snapkv_rag half loads)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    versions = {name: metadata.version(name) for name in ("kvpress", "transformers", "torch")}
    print(json.dumps({"ready": True, **versions}), flush=True)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            print(json.dumps(follow_up(model, request) if "tails" in request else answer(model, request)), flush=True)


if __name__ == "__main__":
    main()
