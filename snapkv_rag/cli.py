"""The ``snapkv-rag`` command: ask a question over your files, or run the bundled side-by-side demo."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import textwrap
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path

from .methods import SnapKVConfig, method_class
from .methods import default as default_compression
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
COMPRESSION_DEFAULTS = {
    "method": default_compression.DEFAULT_COMPRESSION.method,
    "budget": default_compression.RATIO,
    "window": 32,
    "kernel": 7,
    "pooling": "max",
}
"""The engine's default compression (:mod:`snapkv_rag.methods.default`) as flag values; without
--budget the share keeps at least ``FLOOR`` tokens, as the engine's does."""
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
        quantize=args.quantize,
        kv_dtype=args.kv_dtype,
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


def _compression(args, defaults: dict = COMPRESSION_DEFAULTS) -> dict:
    """The compression flags with their ``defaults`` filled in; a note when --full makes them moot
    (not with the demo's defaults: the demo shows both caches, and says so of --full itself)."""
    given = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
    if getattr(args, "full", False) and given and defaults is COMPRESSION_DEFAULTS:
        _note("--full keeps the whole cache: " + ", ".join(f"--{n} {v}" for n, v in given.items()) + " ignored")
    return {**defaults, **given, "given": set(given)}


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
    if isinstance(budget, float) and "budget" not in settings.get("given", ()):  # the default share: its floor
        size["min_capacity_prompt"] = default_compression.FLOOR
    method = method_class(settings["method"])
    shape = {"window_size": settings["window"], "kernel_size": settings["kernel"], "pooling": settings["pooling"]}
    given = settings.get("given", ())
    if "kernel" not in given and method.kernel_size != SnapKVConfig.kernel_size:
        del shape["kernel_size"]  # the method's own default (KVzip's: no pooling), unless --kernel says otherwise
    try:
        return method(**size, **shape)
    except ValueError as error:
        raise UsageError(in_flag_words(str(error))) from error


def _default_method(settings: dict) -> SnapKVConfig:
    """The compression of ``settings`` (flags over :data:`COMPRESSION_DEFAULTS`); without --method, the
    default method with the default's own settings (its drafted tokens), so that no flag at all gives
    exactly the engine's default (:data:`snapkv_rag.methods.DEFAULT_COMPRESSION`)."""
    config = _snapkv(settings["budget"], settings)
    default = default_compression.DEFAULT_COMPRESSION
    if "method" in settings["given"] or type(config) is not type(default):
        return config
    plain, flags = type(default)(), {"max_capacity_prompt", "ratio", "min_capacity_prompt", "window_size"}
    own = {
        f.name: getattr(default, f.name)
        for f in dataclass_fields(default)
        if f.name not in flags | {"kernel_size", "pooling"} and getattr(default, f.name) != getattr(plain, f.name)
    }
    return replace(config, **own)


def _config(args) -> SnapKVConfig | None:
    settings = _compression(args)
    return None if args.full else _default_method(settings)


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


DEMO_DEFAULTS = {**COMPRESSION_DEFAULTS, "method": "lookahead", "budget": 0.5}
"""The demo's cache: lookahead SnapKV keeping 50% of the prompt. In the project's evals on the
embedded model it kept the full cache's answer most often of every method at 50% (0.81 of 300
NQ / HotpotQA prompts, SnapKV 0.66; 0.81 of 200 NQ prompts of 10 and 20 passages, SnapKV 0.73:
docs/methods.md, "Choosing a method"), with SnapKV's bytes at the same budget. At 25% it kept 0.55 (SnapKV
0.39): too few for a demo's default."""
DEMO_DOCS = 20
"""Passages per prompt by default: 2,100 to 2,900 tokens for the bundled questions, as the evals' NQ N=20 prompts."""
DEMO_WHY = (
    "in the project's evals on the embedded model it kept the full cache's answer on 0.81 of 300 NQ / HotpotQA "
    'prompts, the most of any method (SnapKV at 50%: 0.66; docs/methods.md, "Choosing a method")'
)
DEMO_EVAL = "snapkv-rag eval --num-docs 20 --gold-positions middle --methods lookahead,snapkv --budgets 25%,50%,75%"
"""The eval run (a source checkout) whose ``plots/fidelity_vs_bytes.png`` is the quality-vs-kept-bytes curve
of prompts like the demo's: 20 NQ questions at 20 passages, the gold one in the middle."""


