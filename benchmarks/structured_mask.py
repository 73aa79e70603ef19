"""The cost of constrained decoding, measured in one run on the embedded model (CPU).

For one RAG prompt, decode ``--tokens`` tokens greedily through the engine's scheduler (the one
decode loop), in interleaved rounds:

* ``plain``: no schema (what every free-text request runs);
* ``schema``: with a response format (an object with an enum, an integer range and an array of
  strings): ms/token and the ratio ``plain / schema``;

and the mask's own cost per token: filling and applying the token bitmask plus feeding the token
back to the matcher (``apply_masks`` + ``accept``), timed around those calls on the real logits.

    python benchmarks/structured_mask.py --out benchmarks/results/structured_mask.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rag_prompts import build_prompt  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "country": {"enum": ["France", "Japan", "England", "other"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "facts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    },
    "required": ["answer", "country", "year", "facts"],
    "additionalProperties": False,
}


def run_decode(llm, request, tokens: int, constraint=None) -> float:
    """Decode up to ``tokens`` tokens of ``request`` (held to ``constraint``, if given) through the
    scheduler; the median ms of its decode steps."""
    from snapkv_rag.runtime.sampling import SamplingOptions
    from snapkv_rag.runtime.scheduler import Outcome

    request = dataclasses.replace(request, constraint=constraint)
    ticket = llm.scheduler.submit(request, SamplingOptions(max_new_tokens=tokens), [], None)
    outcome = next(item for item in ticket if isinstance(item, Outcome))
    return median(outcome.row.decode_step_ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=24, help="decode steps per round (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each variant (default 3)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.request.structured import apply_masks

    llm = SnapKVLLM(snapkv=False)
    prompt = build_prompt(llm.tokenizer, args.prompt_tokens)
    request = llm.request(prompt.question, prompt.documents)
    ids = request.input_ids
    fmt = llm._compile_format(SCHEMA)
    variants = ["plain", "schema"]
    times = {v: [] for v in variants}
    for _ in range(args.rounds):  # interleaved, so that the machine's load falls on every variant alike
        for v in variants:
            times[v].append(run_decode(llm, request, args.tokens, fmt.new_constraint() if v == "schema" else None))
    pre = llm.runner.prefill([ids], {"": None})
    # the mask's own cost, on real logits: fill + apply the bitmask, then feed the token back
    mask_ms, constraint = [], fmt.new_constraint()
    logits = pre.logits.clone()
    for _ in range(args.tokens):
        begin = time.perf_counter()
        apply_masks(logits, [constraint])
        token = int(logits[0].argmax())
        constraint.accept(token)
        mask_ms.append(1000 * (time.perf_counter() - begin))
        if constraint.done:
            break
        logits = pre.logits.clone()
    none_us = []
    for _ in range(1000):
        begin = time.perf_counter()
        apply_masks(logits, [None])
        none_us.append(1e6 * (time.perf_counter() - begin))
    figures = {name: round(median(v), 2) for name, v in times.items() if v}
    result = {
        "prompt_tokens": len(ids),
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "ms_per_token": figures,
        "mask_ms_per_token": round(median(mask_ms), 3),
        "mask_share_of_step": round(median(mask_ms) / figures["plain"], 4),
        "ratio_plain_over_schema": round(figures["plain"] / figures["schema"], 3),
        "apply_masks_all_none_us": round(median(none_us), 2),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
