"""Documents from files and folders, for the command line: JSON Lines, JSON lists, text files.

Errors name the file and, for JSON Lines, the line; nothing is skipped without a word: a folder's
files of other kinds are returned as ``skipped`` for the caller to report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .prompts import Document

TEXT_SUFFIXES = (".txt", ".md")
DOC_SUFFIXES = (".jsonl", ".json") + TEXT_SUFFIXES


class DocumentFileError(ValueError):
    """A file or folder given as documents that cannot be read as such; the message names it."""


@dataclass
class Collected:
    documents: list[Document] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # files in given folders that are not documents


def _record(record, source: Path, where: str, number: int) -> Document:
    if isinstance(record, str):
        return Document(text=record, id=f"{source.name}:{number}")
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        title = record.get("title")
        return Document(
            text=record["text"],
            title=None if title is None else str(title),
            id=str(record.get("id", f"{source.name}:{number}")),
        )
    raise DocumentFileError(f"{source}, {where}: neither a string nor an object with a 'text' string")


def read_documents(path: Path) -> list[Document]:
    """One file: ``.jsonl`` (a document per line), ``.json`` (a list), or a text file (one document)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DocumentFileError(f"{path}: not UTF-8 text") from error
    if path.suffix == ".jsonl":
        docs = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DocumentFileError(
                    f"{path}, line {line_number}: not valid JSON ({error.msg} at column {error.colno})"
                ) from error
            docs.append(_record(record, path, f"line {line_number}", len(docs) + 1))
        return docs
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DocumentFileError(
                f"{path}, line {error.lineno}: not valid JSON ({error.msg} at column {error.colno})"
            ) from error
        if not isinstance(data, list):
            raise DocumentFileError(f"{path}: expected a JSON list of documents")
        return [_record(record, path, f"record {i}", i) for i, record in enumerate(data, start=1)]
    return [Document(text=text, title=path.stem, id=path.name)]


def collect_documents(paths: list[str]) -> Collected:
    """Files and folders, in the order given (a folder's files sorted by name)."""
    out = Collected()
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DocumentFileError(f"{raw} does not exist")
        if path.is_dir():
            entries = sorted(p for p in path.iterdir() if p.is_file())
            files = [p for p in entries if p.suffix in DOC_SUFFIXES]
            out.skipped.extend(p for p in entries if p.suffix not in DOC_SUFFIXES)
            if not files:
                raise DocumentFileError(f"the folder {raw} holds no {', '.join(DOC_SUFFIXES)} files")
        elif path.is_file():
            if path.suffix not in DOC_SUFFIXES:
                raise DocumentFileError(f"{raw} is not one of {', '.join(DOC_SUFFIXES)}")
            files = [path]
        else:
            raise DocumentFileError(f"{raw} is not a regular file or folder")
        for file in files:
            out.documents.extend(read_documents(file))
    return out
