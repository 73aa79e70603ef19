"""What lookahead SnapKV's draft costs: the time from a prompt to its compressed cache (the prefill
and the selection, where the draft is counted) under lookahead SnapKV against plain SnapKV,
head-adaptive SnapKV and KVzip (``kvzip``: its re-read pass), on the same prompts, interleaved, with
the ratio printed.

Prompts: the method grid's first ``--prompts`` NQ questions (gold in the middle) with ``--docs``
passages each, on the embedded model (or ``--model``), at ``--share`` of the prompt kept. Rounds
alternate which method goes first. Printed per prompt size: each method's time (per prompt the
median over rounds, summed over the prompts) and its ratio to SnapKV's, and for the lookahead
methods the mean number of draft passes per prompt; the figures go to ``--out`` as JSON.
``lookahead_one_by_one`` is the default lookahead with its guessing off (one pass per drafted
token, :func:`snapkv_rag.runtime.draft.draft_and_vote`'s ``speculate=False``): what the guesses save.
The guesses also look in the model's earlier drafts: before the timed prompts, lookahead runs on
``--warm`` other NQ questions (5 passages each), and every timed run starts from exactly those
drafts (never from a draft of its own prompt, which a later round would otherwise find).
``--cpu-time`` times the process's CPU seconds instead of the wall clock (with one thread: the work,
not the wait for a core on a machine other work shares). With ``--decode-tokens N`` each round also decodes N tokens from each method's cache (``generate``,
end-of-sequence ignored) and the median decode step is printed beside SnapKV's: the padded heads
of the head-adaptive methods against SnapKV's even ones.

    python benchmarks/lookahead_cost.py --docs 10 20 30 --prompts 5 --out benchmarks/results/lookahead_guess.json
    python benchmarks/lookahead_cost.py --docs 20 --prompts 1 --decode-tokens 32 --methods snapkv adasnapkv lookahead lookahead_ada --out benchmarks/results/lookahead_decode.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def methods(budget: int) -> dict:
    from snapkv_rag import AdaSnapKVConfig, KVzipConfig, LookaheadSnapKVConfig, SnapKVConfig

    return {
        "snapkv": SnapKVConfig(max_capacity_prompt=budget),
        "adasnapkv": AdaSnapKVConfig(max_capacity_prompt=budget),
        "lookahead1": LookaheadSnapKVConfig(max_capacity_prompt=budget, lookahead=1),
        "lookahead4": LookaheadSnapKVConfig(max_capacity_prompt=budget, lookahead=4),
        "lookahead": LookaheadSnapKVConfig(max_capacity_prompt=budget),  # the default: an even split
        "lookahead_one_by_one": LookaheadSnapKVConfig(max_capacity_prompt=budget),  # guessing off
        "lookahead_ada": LookaheadSnapKVConfig(max_capacity_prompt=budget, floor=0.2),  # ragged heads
        "kvzip": KVzipConfig(max_capacity_prompt=budget),  # its re-read: a second prompt's prefill
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--docs", type=int, nargs="+", default=[10, 20, 30], help="passages per prompt")
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--prompts", type=int, default=3, help="NQ questions per prompt size")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["snapkv", "adasnapkv", "lookahead", "lookahead_one_by_one"],
        choices=list(methods(64)),
        help="what to time (snapkv always runs: the ratios' base)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=16, help="other questions whose drafts the guesses may use")
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        help="also time this many decode steps from each method's cache (median step, ms)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU seconds (time.process_time) instead of the wall clock: on a machine other "
        "work shares, with one thread (OMP_NUM_THREADS=1), the work each method does, not its wait for a core",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    from evals.datasets import nq_examples
    from snapkv_rag import SnapKVLLM
    from snapkv_rag.runtime import draft as lookahead

    llm = SnapKVLLM(args.model) if args.model else SnapKVLLM()
    runner, records = llm.runner, []
    guessing = lookahead.draft_and_vote
    names = ["snapkv"] + [name for name in args.methods if name != "snapkv"]
    lookahead.PAST_DRAFTS.pop(runner, None)
    timed = {example.question for example in nq_examples(args.prompts, [5], ["middle"], 0)}
    for example in [e for e in nq_examples(args.prompts + args.warm, [5], ["middle"], 0) if e.question not in timed]:
        ids = llm.request(example.question, list(example.documents), "text").input_ids
        runner.prefill([ids], {"warm": methods(round(args.share * len(ids)))["lookahead"]})
    earlier = list(lookahead.PAST_DRAFTS.get(runner, []))  # the warm-up drafts, the same for every timed run
    decode = " decode step, ms | vs SnapKV |" if args.decode_tokens else ""
    print(
        f"| passages | prompt tokens (mean) | method | to compressed cache, s | vs SnapKV | draft passes |{decode}\n"
        f"|---|---|---|---|---|---|{'---|---|' if decode else ''}",
        flush=True,
    )
    for docs in args.docs:
        seconds = {name: 0.0 for name in names}
        passes: dict[str, list[int]] = {name: [] for name in names}
        steps: dict[str, list[float]] = {name: [] for name in names}
        examples = nq_examples(args.prompts, [docs], ["middle"], 0)
        tokens = []
        for example in examples:
            ids = llm.request(example.question, list(example.documents), "text").input_ids
            tokens.append(len(ids))
            configs = {name: methods(round(args.share * len(ids)))[name] for name in names}
            draft: list[int] = []  # the passes after the prompt, counted by wrapping the runner's forward
            forward = runner.forward
            runner.forward = lambda input_ids, mask, positions, *rest, **kw: (
                (draft.append(1) if int(positions[0, 0]) >= len(ids) else None)
                or forward(input_ids, mask, positions, *rest, **kw)
            )
            times: dict[str, list[float]] = {name: [] for name in configs}
            for round_ in range(args.rounds + 1):
                for name in names if round_ % 2 else list(reversed(names)):
                    lookahead.draft_and_vote = (
                        functools.partial(guessing, speculate=False) if name == "lookahead_one_by_one" else guessing
                    )
                    draft.clear()
                    lookahead.PAST_DRAFTS[runner] = collections.deque(earlier, maxlen=64)
                    start = clock()
                    runner.prefill([ids], {name: configs[name]})
                    if round_:  # the first round warms up
                        times[name].append(clock() - start)
                    if round_ == 1 and name.startswith("lookahead"):
                        passes[name].append(len(draft))
                    if round_ and args.decode_tokens:  # the steady steps: the first one left out
                        result = llm.generate(
                            example.question,
                            list(example.documents),
                            snapkv=configs[name],
                            max_new_tokens=args.decode_tokens,
                            ignore_eos=True,
                        )
                        steps[name].extend(result.timings.decode_step_ms[1:])
            runner.forward = forward
            lookahead.draft_and_vote = guessing
            for name, values in times.items():
                seconds[name] += statistics.median(values)
        base = seconds["snapkv"]
        for name in names:
            record = {
                "passages": docs,
                "prompts": len(examples),
                "prompt_tokens": tokens,
                "method": name,
                "seconds": seconds[name],
                "vs_snapkv": seconds[name] / base,
            }
            mean_passes = statistics.mean(passes[name]) if passes[name] else None
            record["draft_passes"] = passes[name] or None
            line = (
                f"| {docs} | {round(statistics.mean(tokens))} | {name} | {seconds[name]:.2f} | "
                f"{seconds[name] / base:.2f}x | {'' if mean_passes is None else f'{mean_passes:.1f}'} |"
            )
            if steps[name]:
                record["decode_step_ms"] = statistics.median(steps[name])
                record["decode_vs_snapkv"] = record["decode_step_ms"] / statistics.median(steps["snapkv"])
                line += f" {record['decode_step_ms']:.1f} | {record['decode_vs_snapkv']:.2f}x |"
            records.append(record)
            print(line, flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "share": args.share,
                    "rounds": args.rounds,
                    "decode_tokens": args.decode_tokens,
                    "warm": args.warm,
                    "clock": "process CPU time" if args.cpu_time else "wall clock",
                    "command": "python benchmarks/lookahead_cost.py " + " ".join(sys.argv[1:]),
                    "records": records,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
