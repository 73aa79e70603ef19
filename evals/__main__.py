"""``python -m evals``: build the datasets, run every method on each prompt from one shared
prefill, write rows.jsonl (resumable), summary.md / summary.csv and plots.

Examples (from the repository root)::

    python -m evals --smoke                       # ~1-2 min on 2 CPU cores; CI
    python -m evals --full --out evals/results/full   # the committed run's grid (hours on CPU)
    python -m evals --datasets nq --num-docs 10,20 --gold-positions first,last \\
        --methods snapkv,streaming --budgets 25%,512 --num-questions 50
    python -m evals --model Qwen/Qwen2.5-7B-Instruct --device cuda --dtype bfloat16 --full
    python -m evals --report-only --out evals/results/full   # tables and plots from rows.jsonl
    python -m evals --measure-sharing 3           # shared prefill vs separate generate() calls
    python -m evals --data my_qa.jsonl --methods snapkv,streaming   # your own questions and documents
    python -m evals --datasets needle,lines --num-docs needle=1000,4000 --num-docs lines=50,200
    python -m evals --full --ray                  # the same grid on Ray actors started on this machine
    python -m evals --full --ray auto             # ... on the running Ray cluster this machine is in
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

PRESETS = {
    "smoke": {
        "datasets": "nq,musique,kv",
        "num_docs": ["nq=5", "musique=5", "kv=5"],
        "gold_positions": "last",
        "num_questions": 1,
        "methods": "full,snapkv@128,pyramidkv@25%,streaming@25%,h2o@25%,random@25%",
        "budgets": "",
        "max_new_tokens": 8,
    },
    "full": {
        "datasets": "nq,musique",
        "num_docs": ["nq=5,10,20,30", "musique=10,20"],
        "gold_positions": "first,middle,last",
        "num_questions": 100,
        "methods": "full,snapkv,streaming",
        "budgets": "25%,50%",
        "max_new_tokens": 32,
    },
}
DEFAULTS = {
    "datasets": "nq",
    "gold_positions": "first,middle,last",
    "num_questions": 20,
    "methods": "full,snapkv,streaming",
    "budgets": "25%,50%",
    "max_new_tokens": 32,
}


def parser(prog: str = "python -m evals") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="RAG accuracy evals for snapkv-rag: answer F1, citation F1 and fidelity to the full cache "
        "as the number of documents and the gold position vary, for several KV-cache methods that "
        "share one prefill per prompt.",
        epilog="Presets set defaults that explicit options override. --smoke: nq, musique and kv, 1 question each, "
        "N=5, gold last, snapkv@128 and every other method at 25% of the prompt, 8 new tokens "
        "(3 prompts; about 1 minute on 2 idle CPU cores). --full: the committed run's grid: NQ 100 "
        "questions x N 5,10,20,30 x gold first/middle/last and MuSiQue 100 x N 10,20, full + snapkv and "
        "streaming at 25% and 50%, 32 new tokens: 1,400 prompts, about 6 hours on 2 CPU cores with the "
        "embedded model, minutes on a GPU.",
    )
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--smoke",
        action="store_true",
        help="tiny end-to-end run of every dataset kind and method (CI; under 3 minutes on 2 CPU cores)",
    )
    preset.add_argument(
        "--full", action="store_true", help="the full grid: NQ and MuSiQue at 100 questions (see below)"
    )
    p.add_argument(
        "--model", default=None, help="model folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu)"
    )
    p.add_argument("--quantize", default=None, choices=("int8", "int4"), help="quantized weights (default: none)")
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=("int8", "fp8"),
        help="the kept cache in 8 bits (default: the model's dtype)",
    )
    p.add_argument(
        "--datasets",
        default=None,
        help="comma-separated: nq, musique, hotpotqa, kv, and the "
        "synthetic needle (needle in a haystack) and lines (LongEval-Lines) (default: nq, or none "
        "when --data is given)",
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        type=Path,
        metavar="FILE.jsonl",
        help="your own QA data, one JSON record per line: question, answers (list), documents (list "
        "of {title, text} or strings), optional gold (1-based document numbers) and id; the dataset "
        "is named after the file; repeat for several files. Schema: evals/README.md",
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave out --data records that break the schema "
        "(counted in the output and the summary) instead of stopping at the first",
    )
    p.add_argument(
        "--depths",
        default="0,25,50,75,100",
        help="needle and lines: depths of the needle / the "
        "asked line, in percent of the context (default: 0,25,50,75,100)",
    )
    p.add_argument(
        "--num-docs",
        action="append",
        default=None,
        metavar="[DATASET=]N,N,...",
        help="documents per prompt (kv: key-value pairs, at most 75; needle: prompt tokens; lines: "
        "lines; --data: the first N documents of each record). Repeat with DATASET= to set one "
        "dataset's list, e.g. --num-docs 5,10 --num-docs musique=10,20 (default: 5,10,20; needle "
        "1000,2000,4000,8000; lines 50,100,200,300; --data: all of each record's documents)",
    )
    p.add_argument(
        "--gold-positions",
        default=None,
        help="comma-separated: first, middle (N//2), last, every "
        "(each slot); nq and kv only, musique/hotpotqa shuffle their gold documents with the seed "
        "(default: first,middle,last)",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated: full, or KIND or KIND@BUDGET with KIND in "
        "snapkv, pyramidkv, streaming, h2o, random, docsnapkv (document-aware), adasnapkv (head-adaptive), lookahead (its drafted answer votes too), keynorm and kvzip (query-agnostic); a bare KIND gets every --budgets value; full is always "
        "run (fidelity reference) (default: full,snapkv,streaming)",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated budgets for bare KINDs: tokens kept per layer "
        "(512) or a share of the cell's mean prompt (25%%), window included (default: 25%%,50%%)",
    )
    p.add_argument(
        "--num-questions",
        type=int,
        default=None,
        help="questions per dataset, a seeded sample, the same in every cell (default: 20)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for question sampling and document shuffles (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per answer (default: 32)")
    p.add_argument(
        "--stop",
        default="\\n",
        help="stop string, backslash escapes allowed; '' for none (default: a newline: answers are one line)",
    )
    p.add_argument(
        "--citations",
        choices=("text", "json"),
        default="text",
        help="text: the model cites [n] in "
        "free text (parsed from it); json: the engine's cited-answer mode, decoding constrained to "
        '{"answer": str, "citations": [1..N]} with its own instruction, no stop string; answer '
        "metrics on the answer field (default: text)",
    )
    p.add_argument(
        "--instruction",
        default=None,
        help="the RAG instruction placed before the question (default: snapkv_rag.request.prompts.DEFAULT_INSTRUCTION)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder for rows.jsonl, summary.md/.csv, plots/ "
        "and command.txt (default: runs/evals/<preset or custom>)",
    )
    p.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="start over instead of continuing the rows already in --out (resuming is the default)",
    )
    p.add_argument(
        "--batch-methods",
        action="store_true",
        help="decode each prompt's methods as rows of one "
        "batch (about 1.2x faster for 21 methods on one CPU thread; the answers are those of one at a time, "
        "since batches equal single calls, but ms/tok is then the batch's step time)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--report-only", action="store_true", help="only (re)write the tables and plots from --out/rows.jsonl"
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="auto|ADDRESS",
        help="run the prompts on Ray actors, each loading the model once (one GPU each where the "
        "cluster has GPUs): bare --ray starts Ray on this machine, 'auto' joins the running cluster "
        "(RAY_ADDRESS), or give its address (ray://HEAD:10001). Needs snapkv-rag[ray]",
    )
    p.add_argument(
        "--ray-workers",
        type=int,
        default=None,
        metavar="K",
        help="number of actors (default: one per GPU of the cluster, else one per CPU)",
    )
    p.add_argument(
        "--measure-sharing",
        type=int,
        default=0,
        metavar="K",
        help="instead of the evals, time "
        "compare() over the --methods vs one generate() per method on K NQ prompts and print the ratio",
    )
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


DEFAULT_DOCS = [5, 10, 20]
SYNTHETIC_DOCS = {"needle": [1000, 2000, 4000, 8000], "lines": [50, 100, 200, 300]}


def num_docs_by_dataset(
    values: list[str], datasets: list[str], optional: tuple[str, ...] = ()
) -> dict[str, list[int] | None]:
    """N values per dataset; an ``optional`` dataset without any (a --data file) gets None."""
    base: list[int] | None = None
    per: dict[str, list[int]] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        try:
            numbers = [int(x) for x in _csv(rest if sep else value)]
        except ValueError:
            raise SystemExit(f"--num-docs {value!r}: expected integers like 5,10,20 or DATASET=5,10") from None
        if not numbers:
            raise SystemExit(f"--num-docs {value!r}: no numbers given")
        if sep:
            per[name.strip()] = numbers
        else:
            base = numbers
    out: dict[str, list[int] | None] = {}
    for d in datasets:
        if d not in per and base is None and d not in optional:
            raise SystemExit(f"--num-docs: no N given for {d}")
        out[d] = per.get(d, base)
    return out


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    preset = PRESETS["smoke"] if args.smoke else PRESETS["full"] if args.full else DEFAULTS
    if args.data and not (args.smoke or args.full):
        preset = {**preset, "datasets": ""}  # --data alone runs only the user's files
    if args.num_docs is None and not (args.smoke or args.full):
        # each named dataset its default N (the synthetic tests their lengths); --data files all their documents
        args.num_docs = [
            f"{d}={','.join(map(str, SYNTHETIC_DOCS.get(d, DEFAULT_DOCS)))}"
            for d in _csv(args.datasets if args.datasets is not None else preset["datasets"])
        ]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path("runs") / "evals" / ("smoke" if args.smoke else "full" if args.full else "custom")
    if args.num_questions < 1:
        raise SystemExit("--num-questions: must be >= 1")
    if args.max_new_tokens < 1:
        raise SystemExit("--max-new-tokens: must be >= 1")
    if args.ray_workers is not None and args.ray_workers < 1:
        raise SystemExit("--ray-workers: must be >= 1")
    if args.ray_workers is not None and args.ray is None:
        raise SystemExit("--ray-workers: only with --ray")
    if args.ray is not None and args.measure_sharing:
        raise SystemExit("--measure-sharing: times one process; not with --ray")
    args.stop = args.stop.encode().decode("unicode_escape")
    return args


def main(argv: list[str] | None = None, engine=None, make_engine=None, prog: str = "python -m evals") -> int:
    """Entry point (also ``snapkv-rag eval``, with its ``prog``). ``engine`` (a SnapKVLLM) replaces
    loading ``--model``; ``make_engine`` (a picklable function returning one) does so on Ray actors
    (tests pass a tiny model)."""
    argv = sys.argv[1:] if argv is None else argv
    args = resolve(parser(prog).parse_args(argv))
    from . import report

    if args.report_only:
        print(report.write_all(args.out))
        print(f"wrote {args.out}/summary.md, summary.csv and plots/")
        return 0

    from snapkv_rag.request.prompts import DEFAULT_INSTRUCTION

    from . import datasets, methods, synthetic, userdata

    names = _csv(args.datasets)
    known = (*datasets.DATASETS, *synthetic.SYNTHETIC)
    bad = [d for d in names if d not in known]
    if bad or not (names or args.data):
        raise SystemExit(f"--datasets: unknown {bad or names}; choose from {', '.join(known)}, or give --data")
    positions = _csv(args.gold_positions)
    bad = [x for x in positions if x not in datasets.POSITIONS]
    if bad or not positions:
        raise SystemExit(f"--gold-positions: unknown {bad or positions}; choose from {', '.join(datasets.POSITIONS)}")
    try:
        specs = methods.expand(_csv(args.methods), _csv(args.budgets))
    except ValueError as error:
        raise SystemExit(f"--methods/--budgets: {error}") from None
    try:
        depths = synthetic.parse_depths(_csv(args.depths))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    own_names = [userdata.dataset_name(p) for p in args.data]
    docs = num_docs_by_dataset(args.num_docs, [*names, *own_names], optional=tuple(own_names))
    try:  # every record checked before any model work
        own = userdata.load_all(args.data, docs, args.skip_bad)
    except userdata.DataError as error:
        raise SystemExit(str(error)) from None
    for data in own:
        for message in data.skipped:
            print(f"skipped: {message}", file=sys.stderr)
        print(
            f"--data {data.path}: {len({e.question_id for e in data.examples})} records"
            + (f", {len(data.skipped)} skipped as bad" if data.skipped else "")
            + (f", {data.without_gold} without gold (no citation metrics)" if data.without_gold else "")
        )
    instruction = args.instruction if args.instruction is not None else DEFAULT_INSTRUCTION
    if args.citations == "json":
        from snapkv_rag.request.cited import CITE_INSTRUCTION

        if args.instruction is not None:
            raise SystemExit("--instruction: not with --citations json, whose instruction asks for the JSON")
        instruction = CITE_INSTRUCTION
    llm = _engine(args, engine, make_engine, instruction)
    try:
        if args.measure_sharing:
            from .sharing import measure

            measure(
                llm,
                specs,
                args.measure_sharing,
                seed=args.seed,
                max_new_tokens=args.max_new_tokens,
                stop=[args.stop] if args.stop else [],
            )
            return 0
        try:
            examples = [
                e
                for d in names
                for e in (
                    synthetic.build(d, args.num_questions, docs[d], depths, args.seed, count=llm.prompt_tokens)
                    if d in synthetic.SYNTHETIC
                    else datasets.build(d, args.num_questions, docs[d], positions, args.seed)
                )
            ]
        except (ValueError, FileNotFoundError) as error:
            raise SystemExit(str(error)) from None
        examples += [e for data in own for e in data.examples]
        return _run(args, argv, llm, examples, specs, instruction, own)
    finally:
        if args.ray is not None:
            llm.close()


def _engine_options(args) -> dict:
    return {"device": args.device, "dtype": args.dtype, "quantize": args.quantize, "kv_dtype": args.kv_dtype}


def _engine(args, engine, make_engine, instruction):
    """The local engine, or the Ray actors (which then answer prompt_tokens and context_window)."""
    from functools import partial

    from snapkv_rag import SnapKVLLM

    if args.ray is not None:
        from .distributed import connect

        factory = make_engine or partial(SnapKVLLM, args.model, instruction=instruction, **_engine_options(args))
        return connect(args.ray, args.ray_workers, factory, instruction, args.device)
    try:
        llm = engine or SnapKVLLM(args.model, instruction=instruction, **_engine_options(args))
    except ValueError as error:  # an unknown model, device or dtype: one line, not a traceback
        raise SystemExit(f"--model/--device/--dtype: {error}") from None
    llm.instruction = instruction
    return llm


def _run(args, argv, llm, examples, specs, instruction, own) -> int:
    from . import report, runner

    settings = {
        "model": args.model or "embedded:SmolLM2-135M-Instruct",
        "instruction": instruction,
        "max_new_tokens": args.max_new_tokens,
        "stop": args.stop,
        "seed": args.seed,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "kv_dtype": args.kv_dtype,
        "device": str(llm.device),
        "methods": [s.name for s in specs],
    }
    if args.batch_methods:  # recorded, not checked on resume: it changes timings, not answers
        settings["batch_methods"] = True
    stop = [args.stop] if args.stop and args.citations == "text" else []
    if args.citations == "json":  # the grammar ends the answer: no stop string
        settings.update(citations="json", stop="")
    if own:
        settings["data"] = [
            {
                "dataset": d.name,
                "file": str(d.path),
                "records": len({e.question_id for e in d.examples}),
                "skipped": len(d.skipped),
                "without_gold": d.without_gold,
            }
            for d in own
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command.txt").write_text("python -m evals " + shlex.join(argv) + "\n")
    start = time.perf_counter()
    options = dict(
        settings=settings, max_new_tokens=args.max_new_tokens, stop=stop, resume=args.resume, progress=args.progress
    )
    try:
        if args.ray is not None:
            llm.run(examples, specs, args.out, **options)
        else:
            runner.run(llm, examples, specs, args.out, **options)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    print(report.write_all(args.out))
    print(
        f"{len(examples)} prompts x {len(specs)} methods in {time.perf_counter() - start:.0f} s; "
        f"wrote {args.out}/rows.jsonl, summary.md, summary.csv, plots/"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