def demo_records() -> list[dict]:
    """The bundled questions (``data/demo.jsonl``, see ``data/README.md``): each with its ``gold``
    passage and 29 BM25-ranked ``distractors``."""
    return [json.loads(line) for line in DEMO_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]


def demo_documents(record: dict, n: int) -> tuple[list[dict], int]:
    """The prompt's ``n`` passages, the gold one in the middle (slot ``n // 2``) of the first ``n - 1``
    distractors (the evals' NQ prompt for N = n, gold "middle"), and the gold one's 1-based number."""
    docs = [{"title": d["title"], "text": d["text"]} for d in record["distractors"][: n - 1]]
    docs.insert(n // 2, {"title": record["gold"]["title"], "text": record["gold"]["text"]})
    return docs, n // 2 + 1


def _normalised(text: str) -> str:
    """SQuAD normalisation (the evals' best-subspan EM): lower case, no punctuation, no articles."""
    text = re.sub(r"\b(a|an|the)\b", " ", re.sub(r"[^\w\s]|_", "", text.lower()))
    return f" {' '.join(text.split())} "


def _answers(record: dict) -> list[str]:
    """The accepted answers that the question itself does not contain ("$72" in "a 72 oz steak")."""
    return [a for a in record["answers"] if _normalised(a) not in _normalised(record["question"])]


def _demo_questions(args, records: list[dict]) -> list[dict]:
    """The bundled questions ``--question`` / ``--questions`` ask for; a usage error naming the flag."""
    if args.question is not None:
        wanted = " ".join(args.question.lower().split())
        found = [r for r in records if wanted and wanted in r["question"].lower()]
        if len(found) != 1:
            listed = "; ".join(repr(r["question"]) for r in (found or records))
            why = "matches several bundled questions" if found else "matches none of the bundled questions"
            raise UsageError(
                f"--question {args.question!r}: {why} ({listed}); give part of one of them, or ask your own "
                f"question over your own files with snapkv-rag ask QUESTION --docs FILES"
            )
        return found
    if args.questions < 1:
        raise UsageError(f"--questions {args.questions}: must be at least 1")
    if args.questions > len(records):
        _note(f"--questions {args.questions}: the demo bundles {len(records)}; showing all of them")
    return records[: args.questions]


def _say(text: str, indent: str = "") -> None:
    """A paragraph of the demo's output, wrapped to 100 columns."""
    print(textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False))


def _ratio(value: float, full: float) -> str:
    return f"{value / full:.2f}x" if full > 0 else "-"


def _kept(kept: list[int]) -> str:
    """Prompt positions kept per layer: one number where every layer keeps as many, else the range."""
    low, high = min(kept, default=0), max(kept, default=0)
    return f"{low:,}" if low == high else f"{low:,}-{high:,} (mean {sum(kept) / len(kept):,.0f})"


def _demo_answer(name: str, result, record: dict, docs: list[dict], full_text: str | None) -> None:
    """One cache's answer, what it holds (an accepted answer; the full cache's answer or not) and what it cites."""
    notes = (
        ["right: holds an accepted answer"]
        if any(_normalised(a) in _normalised(result.text) for a in _answers(record))
        else ["holds no accepted answer"]
    )
    if full_text is not None:
        notes.append("the same as the full cache's" if result.text == full_text else "differs from the full cache's")
    print(f"  {name:<15}{result.text.strip()!r}")
    print(f"  {'':<15}({'; '.join(notes)})")
    cited = ", ".join(f"[{n}] {docs[n - 1]['title']}" for n in result.citations) or "no passage"
    print(f"  {'':<15}cites: {cited}")


