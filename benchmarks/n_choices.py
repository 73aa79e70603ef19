"""The time of ``n=4`` against ``n=1`` on one RAG prompt, in one run.

One NQ RAG prompt of about ``--tokens`` tokens (``rag_prompts.py``) through the embedded model,
64-token answers (``ignore_eos``), temperature 0.7, the default SnapKV budget, no prefix cache (so
that every request prefills its documents): ``generate(..., n=1)`` and ``generate(..., n=4)``
alternate for ``--repeats`` rounds (the order swapped each round). ``n=4`` is one prefill and one
selection, then four rows of the decode batch. It prints each request's wall time, the medians and
their ratio (target: n=4 <= 1.6x n=1), and writes ``results/n_choices.json``.

    nice -n 19 python benchmarks/n_choices.py          # ~1,500-token prompt, 3 rounds
    python benchmarks/n_choices.py --quick             # a short prompt, 8 tokens, 1 round (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rag_prompts import build_prompt  # noqa: E402


def timed(llm, prompt, n: int, seed: int, max_new_tokens: int) -> dict:
    """One request's wall time and figures (prefills counted by the engine's scheduler)."""
    before = llm.stats().prefills
    start = time.perf_counter()
    result = llm.generate(
        prompt.question,
        prompt.documents,
        n=n,
        temperature=0.7,
        seed=seed,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
    )
    seconds = time.perf_counter() - start
    answers = result.choices or [result]
    return {
        "n": n,
        "seconds": seconds,
        "prefills": llm.stats().prefills - before,
        "prefill_s": result.timings.prefill_s,
        "completion_tokens": result.usage.completion_tokens,
        "decode_ms_per_token": statistics.mean(a.timings.decode_ms_per_token for a in answers),
        "batch_size": max(a.timings.batch_size for a in answers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500, help="prompt length to reach (default 1500)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="choices to compare with n=1 (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="~300-token prompt, 8 new tokens, 1 round")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "n_choices.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.max_new_tokens, args.repeats = 300, 8, 1

    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(prefix_cache_bytes=0)
    prompt = build_prompt(llm.tokenizer, args.tokens)
    llm.generate(
        "Who wrote it?",
        [{"title": "Warm-up", "text": "A short text for the warm-up."}],
        n=2,
        temperature=0.7,
        max_new_tokens=4,
    )
    rows = []
    for round_ in range(args.repeats):
        order = (1, args.n) if round_ % 2 == 0 else (args.n, 1)
        for n in order:
            rows.append({"round": round_, **timed(llm, prompt, n, seed=round_, max_new_tokens=args.max_new_tokens)})
            r = rows[-1]
            print(
                f"round {round_} n={n}: {r['seconds']:.2f} s (prefill {r['prefill_s']:.2f} s, {r['prefills']} "
                f"prefill, {r['completion_tokens']} tokens at {r['decode_ms_per_token']:.1f} ms/token per row)",
                flush=True,
            )
    one = statistics.median(r["seconds"] for r in rows if r["n"] == 1)
    many = statistics.median(r["seconds"] for r in rows if r["n"] == args.n)
    summary = {
        "model": Path(llm.model_name).name,
        "prompt_tokens": llm.prompt_tokens(prompt.question, prompt.documents),
        "max_new_tokens": args.max_new_tokens,
        "temperature": 0.7,
        "n": args.n,
        "repeats": args.repeats,
        "median_s_n1": one,
        f"median_s_n{args.n}": many,
        "ratio": many / one,
        "target_ratio": 1.6,
        "quick": args.quick,
    }
    print(
        f"n={args.n}: {many:.2f} s, n=1: {one:.2f} s (medians of {args.repeats}): {many / one:.2f}x "
        f"(target <= 1.6x) on a {summary['prompt_tokens']}-token prompt, {args.max_new_tokens}-token answers"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
