"""The SnapKV paper's synthetic long-context tests, generated offline and deterministic for a seed.

- ``needle`` (needle in a haystack): one document of Wikipedia filler (the MuSiQue paragraph pool
  in ``evals/data``, sentences in a seeded order) with a needle sentence carrying a random
  7-digit number inserted at a depth of 0-100% of the filler; the question asks for the number.
  ``N`` is the target prompt length in tokens (the whole prompt, chat template and question
  included, at most N): filler sentences are added while the prompt still fits. The depth is the
  share of the filler's characters before the needle (0: first, 100: right before the question).
- ``lines`` (LongEval-Lines): one document of ``N`` numbered lines ``line NAME: REGISTER_CONTENT
  is <NUMBER>`` with distinct random names and numbers; the question asks for the register
  content of the line at a depth of 0-100% of the lines.

Both put the asked depth in ``gold_position`` as ``dNNN`` (``d000`` .. ``d100``) so that the
tables, and the depth x length heatmap of :mod:`evals.plots`, read it. The questions of a seed
keep their filler / lines in every cell, so cells differ only by length and depth. There is one
document per prompt, so no citation metric is scored (``gold`` is empty).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from .datasets import Example, _load_json

SYNTHETIC = ("needle", "lines")
Counter = Callable[[str, list], int]  # (question, documents) -> prompt tokens, as the engine counts them

NEEDLE = "The special magic number is {number}."
NEEDLE_QUESTION = "What is the special magic number mentioned in the document?"
LINES_QUESTION = "What is the <REGISTER_CONTENT> in line {name}?"
_ADJECTIVES = (
    "amber brave calm dusty eager fancy gentle hollow icy jolly keen lucky misty noble odd proud quiet "
    "rapid shy tidy upbeat vivid witty young zesty bold crisp damp faint grand"
).split()
_NOUNS = (
    "ant badger camel dingo eagle ferret gecko heron ibis jackal koala lemur moose newt otter panda quail "
    "raven seal tapir urchin viper walrus yak zebra bison crane dove finch goose"
).split()


def depth_label(depth: int) -> str:
    return f"d{depth:03d}"


def parse_depths(values: Sequence[str]) -> list[int]:
    try:
        depths = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--depths {','.join(values)}: expected integers 0..100") from None
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths {','.join(values)}: every depth must be 0..100 (percent)")
    return depths


def _filler_sentences(seed: str) -> list[str]:
    """Sentences of the MuSiQue paragraph pool, paragraphs in a seeded order (enough for ~100K tokens)."""
    paragraphs = [p["text"].strip() for p in _load_json("musique_train_corpus.json.gz")]
    random.Random(seed).shuffle(paragraphs)
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if s]


def _haystack(sentences: Sequence[str], needle: str, depth: int) -> str:
    total = sum(len(s) + 1 for s in sentences)
    before, at = 0, len(sentences)
    for i, s in enumerate(sentences):  # the sentence boundary closest to depth% of the characters
        if before >= depth / 100 * total:
            at = i
            break
        before += len(s) + 1
    return " ".join([*sentences[:at], needle, *sentences[at:]])


def needle_examples(
    num_questions: int, lengths: Sequence[int], depths: Sequence[int], seed: int, count: Counter
) -> list[Example]:
    out = []
    for q in range(num_questions):
        rng = random.Random(f"{seed}-needle-{q}")
        number = str(rng.randrange(1_000_000, 10_000_000))
        sentences = [s for s in _filler_sentences(f"{seed}-needle-{q}") if number not in s]
        needle = NEEDLE.format(number=number)
        for length in lengths:
            for depth in depths:
                # the most filler sentences whose prompt fits ``length`` tokens (prompt tokens grow with them)
                lo, hi = 0, min(len(sentences), length // 2)  # a sentence has >= 2 tokens
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    doc = {"title": None, "text": _haystack(sentences[:mid], needle, depth)}
                    if count(NEEDLE_QUESTION, [doc]) <= length:
                        lo = mid
                    else:
                        hi = mid - 1
                if lo == 0:
                    raise ValueError(
                        f"--num-docs needle={length}: a prompt of {length} tokens cannot hold the "
                        f"question and the needle; use a longer length"
                    )
                doc = {"title": None, "text": _haystack(sentences[:lo], needle, depth)}
                out.append(
                    Example(
                        f"needle-{q}-n{length}-{depth_label(depth)}",
                        "needle",
                        str(q),
                        NEEDLE_QUESTION,
                        (number,),
                        (doc,),
                        (),
                        length,
                        depth_label(depth),
                    )
                )
    return out


def lines_examples(num_questions: int, num_lines: Sequence[int], depths: Sequence[int], seed: int) -> list[Example]:
    names = [f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS]
    if max(num_lines) > len(names):
        raise ValueError(f"--num-docs lines={max(num_lines)}: at most {len(names)} lines")
    out = []
    for q in range(num_questions):
        rng = random.Random(f"{seed}-lines-{q}")
        chosen = rng.sample(names, max(num_lines))
        values = rng.sample(range(10_000, 50_000), max(num_lines))
        for n in num_lines:
            text = "\n".join(f"line {name}: REGISTER_CONTENT is <{value}>" for name, value in zip(chosen[:n], values))
            for depth in depths:
                k = round(depth / 100 * (n - 1))
                out.append(
                    Example(
                        f"lines-{q}-n{n}-{depth_label(depth)}",
                        "lines",
                        str(q),
                        LINES_QUESTION.format(name=chosen[k]),
                        (str(values[k]),),
                        ({"title": None, "text": text},),
                        (),
                        n,
                        depth_label(depth),
                    )
                )
    return out


def build(
    dataset: str,
    num_questions: int,
    sizes: Sequence[int],
    depths: Sequence[int],
    seed: int,
    count: Counter | None = None,
) -> list[Example]:
    """``needle`` (sizes: prompt tokens; needs ``count``) or ``lines`` (sizes: number of lines)."""
    if num_questions < 1:
        raise ValueError(f"--num-questions: must be >= 1, got {num_questions}")
    if dataset == "needle":
        if count is None:
            raise ValueError("needle: a token counter (the engine's prompt_tokens) is needed to size the haystack")
        return needle_examples(num_questions, sizes, depths, seed, count)
    if dataset == "lines":
        if any(n < 2 for n in sizes):
            raise ValueError(f"--num-docs lines: every number of lines must be >= 2, got {list(sizes)}")
        return lines_examples(num_questions, sizes, depths, seed)
    raise ValueError(f"synthetic dataset: expected one of {SYNTHETIC}, got {dataset!r}")