def _demo_table(names: tuple[str, str], full, compressed) -> None:
    f, c = full.compression, compressed.compression
    ft, ct = full.timings, compressed.timings
    mean = sum(c.kept_tokens) / max(len(c.kept_tokens), 1)
    rows = [
        ("", names[0], names[1], "ratio"),
        ("kept tokens per layer", _kept(f.kept_tokens), _kept(c.kept_tokens), _ratio(mean, f.prompt_tokens)),
        ("KV cache", _mib(f.kv_bytes_kept), _mib(c.kv_bytes_kept), _ratio(c.kv_bytes_kept, f.kv_bytes_kept)),
        (
            "decode",
            f"{ft.decode_ms_per_token:.1f} ms/token",
            f"{ct.decode_ms_per_token:.1f} ms/token",
            _ratio(ct.decode_ms_per_token, ft.decode_ms_per_token),
        ),
        ("time to first token", f"{ft.prefill_s:.2f} s", f"{ct.prefill_s:.2f} s", _ratio(ct.prefill_s, ft.prefill_s)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    within = " The prompt fits the budget: nothing was dropped." if c.ratio == 1.0 else ""
    _say(
        f"(time to first token: the prefill; {names[1]}'s includes the {c.selection_ms / 1000:.2f} s it took "
        f"to choose what to keep.{within})",
        indent="  ",
    )


def cmd_demo(args) -> int:
    """``snapkv-rag demo``: a bundled Natural Questions question over 20 retrieved passages (2,100
    to 2,900 tokens), answered from the full KV cache and from a compressed one, each in its own
    ``generate`` call (so neither shares the other's prefill, and the prefix cache is off), with
    what each cache costs: prompt positions kept per layer, KV cache MiB, decode ms/token and time
    to first token, the compressed cache's figures also as ratios to the full cache's.

    The compressed cache is lookahead SnapKV at 50% of the prompt by default (:data:`DEMO_DEFAULTS`:
    the method and budget the project's evals show keep the embedded model's answers most often).
    Every figure is measured on this machine as it runs. On a CPU the model's weights dominate a
    decode step, so the KV memory ratio is the headline; the speed gains show on a GPU (docs/benchmarks.md,
    "Performance")."""
    records = demo_records()
    most = min(len(r["distractors"]) + 1 for r in records)
    if not 2 <= args.docs <= most:
        raise UsageError(
            f"--docs {args.docs}: the demo bundles {most} passages per question (the gold one and "
            f"{most - 1} others); give 2 to {most}"
        )
    chosen = _demo_questions(args, records)
    if args.full:
        _note("--full: the demo always shows the full cache beside the compressed one; ignored")
    settings = _compression(args, DEMO_DEFAULTS)
    config = _snapkv(settings["budget"], settings)
    budget = f"{settings['budget']:.0%}" if isinstance(settings["budget"], float) else str(settings["budget"])
    name = f"{settings['method']}@{budget}"
    llm = _engine(args, config, prefix_cache_bytes=0)  # each cache pays for its own prefill
    import torch

    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    threads = torch.get_num_threads()
    threads = f", {threads} thread{'s' if threads > 1 else ''}" if llm.device.type == "cpu" else ""
    _say(
        f"{llm.model_name} ({weights / 1e6:,.0f} MB of {str(llm.model.dtype).removeprefix('torch.')} weights) "
        f"on {llm.device}{threads}: the full KV cache against {name}, every figure measured here as it runs."
    )
    if not settings["given"] and args.model is None:
        _say(f"Why {name}: {DEMO_WHY}.")
    for record in chosen:
        _demo_question(llm, record, args.docs, config, name)
    if llm.device.type == "cpu":
        print()
        _say(
            f"On this CPU each decode step reads all {weights / 1e6:,.0f} MB of weights whatever the cache holds, "
            f"so the KV memory ratio is the headline here; the speed gains show on a GPU and with longer prompts: "
            f'docs/benchmarks.md, "Performance".'
        )
    else:
        print('\nHow the gains grow with the prompt, on a GPU: docs/benchmarks.md, "Performance".')
    print(f"Quality against kept bytes, in plots/fidelity_vs_bytes.png (docs/evals.md): {DEMO_EVAL}")
    return 0


def _demo_question(llm, record: dict, num_docs: int, config, name: str) -> None:
    """One bundled question over ``num_docs`` passages: its prompt, then the full cache's answer and
    the compressed one's, each from its own ``generate`` call, and the table of what each cost."""
    docs, gold = demo_documents(record, num_docs)
    prompt = llm.prompt_tokens(record["question"], docs)
    print(f"\nQ: {record['question']}")
    _say(
        f"{len(docs)} retrieved NQ passages, {prompt:,} prompt tokens; the gold passage is [{gold}] "
        f"{record['gold']['title']}; accepted answers: {' / '.join(record['answers'])}",
        indent="   ",
    )
    full = llm.generate(record["question"], docs, snapkv=False, stop=["\n"])
    compressed = llm.generate(record["question"], docs, snapkv=config, stop=["\n"])
    _demo_answer("full cache", full, record, docs, None)
    _demo_answer(name, compressed, record, docs, full.text)
    print()
    _demo_table(("full cache", name), full, compressed)


def cmd_serve(args) -> int:
    """``snapkv-rag serve``: the OpenAI-compatible server (:mod:`snapkv_rag.server`)."""
    key = serve_options.check(args)
    config = _config(args)
    settings = _compression(args)
    base = config or _default_method(settings)
    if args.replicas:  # each Ray Serve replica loads its own engine
        from .models.loading import DEFAULT_MODEL_NAME
        from .server import replicas

        _check_new_tokens(args)
        engine = {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "quantize": args.quantize,
            "kv_dtype": args.kv_dtype,
            "snapkv": config,
            "max_new_tokens": args.max_new_tokens,
            "max_batch": args.max_batch,
            "prefix_cache_bytes": args.prefix_cache_bytes,
            "doc_store_bytes": args.doc_store_bytes,
            "doc_store_dir": args.doc_store_dir,
            "doc_store_disk_bytes": args.doc_store_disk_bytes,
        }
        return replicas.run(engine, serve_options.settings(args, key, DEFAULT_MODEL_NAME, config, base), args)
    llm = _engine(
        args,
        config,
        max_batch=args.max_batch,
        prefix_cache_bytes=args.prefix_cache_bytes,
        doc_store_bytes=args.doc_store_bytes,
        doc_store_dir=args.doc_store_dir,
        doc_store_disk_bytes=args.doc_store_disk_bytes,
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


DEFAULT_HELP = (
    f"{default_compression.RATIO:.0%} of each prompt, never below {default_compression.FLOOR} tokens".replace(
        "%", "%%"
    ),
    f"{default_compression.DEFAULT_COMPRESSION.method}, drafting {default_compression.DRAFTED} tokens: of the "
    "methods within about 1.25x SnapKV's time to the cache, the one the evals show keeps the full cache's answers "
    "most often per byte",
)


def _common_options(
    budget_default: str = DEFAULT_HELP[0], method_default: str = DEFAULT_HELP[1]
) -> argparse.ArgumentParser:
    """The options every command but eval takes, their help naming that command's defaults: the
    model's under "model", the cache's under "compression" in ``--help``."""
    common = argparse.ArgumentParser(add_help=False)
    _model_options(common.add_argument_group("model"))
    _compression_options(common.add_argument_group("compression"), budget_default, method_default)
    return common


def _model_options(group) -> None:
    """What runs: the messages shown, the model, its device, dtype and quantization, the kept cache's dtype."""
    talk = group.add_mutually_exclusive_group()
    talk.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="progress of loading and generation, and transformers' own messages",
    )
    talk.add_argument("-q", "--quiet", action="store_true", help="errors only: no notes or warnings")
    group.add_argument(
        "--model", default=None, help="model folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    group.add_argument(
        "--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on GPU, float32 on CPU)"
    )
    group.add_argument(
        "--quantize",
        default=None,
        choices=("int8", "int4"),
        help="quantize the model's linear layers after loading: int8 (the fastest on a CPU) or int4 "
        "(the smallest); default: as loaded",
    )
    group.add_argument(
        "--kv-dtype",
        default=None,
        choices=("int8", "fp8"),
        help="keep the compressed cache in 8 bits after selection: int8 (one scale per token, head and 32 channels) or "
        "fp8 (CUDA only); default: the model's dtype",
    )


def _compression_options(group, budget_default: str, method_default: str) -> None:
    """How the prompt's cache is compressed, and how long the answer may be."""
    group.add_argument(
        "--budget",
        type=budget_value,
        default=None,
        help="prompt tokens kept per layer and KV "
        f"head (512), or a share of each prompt (50%%, never below 128 tokens); default {budget_default}",
    )
    group.add_argument(
        "--method",
        default=None,
        choices=CLI_METHODS,
        help="snapkv; docsnapkv: document-aware SnapKV (keeps the instruction and question, shares "
        "the budget between the documents by the votes they get); adasnapkv: head-adaptive SnapKV (the layer's budget "
        "shared between its heads by vote, no head above the budget); lookahead: SnapKV whose votes also come from "
        "the first 8 tokens of the answer, drafted over the full cache first (SnapKV's bytes, the most full-cache "
        "answers kept per byte, at most 8 more passes' cost); keynorm: the shortest keys, "
        "whatever the question; kvzip: what the model attends to when it re-reads the prompt, "
        f"whatever the question (a second prefill's cost) (default {method_default})",
    )
    group.add_argument("--window", type=int, default=None, help="observation window (default 32)")
    group.add_argument("--kernel", type=int, default=None, help="pooling kernel, odd (default 7; kvzip: 1, no pooling)")
    group.add_argument("--pooling", default=None, choices=("max", "avg"), help="(default max)")
    group.add_argument("--full", action="store_true", help="no compression: the full cache")
    group.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default 64)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snapkv-rag",
        description="Ask a question over your files with a "
        "SnapKV-compressed KV cache, or run the bundled side-by-side demo.",
    )
    common = _common_options()
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
    demo = sub.add_parser(
        "demo",
        parents=[_common_options("50%%", "lookahead: the method the evals show keeps the full answers most often")],
        help="a bundled NQ question over 20 retrieved passages: the full KV cache against lookahead SnapKV "
        "at 50%%, answers and costs side by side",
        description="A bundled Natural Questions question over retrieved Wikipedia passages (the gold one in "
        "the middle), answered from the full KV cache and from a compressed one, each in its own call, with "
        "what each cache costs: prompt tokens kept per layer, KV cache MiB, decode ms/token and time to first "
        "token (the compressed cache's selection included), and the compressed figures as ratios to the full "
        f"cache's, all measured on this machine. The default compression is lookahead SnapKV at 50% of the "
        f"prompt: {DEMO_WHY}. On a CPU the "
        "weights dominate each decode step, so the memory ratio is the headline; the speed gains show on a "
        'GPU (docs/benchmarks.md, "Performance"). Answers stop at the first newline, as in the evals.',
    )
    demo.add_argument(
        "--docs",
        type=int,
        default=DEMO_DOCS,
        metavar="N",
        help=f"retrieved passages per prompt, 2 to 30 (default {DEMO_DOCS}: 2,100 to 2,900 tokens; 30: 3,100 to 5,500)",
    )
    which = demo.add_mutually_exclusive_group()
    which.add_argument(
        "--question",
        metavar="TEXT",
        help="the bundled question whose text contains TEXT (any case; the demo's passages were retrieved "
        "for its questions: ask your own over your files with snapkv-rag ask)",
    )
    which.add_argument(
        "--questions", type=int, default=1, metavar="K", help="the first K bundled questions (default 1)"
    )
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
