"""Selection time of document-aware and head-adaptive SnapKV against plain SnapKV, on the same
tensors, interleaved.

The pure selection functions only (no model): one layer's queries, keys and values of the shape of
the embedded SmolLM2-135M (9 query heads, 3 KV heads, head size 64) for a RAG prompt of ``--tokens``
tokens in ``--documents`` equal documents, at each ``--shares`` budget. Rounds alternate which
method goes first; printed: the median time of each and their ratios to plain SnapKV.

    python benchmarks/selection_time.py --tokens 3000 --documents 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from snapkv_rag import AdaSnapKVConfig, DocSnapKVConfig, PromptSpans, SnapKVConfig
from snapkv_rag.methods.adaptive import ada_snapkv_select


def spans_for(tokens: int, documents: int, tail: int = 60, head: int = 30) -> PromptSpans:
    """``documents`` equal blocks between a ``head``-token system turn and a ``tail`` (instruction,
    question), two separator tokens between blocks; counted from the end."""
    size = (tokens - head - tail) // documents
    starts = [head + i * size for i in range(documents)]
    return PromptSpans(documents=tuple((s - tokens, s + size - 2 - tokens) for s in starts), question=-20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, args.tokens, 64, generator=g)
    keys, values = (torch.randn(1, 3, args.tokens, 64, generator=g) for _ in range(2))
    spans = spans_for(args.tokens, args.documents)
    print(
        "| prompt tokens | documents | budget | SnapKV ms | document-aware ms | ratio | head-adaptive ms | ratio |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for share in args.shares:
        budget = round(share * args.tokens)
        ada = AdaSnapKVConfig(max_capacity_prompt=budget)
        methods = {
            "plain": lambda c=SnapKVConfig(max_capacity_prompt=budget): c.select(query, keys, values, None, 0, 30),
            "doc": lambda c=DocSnapKVConfig(max_capacity_prompt=budget, spans=spans): c.select(
                query, keys, values, None, 0, 30
            ),
            "ada": lambda: ada_snapkv_select(query[..., -ada.window_size :, :], keys, values, ada),
        }
        times = {name: [] for name in methods}
        for round_ in range(args.rounds + 1):
            for name in list(methods) if round_ % 2 else list(reversed(methods)):
                start = time.perf_counter()
                methods[name]()
                if round_:  # the first round warms up
                    times[name].append(1000 * (time.perf_counter() - start))
        plain, doc, adaptive = (statistics.median(times[n]) for n in ("plain", "doc", "ada"))
        print(
            f"| {args.tokens} | {args.documents} | {budget} | {plain:.2f} | {doc:.2f} | {doc / plain:.2f} | "
            f"{adaptive:.2f} | {adaptive / plain:.2f} |"
        )


if __name__ == "__main__":
    main()
