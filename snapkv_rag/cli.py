"""The ``snapkv-rag`` command: ask a question over your files, or run the bundled side-by-side demo."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from .methods import SnapKVConfig, method_class
from .methods.registry import names_with
from .request.files import DOC_SUFFIXES, DocumentFileError, collect_documents
from .server import options as serve_options

DEMO_FILE = Path(__file__).with_name("data") / "demo.jsonl"
# the engine's and the configs' field names, as the flags that set them
FLAGS = {
    "max_capacity_prompt": "--budget",
    "window_size": "--window",
    "kernel_size": "--kernel",
    "pooling": "--pooling",
    "max_new_tokens": "--max-new-tokens",
    "device": "--device",
    "dtype": "--dtype",
    "model": "--model",
}
CLI_METHODS = tuple(names_with("window_size", "kernel_size", "pooling"))
"""The methods --method offers: those the --window / --kernel / --pooling flags apply to."""
COMPRESSION_DEFAULTS = {"method": "snapkv", "budget": 1024, "window": 32, "kernel": 7, "pooling": "max"}
log = logging.getLogger("snapkv_rag.cli")


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def in_flag_words(message: str) -> str:
    """``max_capacity_prompt: must be ... window_size=32`` -> ``--budget: must be ... --window 32``."""
    for field_name, flag in FLAGS.items():
        message = re.sub(
            rf"\b{field_name}=(?:'([^']*)'|(\S+?))(?=[,;:)\s]|$)",
            lambda m, f=flag: f"{f} {m.group(1) or m.group(2)}",
            message,
        )
        message = re.sub(rf"(^|\s){field_name}:", rf"\1{flag}:", message)
    return message


def _note(message: str) -> None:
    """Input that was overridden or skipped: said on stderr (silenced by --quiet)."""
    log.warning("note: %s", message)


def _documents(paths: list[str]):
    try:
        collected = collect_documents(paths)
    except DocumentFileError as error:
        raise UsageError(f"--docs: {error}") from error
    if collected.skipped:
        names = ", ".join(p.name for p in collected.skipped[:5]) + (" ..." if len(collected.skipped) > 5 else "")
        _note(f"--docs: skipped {len(collected.skipped)} file(s) that are not {', '.join(DOC_SUFFIXES)}: {names}")
    return collected.documents


def _quiet_loading(args) -> None:
    """transformers' weight-loading bars and warnings stay out of the CLI's output unless --verbose."""
    from transformers.utils import logging as hf_logging

    if args.verbose:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _check_new_tokens(args) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")


def _engine(args, snapkv, **engine_options):
    import torch

    _check_new_tokens(args)
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available here; use --device cpu")
    _quiet_loading(args)
    from .engine import SnapKVLLM

    log.info("loading %s", args.model or "the embedded default model")
    llm = SnapKVLLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        snapkv=snapkv,
        max_new_tokens=args.max_new_tokens,
        **engine_options,
    )
    context = getattr(llm.model.config, "max_position_embeddings", None)
    budgets = [c.max_capacity_prompt for c in ([snapkv] if snapkv else [])] + list(getattr(args, "budgets", []))
    too_big = [b for b in budgets if context and isinstance(b, int) and b > context]
    if too_big:
        raise UsageError(
            f"--budget{'s' if hasattr(args, 'budgets') else ''} {too_big[0]}: larger than the model's "
            f"context window ({context} tokens), so nothing would ever be dropped; use --full to keep "
            f"the whole cache"
        )
    return llm


def _compression(args) -> dict:
    """The compression flags with their defaults filled in; a note when --full makes them moot."""
    given = {name: getattr(args, name) for name in COMPRESSION_DEFAULTS if getattr(args, name) is not None}
    if getattr(args, "full", False) and given:
        _note("--full keeps the whole cache: " + ", ".join(f"--{n} {v}" for n, v in given.items()) + " ignored")
    return {**COMPRESSION_DEFAULTS, **given, "given": set(given)}


def budget_value(text: str) -> int | float:
    """``--budget``: tokens (``512``) or a share of each prompt (``50%``, kept as 0.5)."""
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0 < share <= 1:
                raise argparse.ArgumentTypeError(f"{text}: a share of the prompt must be in (0%, 100%]")
            return share
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text}: expected a number of tokens (512) or a share of the prompt (50%)"
        ) from None


def _snapkv(budget: int | float, settings: dict) -> SnapKVConfig:
    size = {"ratio": budget} if isinstance(budget, float) else {"max_capacity_prompt": budget}
    method = method_class(settings["method"])
    shape = {"window_size": settings["window"], "kernel_size": settings["kernel"], "pooling": settings["pooling"]}
    given = settings.get("given", ())
    if "kernel" not in given and method.kernel_size != SnapKVConfig.kernel_size:
        del shape["kernel_size"]  # the method's own default (KVzip's: no pooling), unless --kernel says otherwise
    try:
        return method(**size, **shape)
    except ValueError as error:
        raise UsageError(in_flag_words(str(error))) from error


def _config(args) -> SnapKVConfig | None:
    settings = _compression(args)
    return None if args.full else _snapkv(settings["budget"], settings)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_ask(args) -> int:
    if not args.question.strip():
        raise UsageError("the question must not be empty")
    docs = _documents(args.docs)
    llm = _engine(args, _config(args))
    result = llm.generate(args.question, docs)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False, indent=1))
        return 0
    c = result.compression
    print(result.text)
    print()
    for number in result.citations:
        doc = docs[number - 1]
        print(f"[{number}] {doc.title or doc.id}")
    if not result.citations:
        print("(no document cited)")
    print()
    within = " (the prompt fits the budget: nothing dropped)" if c.method != "full" and c.ratio == 1.0 else ""
    print(
        f"{c.method}: kept {c.kept_tokens[0]} of {c.prompt_tokens} prompt tokens per layer{within}, KV cache "
        f"{_mib(c.kv_bytes_kept)} of {_mib(c.kv_bytes_full)}, selection {c.selection_ms:.0f} ms, prefill "
        f"{result.timings.prefill_s:.2f} s, decode {result.timings.decode_ms_per_token:.1f} ms/token"
    )
    return 0


def cmd_demo(args) -> int:
    records = [json.loads(line) for line in DEMO_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    if args.questions < 1:
        raise UsageError(f"--questions {args.questions}: must be at least 1")
    if args.questions > len(records):
        _note(f"--questions {args.questions}: the demo bundles {len(records)}; showing all of them")
    records = records[: args.questions]
    settings = _compression(args)
    if settings["budget"] != COMPRESSION_DEFAULTS["budget"]:
        _note("demo: --budget is ignored; --budgets sets the budgets shown beside the full cache")
    configs = {f"SnapKV@{b:.0%}" if isinstance(b, float) else f"SnapKV@{b}": _snapkv(b, settings) for b in args.budgets}
    llm = _engine(args, None)
    print(
        f"model {llm.model_name}; SnapKV window {settings['window']}, kernel {settings['kernel']}, "
        f"{settings['pooling']} pooling; "
        f"one shared prefill per question, then each cache decoded in turn\n"
    )
    for record in records:
        both = llm.compare(
            record["question"], record["documents"], methods={"full cache": None, **configs}, hit_rate=False
        )
        print(
            f"Q: {record['question']}\n   gold answer: {' / '.join(record['answers'])}; in document "
            f"[{record['gold_document']}] of {len(record['documents'])}"
        )
        full = both.results["full cache"]
        for name, result in both.results.items():
            c = result.compression
            speedup = full.timings.decode_ms_per_token / max(result.timings.decode_ms_per_token, 1e-9)
            print(
                f"  {name:<12} {result.text.strip()!r}\n"
                f"{'':15}kept {c.kept_tokens[0]}/{c.prompt_tokens} tokens per layer, KV cache "
                f"{_mib(c.kv_bytes_kept)} of {_mib(c.kv_bytes_full)}, decode "
                f"{result.timings.decode_ms_per_token:.1f} ms/token ({speedup:.2f}x the full cache's speed)"
            )
        print(f"  prefill (shared): {both.prefill_s:.2f} s\n")
    return 0


def cmd_serve(args) -> int:
    """``snapkv-rag serve``: the OpenAI-compatible server (:mod:`snapkv_rag.server`)."""
    key = serve_options.check(args)
    config = _config(args)
    settings = _compression(args)
    base = config or _snapkv(settings["budget"], settings)
    if args.replicas:  # each Ray Serve replica loads its own engine
        from .models.loading import DEFAULT_MODEL_NAME
        from .server import replicas

        _check_new_tokens(args)
        engine = {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "snapkv": config,
            "max_new_tokens": args.max_new_tokens,
            "max_batch": args.max_batch,
            "prefix_cache_bytes": args.prefix_cache_bytes,
            "doc_store_bytes": args.doc_store_bytes,
        }
        return replicas.run(engine, serve_options.settings(args, key, DEFAULT_MODEL_NAME, config, base), args)
    llm = _engine(
        args,
        config,
        max_batch=args.max_batch,
        prefix_cache_bytes=args.prefix_cache_bytes,
        doc_store_bytes=args.doc_store_bytes,
    )
    return serve_options.run(llm, serve_options.settings(args, key, llm.model_name, config, base), args)


def cmd_eval(argv: list[str]) -> int:
    """``snapkv-rag eval ARGS`` is ``python -m evals ARGS``: the eval suite of the source repository
    (``evals/`` beside this package), found wherever the command is run from."""
    root = Path(__file__).resolve().parents[1]
    if (root / "evals" / "__main__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from evals.__main__ import main as evals_main
    except ImportError as error:
        raise SystemExit(
            f"snapkv-rag: error: eval: the eval suite (evals/) comes with the source repository, "
            f"which this installation does not include ({error})"
        ) from error
    return evals_main(argv, prog="snapkv-rag eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snapkv-rag",
        description="Ask a question over your files with a "
        "SnapKV-compressed KV cache, or run the bundled side-by-side demo.",
    )
    common = argparse.ArgumentParser(add_help=False)
    talk = common.add_mutually_exclusive_group()
    talk.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="progress of loading and generation, and transformers' own messages",
    )
    talk.add_argument("-q", "--quiet", action="store_true", help="errors only: no notes or warnings")
    common.add_argument(
        "--model", default=None, help="model folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    common.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    common.add_argument(
        "--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on GPU, float32 on CPU)"
    )
    common.add_argument(
        "--budget",
        type=budget_value,
        default=None,
        help="prompt tokens kept per layer and KV "
        "head (512), or a share of each prompt (50%%, never below 128 tokens); default 1024 tokens",
    )
    common.add_argument(
        "--method",
        default=None,
        choices=CLI_METHODS,
        help="snapkv; docsnapkv: document-aware SnapKV (keeps the instruction and question, shares "
        "the budget between the documents by the votes they get); adasnapkv: head-adaptive SnapKV (the layer's budget "
        "shared between its heads by vote); lookahead: head-adaptive SnapKV whose votes also come from the first "
        "8 tokens of the answer, drafted over the full cache first (the best kept answers at small budgets, "
        "at most 8 more passes' cost); keynorm: the shortest keys, "
        "whatever the question; kvzip: what the model attends to when it re-reads the prompt, "
        "whatever the question (a second prefill's cost) (default snapkv)",
    )
    common.add_argument("--window", type=int, default=None, help="observation window (default 32)")
    common.add_argument(
        "--kernel", type=int, default=None, help="pooling kernel, odd (default 7; kvzip: 1, no pooling)"
    )
    common.add_argument("--pooling", default=None, choices=("max", "avg"), help="(default max)")
    common.add_argument("--full", action="store_true", help="no compression: the full cache")
    common.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default 64)")
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", parents=[common], help="answer a question over documents")
    ask.add_argument("question")
    ask.add_argument(
        "--docs",
        nargs="+",
        required=True,
        metavar="FILE_OR_DIR",
        help="JSONL (one {'text', 'title'} or string per line), JSON list, .txt/.md files, or folders",
    )
    ask.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ask.set_defaults(func=cmd_ask)
    demo = sub.add_parser("demo", parents=[common], help="a bundled NQ question: full cache and SnapKV side by side")
    demo.add_argument(
        "--budgets",
        type=budget_value,
        nargs="+",
        default=[1024, 256],
        help="SnapKV budgets to show beside the full cache (default 1024 256)",
    )
    demo.add_argument("--questions", type=int, default=1, help="how many of the bundled questions to show (default 1)")
    demo.set_defaults(func=cmd_demo)
    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="an OpenAI-compatible HTTP server (chat and completions with documents, SSE streaming, metrics)",
    )
    serve_options.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    sub.add_parser("eval", add_help=False, help="the eval suite, the same as python -m evals (snapkv-rag eval --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # every option after it belongs to the eval suite's own parser
        return cmd_eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.ERROR if args.quiet else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="snapkv-rag: %(message)s", stream=sys.stderr, force=True)
    logging.getLogger("snapkv_rag").setLevel(level)
    try:
        return args.func(args)
    except (UsageError, ValueError, TypeError) as error:
        print(f"snapkv-rag: error: {in_flag_words(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
