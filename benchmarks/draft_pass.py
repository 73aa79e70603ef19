"""What one pass of lookahead SnapKV's draft costs with several tokens in it, against a one-token
pass, over a prompt's whole cache: with grouped heads (``snapkv_rag.runtime.attention.grouped_tail_sdpa``,
the CPU default for a pass over a cached prefix) and with transformers' own masked SDPA (each KV
head copied once per query head it serves), interleaved, in one run.

Prompt: the method grid's first NQ question with ``--docs`` passages, on the embedded model. Printed
per pass length: the median milliseconds of each attention path and their ratio to the one-token
pass with grouped heads.

    python benchmarks/draft_pass.py --docs 10 30 --out benchmarks/results/draft_pass.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from evals.datasets import nq_examples
    from snapkv_rag import SnapKVLLM
    from snapkv_rag.kv import tails
    from snapkv_rag.kv.prefix_cache import Capture
    from snapkv_rag.kv.prompt_cache import PromptCache
    from snapkv_rag.runtime import attention
    from snapkv_rag.runtime import draft as lookahead

    llm = SnapKVLLM()
    runner, records, grouped = llm.runner, [], attention._grouped_tail
    print(
        "| passages | prompt tokens | tokens in the pass | grouped heads, ms | copied heads, ms | vs one token (grouped) |\n"
        "|---|---|---|---|---|---|",
        flush=True,
    )
    for docs in args.docs:
        example = nq_examples(1, [docs], ["middle"], 0)[0]
        ids = llm.request(example.question, list(example.documents), "text").input_ids
        whole = Capture(len(ids), max_bytes=1 << 62, queries=32, own=False)
        first = runner.prefill([ids], {lookahead.WHOLE: None}, whole=whole)
        prefix = whole.prefix(ids, len(runner.specs), tails.held_states(first.compressed[lookahead.WHOLE][0].layers))

        def one_pass(count: int) -> float:
            cache = PromptCache(runner.model.config, runner.specs, prefix)
            cache.compress = lambda i, *_: setattr(cache.layers[i], "pending", None)
            start = time.perf_counter()
            with torch.inference_mode(), runner.sliced_mlps():
                runner.forward(
                    torch.tensor([ids[-count:]]),
                    None,
                    torch.arange(len(ids), len(ids) + count)[None],
                    cache,
                    at=list(range(count)),
                )
            return time.perf_counter() - start

        times = {(count, path): [] for count in args.tokens for path in ("grouped", "copied")}
        for round_ in range(args.rounds + 1):
            for key in list(times) if round_ % 2 else list(reversed(times)):
                attention._grouped_tail = grouped if key[1] == "grouped" else (lambda *a, **k: False)
                seconds = one_pass(key[0])
                if round_:  # the first round warms up
                    times[key].append(seconds)
        attention._grouped_tail = grouped
        base = statistics.median(times[(args.tokens[0], "grouped")])
        for count in args.tokens:
            ms = {path: statistics.median(times[(count, path)]) * 1000 for path in ("grouped", "copied")}
            records.append(
                {
                    "passages": docs,
                    "prompt_tokens": len(ids),
                    "tokens": count,
                    "grouped_ms": ms["grouped"],
                    "copied_ms": ms["copied"],
                    "vs_one_token": ms["grouped"] / (base * 1000),
                }
            )
            print(
                f"| {docs} | {len(ids)} | {count} | {ms['grouped']:.1f} | {ms['copied']:.1f} | "
                f"{ms['grouped'] / (base * 1000):.2f}x |",
                flush=True,
            )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/draft_pass.py " + " ".join(sys.argv[1:]),
                    "rounds": args.rounds,
                    "records": records,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
