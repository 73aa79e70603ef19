"""``snapkv-rag``: ask a question over your files, or run the bundled side-by-side demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import SnapKVConfig
from .prompts import Document

TEXT_SUFFIXES = (".txt", ".md")
DOC_SUFFIXES = (".jsonl", ".json") + TEXT_SUFFIXES
DEMO_FILE = Path(__file__).with_name("data") / "demo.jsonl"


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def _records_to_documents(records, source: Path) -> list[Document]:
    docs = []
    for i, record in enumerate(records, start=1):
        if isinstance(record, str):
            docs.append(Document(text=record, id=f"{source.name}:{i}"))
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            title = record.get("title")
            docs.append(Document(text=record["text"], title=None if title is None else str(title),
                                 id=str(record.get("id", f"{source.name}:{i}"))))
        else:
            raise UsageError(f"{source}: record {i} is neither a string nor an object with a 'text' string")
    return docs


def read_documents(path: Path) -> list[Document]:
    """One file: ``.jsonl`` (a document per line), ``.json`` (a list), or a text file (one document)."""
    try:
        if path.suffix == ".jsonl":
            lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            try:
                return _records_to_documents([json.loads(line) for line in lines], path)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}: not valid JSON Lines ({error})") from error
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}: not valid JSON ({error})") from error
            if not isinstance(data, list):
                raise UsageError(f"{path}: expected a JSON list of documents")
            return _records_to_documents(data, path)
        return [Document(text=path.read_text(encoding="utf-8"), title=path.stem, id=path.name)]
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: not UTF-8 text") from error


def collect_documents(paths: list[str]) -> list[Document]:
    """Files and folders, in the order given (a folder's files sorted by name)."""
    docs: list[Document] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise UsageError(f"--docs: {raw} does not exist")
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DOC_SUFFIXES)
            if not files:
                raise UsageError(f"--docs: the folder {raw} holds no {', '.join(DOC_SUFFIXES)} files")
        elif path.is_file():
            if path.suffix not in DOC_SUFFIXES:
                raise UsageError(f"--docs: {raw} is not one of {', '.join(DOC_SUFFIXES)}")
            files = [path]
        else:
            raise UsageError(f"--docs: {raw} is not a regular file or folder")
        for file in files:
            docs.extend(read_documents(file))
    return docs


def _engine(args, snapkv):
    from .engine import SnapKVLLM

    return SnapKVLLM(model=args.model, device=args.device, dtype=args.dtype, snapkv=snapkv,
                     max_new_tokens=args.max_new_tokens)


def _config(args) -> SnapKVConfig | None:
    if args.full:
        return None
    try:
        return SnapKVConfig(max_capacity_prompt=args.budget, window_size=args.window, kernel_size=args.kernel,
                            pooling=args.pooling)
    except ValueError as error:
        raise UsageError(str(error)) from error


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_ask(args) -> int:
    docs = collect_documents(args.docs)
    if not args.question.strip():
        raise UsageError("question: must not be empty")
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
    print(f"{c.method}: kept {c.kept_tokens[0]} of {c.prompt_tokens} prompt tokens per layer{within}, KV cache "
          f"{_mib(c.kv_bytes_kept)} of {_mib(c.kv_bytes_full)}, selection {c.selection_ms:.0f} ms, prefill "
          f"{result.timings.prefill_s:.2f} s, decode {result.timings.decode_ms_per_token:.1f} ms/token")
    return 0


def cmd_demo(args) -> int:
    records = [json.loads(line) for line in DEMO_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        configs = {f"SnapKV@{b}": SnapKVConfig(max_capacity_prompt=b, window_size=args.window, kernel_size=args.kernel,
                                               pooling=args.pooling) for b in args.budgets}
    except ValueError as error:
        raise UsageError(str(error)) from error
    llm = _engine(args, None)
    print(f"model {llm.model_name}; SnapKV window {args.window}, kernel {args.kernel}, {args.pooling} pooling; "
          f"one shared prefill per question, then each cache decoded in turn\n")
    for record in records:
        both = llm.compare(record["question"], record["documents"], methods={"full cache": None, **configs},
                           hit_rate=False)
        print(f"Q: {record['question']}\n   gold answer: {' / '.join(record['answers'])}; in document "
              f"[{record['gold_document']}] of {len(record['documents'])}")
        full = both.results["full cache"]
        for name, result in both.results.items():
            c = result.compression
            speedup = full.timings.decode_ms_per_token / max(result.timings.decode_ms_per_token, 1e-9)
            print(f"  {name:<12} {result.text.strip()!r}\n"
                  f"{'':15}kept {c.kept_tokens[0]}/{c.prompt_tokens} tokens per layer, KV cache "
                  f"{_mib(c.kv_bytes_kept)} of {_mib(c.kv_bytes_full)}, decode "
                  f"{result.timings.decode_ms_per_token:.1f} ms/token ({speedup:.2f}x the full cache's speed)")
        print(f"  prefill (shared): {both.prefill_s:.2f} s\n")
    return 0


def cmd_eval(argv: list[str]) -> int:
    """``snapkv-rag eval ARGS`` is ``python -m evals ARGS``: the eval suite of the source repository
    (``evals/`` beside this package), found wherever the command is run from."""
    root = Path(__file__).resolve().parents[1]
    if (root / "evals" / "__main__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from evals.__main__ import main as evals_main
    except ImportError as error:
        raise SystemExit(f"snapkv-rag: error: eval: the eval suite (evals/) comes with the source repository, "
                         f"which this installation does not include ({error})") from error
    return evals_main(argv, prog="snapkv-rag eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapkv-rag", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    common.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    common.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on GPU, "
                        "float32 on CPU)")
    common.add_argument("--budget", type=int, default=1024, help="prompt tokens kept per layer and KV head "
                        "(max_capacity_prompt, default 1024)")
    common.add_argument("--window", type=int, default=32, help="observation window (default 32)")
    common.add_argument("--kernel", type=int, default=7, help="pooling kernel, odd (default 7)")
    common.add_argument("--pooling", default="max", choices=("max", "avg"))
    common.add_argument("--full", action="store_true", help="no compression: the full cache")
    common.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default 64)")
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", parents=[common], help="answer a question over documents")
    ask.add_argument("question")
    ask.add_argument("--docs", nargs="+", required=True, metavar="FILE_OR_DIR",
                     help="JSONL (one {'text', 'title'} or string per line), JSON list, .txt/.md files, or folders")
    ask.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ask.set_defaults(func=cmd_ask)
    demo = sub.add_parser("demo", parents=[common], help="a bundled NQ question: full cache and SnapKV side by side")
    demo.add_argument("--budgets", type=int, nargs="+", default=[1024, 256],
                      help="SnapKV budgets to show beside the full cache (default 1024 256)")
    demo.set_defaults(func=cmd_demo)
    sub.add_parser("eval", add_help=False, help="the eval suite, the same as python -m evals (snapkv-rag eval --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # every option after it belongs to the eval suite's own parser
        return cmd_eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, TypeError) as error:
        print(f"snapkv-rag: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
