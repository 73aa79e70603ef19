"""Your own QA data as JSON Lines: ``python -m evals --data FILE.jsonl``.

One record per line (blank lines are ignored)::

    {"id": "q1", "question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"],
     "documents": [{"title": "Hamlet", "text": "Hamlet is a tragedy by ..."}, "a document as a plain string"],
     "gold": [1]}

- ``question``: a non-empty string;
- ``answers``: a non-empty list of non-empty strings (every accepted answer);
- ``documents``: a non-empty list, each a string or an object with a ``text`` string and an
  optional ``title`` (string or null); other keys are ignored;
- ``gold`` (optional): the 1-based numbers of the documents that support the answer, each in
  1..len(documents). Without it the citation metrics of that record are left out (the summary
  says so); with it they are scored against these numbers;
- ``id`` (optional): a string or integer, unique in the file (default: the line number).

Every record is checked before any model work; the first bad one is an error naming the file, the
line and the field, or, with ``skip_bad``, every bad record is left out and counted. The dataset
is named after the file (``my_qa.jsonl`` -> ``my_qa``). ``num_docs`` (``--num-docs``) keeps the
first N documents of every record and fails clearly on a record that has fewer, or whose gold
documents all lie beyond N; without it every record keeps all of its documents. The gold
positions are the ones given (position label ``given``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .datasets import DATASETS, Example

POSITION = "given"


class DataError(ValueError):
    """A record of a --data file that breaks the schema: ``FILE:LINE: field 'x': problem``."""


@dataclass
class UserData:
    """The examples of one file, and what validation left out."""

    name: str
    path: Path
    examples: list[Example]
    skipped: list[str] = field(default_factory=list)  # one message per record left out (--skip-bad)
    without_gold: int = 0


def dataset_name(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or path.name


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _documents(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field 'documents': expected a non-empty list of strings or "
            f"{{'title', 'text'}} objects, got {_show(value)}"
        )
    docs = []
    for i, doc in enumerate(value, start=1):
        if isinstance(doc, str):
            if not doc.strip():
                raise DataError(f"{where}: field 'documents[{i}]': an empty string")
            docs.append({"title": None, "text": doc})
        elif isinstance(doc, dict):
            if not _is_text(doc.get("text")):
                raise DataError(
                    f"{where}: field 'documents[{i}].text': expected a non-empty string, got {_show(doc.get('text'))}"
                )
            title = doc.get("title")
            if title is not None and not isinstance(title, str):
                raise DataError(f"{where}: field 'documents[{i}].title': expected a string or null, got {_show(title)}")
            docs.append({"title": title, "text": doc["text"]})
        else:
            raise DataError(
                f"{where}: field 'documents[{i}]': expected a string or an object with 'text', got {_show(doc)}"
            )
    return docs


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_record(record: Any, where: str, num_docs: int | None) -> tuple[str | None, Example]:
    """One line's JSON value -> (its id or None, an Example); raises DataError naming the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'question', 'answers', 'documents', got {_show(record)}")
    if not _is_text(record.get("question")):
        raise DataError(f"{where}: field 'question': expected a non-empty string, got {_show(record.get('question'))}")
    answers = record.get("answers")
    if not isinstance(answers, list) or not answers or not all(_is_text(a) for a in answers):
        raise DataError(
            f"{where}: field 'answers': expected a non-empty list of non-empty strings, got {_show(answers)}"
        )
    docs = _documents(record.get("documents"), where)
    gold = record.get("gold")
    if gold is not None:
        if (
            not isinstance(gold, list)
            or not gold
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in gold)
        ):
            raise DataError(
                f"{where}: field 'gold': expected a non-empty list of 1-based document numbers, got {_show(gold)}"
            )
        bad = [g for g in gold if not 1 <= g <= len(docs)]
        if bad:
            raise DataError(
                f"{where}: field 'gold': {bad} outside 1..{len(docs)} (the record has {len(docs)} documents)"
            )
        gold = sorted(set(gold))
    rid = record.get("id")
    if rid is not None and not (isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid).strip()):
        raise DataError(f"{where}: field 'id': expected a non-empty string or an integer, got {_show(rid)}")
    if num_docs is not None:
        if len(docs) < num_docs:
            raise DataError(f"{where}: field 'documents': {len(docs)} documents, fewer than --num-docs {num_docs}")
        docs = docs[:num_docs]
        if gold is not None:
            if not any(g <= num_docs for g in gold):
                raise DataError(
                    f"{where}: field 'gold': every gold document {gold} lies beyond the first "
                    f"{num_docs} documents (--num-docs {num_docs})"
                )
            gold = [g for g in gold if g <= num_docs]
    question_id = None if rid is None else str(rid)
    example = Example(
        id="",
        dataset="",
        question_id=question_id or "",
        question=record["question"],
        answers=tuple(answers),
        documents=tuple(docs),
        gold=tuple(gold or ()),
        num_docs=len(docs),
        gold_position=POSITION,
    )
    return question_id, example


def load(path: str | Path, num_docs: Sequence[int] | None = None, skip_bad: bool = False) -> UserData:
    """Validate and load one file; ``num_docs`` gives the N values (each record repeated per N)."""
    path = Path(path)
    name = dataset_name(path)
    if name in DATASETS:
        raise DataError(f"--data {path}: the name {name!r} is a built-in dataset; rename the file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"--data {path}: no such file") from None
    except UnicodeDecodeError as error:
        raise DataError(f"--data {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    data = UserData(name, path, [])
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            built = [parse_record(record, where, n) for n in (num_docs or [None])]
            qid = built[0][0] or str(number)
            if qid in seen:
                raise DataError(f"{where}: field 'id': {qid!r} repeats line {seen[qid]}")
        except DataError as error:
            if not skip_bad:
                raise
            data.skipped.append(str(error))
            continue
        seen[qid] = number
        data.without_gold += not built[0][1].gold
        for _, e in built:
            data.examples.append(
                Example(
                    f"{name}-{qid}-n{e.num_docs}",
                    name,
                    qid,
                    e.question,
                    e.answers,
                    e.documents,
                    e.gold,
                    e.num_docs,
                    POSITION,
                )
            )
    if not data.examples:
        raise DataError(
            f"--data {path}: no usable records" + (f" ({len(data.skipped)} skipped as bad)" if data.skipped else "")
        )
    return data


def load_all(paths: Sequence[str | Path], num_docs: dict[str, list[int]] | None, skip_bad: bool) -> list[UserData]:
    """Every --data file; two files with the same name would mix their rows, so that is refused."""
    out: list[UserData] = []
    for p in paths:
        name = dataset_name(Path(p))
        if any(d.name == name for d in out):
            raise DataError(f"--data {p}: another file is also named {name!r}; rename one")
        out.append(load(p, (num_docs or {}).get(name), skip_bad))
    return out
