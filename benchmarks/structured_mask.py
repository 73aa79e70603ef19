"""The cost of constrained decoding, measured in one run on the embedded model (CPU).

From ONE prefill of one RAG prompt, decode ``--tokens`` tokens greedily, in interleaved rounds:

* ``plain``: the decode loop of this tree, no schema (what every free-text request runs);
* ``before``: the decode loop of ``--before-ref`` (default ``main``: the code before constrained
  decoding), loaded from git into this process, no schema: ``before / plain`` ms/token is the
  no-schema ratio that must stay >= 0.95;
* ``schema``: this tree's loop with a response format (an object with an enum, an integer range and
  an array of strings): ms/token and the ratio ``plain / schema``;

and the mask's own cost per token: filling and applying the token bitmask plus feeding the token
back to the matcher (``apply_masks`` + ``accept``), timed around those calls on the real logits.

    python benchmarks/structured_mask.py --out benchmarks/results/structured_mask.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rag_prompts import build_prompt  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "country": {"enum": ["France", "Japan", "England", "other"]},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "facts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}},
    "required": ["answer", "country", "year", "facts"], "additionalProperties": False}


def before_decode(ref: str):
    """``decode`` of ``ref``'s ``snapkv_rag/generation.py``, as a module of this package (its relative
    imports resolve against the installed package); None when git cannot show it."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", f"{ref}:snapkv_rag/generation.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "generation_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("snapkv_rag._generation_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode


def run_decode(decode, llm, pre, name: str, tokens: int, constraints=None) -> float:
    """Decode ``tokens`` tokens from ``pre.caches[name]``; the median ms of its decode steps."""
    from snapkv_rag.generation import Finished, SamplingOptions

    kwargs = {} if constraints is None else {"constraints": constraints}
    for event in decode(llm.runner, pre, name, SamplingOptions(max_new_tokens=tokens), **kwargs):
        if isinstance(event, Finished):
            return median(event.step_ms)
    raise RuntimeError("decode ended without finishing its row")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=24, help="decode steps per round (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each variant (default 3)")
    p.add_argument("--before-ref", default="main", help="git ref of the code before the change (default main)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.generation import Batch, decode, prefill
    from snapkv_rag.structured import apply_masks

    llm = SnapKVLLM(snapkv=False)
    prompt = build_prompt(llm.tokenizer, args.prompt_tokens)
    ids = llm.request(prompt.question, prompt.documents).input_ids
    fmt = llm._compile_format(SCHEMA)
    old = before_decode(args.before_ref)
    variants = ["plain", "schema"] + (["before"] if old is not None else [])
    # one prefill fills one cache per (variant, round): every decode starts from the same state
    names = [f"{v}{r}" for r in range(args.rounds) for v in variants]
    pre = prefill(llm.runner, Batch.of([ids], llm.runner.pad_id), {n: None for n in names}, room=args.tokens)
    times = {v: [] for v in variants}
    for r in range(args.rounds):  # interleaved, so that the machine's load falls on every variant alike
        for v in variants:
            times[v].append(run_decode(old if v == "before" else decode, llm, pre, f"{v}{r}", args.tokens,
                                       [fmt.new_constraint()] if v == "schema" else None))
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
        "prompt_tokens": len(ids), "decode_tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
        "ms_per_token": figures, "mask_ms_per_token": round(median(mask_ms), 3),
        "mask_share_of_step": round(median(mask_ms) / figures["plain"], 4),
        "ratio_plain_over_schema": round(figures["plain"] / figures["schema"], 3),
        "ratio_before_over_plain_no_schema": round(figures["before"] / figures["plain"], 3) if "before" in figures
        else None, "apply_masks_all_none_us": round(median(none_us), 2), "before_ref": args.before_ref,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = result["ratio_before_over_plain_no_schema"] is None or result["ratio_before_over_plain_no_schema"] >= 0.95
    print("no-schema ratio (before / now) >= 0.95:", "yes" if ok else "NO")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
