"""What lookahead SnapKV's draft costs: the time from a prompt to its compressed cache (the prefill
and the selection, where the draft is counted) under lookahead SnapKV against plain SnapKV and
head-adaptive SnapKV, on the same prompts, interleaved, with the ratio printed.

Prompts: the method grid's NQ questions (gold in the middle) with ``--docs`` passages each, on the
embedded model (or ``--model``), at ``--share`` of the prompt kept. Rounds alternate which method
goes first; printed per prompt size: the median seconds of each and their ratios to SnapKV, and
the figures go to ``--out`` as JSON. With ``--decode-tokens N`` each round also decodes N tokens
from each method's cache (``generate``, end-of-sequence ignored) and the median decode step is
printed beside SnapKV's: the padded heads of the head-adaptive methods against SnapKV's even ones.

    python benchmarks/lookahead_cost.py --docs 10 20 30 --out benchmarks/results/lookahead_cost.json
    python benchmarks/lookahead_cost.py --docs 20 --decode-tokens 32 --out benchmarks/results/lookahead_decode.json
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


def methods(budget: int) -> dict:
    from snapkv_rag import AdaSnapKVConfig, LookaheadSnapKVConfig, SnapKVConfig

    return {"snapkv": SnapKVConfig(max_capacity_prompt=budget), "adasnapkv": AdaSnapKVConfig(max_capacity_prompt=budget),
            "lookahead1": LookaheadSnapKVConfig(max_capacity_prompt=budget, lookahead=1),
            "lookahead4": LookaheadSnapKVConfig(max_capacity_prompt=budget, lookahead=4),
            "lookahead": LookaheadSnapKVConfig(max_capacity_prompt=budget),  # the default: an even split
            "lookahead_ada": LookaheadSnapKVConfig(max_capacity_prompt=budget, floor=0.2)}  # ragged heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--docs", type=int, nargs="+", default=[10, 20, 30], help="passages per prompt")
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="also time this many decode steps from each method's cache (median step, ms)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from evals.datasets import nq_examples
    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(args.model) if args.model else SnapKVLLM()
    runner, records = llm.runner, []
    decode = " decode step, ms | vs SnapKV |" if args.decode_tokens else ""
    print(f"| passages | prompt tokens | method | to compressed cache, s | vs SnapKV |{decode}\n"
          f"|---|---|---|---|---|{'---|---|' if decode else ''}")
    for docs in args.docs:
        example = nq_examples(1, [docs], ["middle"], 0)[0]
        ids = llm.request(example.question, list(example.documents), "text").input_ids
        configs = methods(round(args.share * len(ids)))
        times: dict[str, list[float]] = {name: [] for name in configs}
        steps: dict[str, list[float]] = {name: [] for name in configs}
        for round_ in range(args.rounds + 1):
            for name in (list(configs) if round_ % 2 else list(reversed(configs))):
                start = time.perf_counter()
                runner.prefill([ids], {name: configs[name]})
                if round_:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
                if round_ and args.decode_tokens:  # the steady steps: the first one left out
                    result = llm.generate(example.question, list(example.documents), snapkv=configs[name],
                                          max_new_tokens=args.decode_tokens, ignore_eos=True)
                    steps[name].extend(result.timings.decode_step_ms[1:])
        base = statistics.median(times["snapkv"])
        for name, values in times.items():
            seconds = statistics.median(values)
            record = {"passages": docs, "prompt_tokens": len(ids), "method": name, "seconds": seconds,
                      "vs_snapkv": seconds / base}
            line = f"| {docs} | {len(ids)} | {name} | {seconds:.2f} | {seconds / base:.2f}x |"
            if steps[name]:
                record["decode_step_ms"] = statistics.median(steps[name])
                record["decode_vs_snapkv"] = record["decode_step_ms"] / statistics.median(steps["snapkv"])
                line += f" {record['decode_step_ms']:.1f} | {record['decode_vs_snapkv']:.2f}x |"
            records.append(record)
            print(line, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"share": args.share, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
                                        "records": records}, indent=1))


if __name__ == "__main__":
    main()
