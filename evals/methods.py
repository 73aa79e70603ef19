"""Method specs -> compression configs, with budgets fixed per cell.

A spec is ``full`` or ``KIND@BUDGET`` with KIND one of :func:`kinds` and BUDGET an absolute token
count (``512``) or a share of the prompt (``25%``). KIND may carry settings of its method as
``/FIELD=VALUE`` (``lookahead/lookahead=4@50%``: 4 drafted tokens; numbers are read as numbers). A ratio is turned into ONE integer budget per
(dataset, N, gold position) cell: ``round(ratio * mean prompt tokens of the cell's examples)``, so
every prompt of a cell is compressed to the same size and the cells stay comparable to each other
(a per-prompt ratio would give longer prompts bigger caches). Budgets count the kept positions per
layer, window included; a budget at or below the observation/recent window is raised to just
above it, with a warning in the row's ``budget_note``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from snapkv_rag.methods import METHODS

RENAMED = {"streamingllm": "streaming"}
"""Methods whose rows carry another name than the registry's (the committed results say ``streaming``)."""
WINDOW = 32  # SnapKV's observation window and the recent window of H2O / random (the engine defaults)


def kinds() -> dict[str, Any]:
    """Every method the evals can run, by the name their rows use: each registered method
    (:data:`snapkv_rag.methods.METHODS`, so a method added there runs here too), StreamingLLM as
    ``streaming``."""
    return {RENAMED.get(name, name): cls for name, cls in METHODS.items()}


@dataclass(frozen=True)
class MethodSpec:
    """A parsed spec: ``kind`` (``full`` or a key of :func:`kinds`), and an absolute or relative budget."""

    name: str
    kind: str
    tokens: int | None = None
    ratio: float | None = None
    settings: tuple[tuple[str, Any], ...] = ()

    def budget(self, mean_prompt_tokens: float) -> int | None:
        if self.kind == "full":
            return None
        if self.tokens is not None:
            return self.tokens
        return int(round(self.ratio * mean_prompt_tokens))

    def config(self, budget: int) -> Any:
        return kinds()[self.kind](max_capacity_prompt=max(budget, WINDOW + 1), **dict(self.settings))


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _settings(spec: str, kind: str, parts: list[str]) -> tuple[tuple[str, Any], ...]:
    """``FIELD=VALUE`` parts of a spec's KIND, checked against the method's fields."""
    from dataclasses import fields

    names = {f.name for f in fields(kinds()[kind])} - {"max_capacity_prompt", "ratio"}
    out = []
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or name not in names:
            raise ValueError(f"method {spec!r}: {part!r} is not FIELD=VALUE with FIELD one of {sorted(names)}")
        out.append((name, _value(value)))
    return tuple(out)


def parse_spec(spec: str) -> MethodSpec:
    spec = spec.strip()
    if spec == "full":
        return MethodSpec("full", "full")
    head, sep, budget = spec.partition("@")
    kind, *parts = head.split("/")
    if kind not in kinds() or not sep or not budget:
        raise ValueError(
            f"method {spec!r}: expected 'full' or KIND@BUDGET with KIND in {sorted(kinds())} and BUDGET "
            f"a token count (512) or a share of the prompt (25%)"
        )
    settings = _settings(spec, kind, parts)
    try:
        if budget.endswith("%"):
            ratio = float(budget[:-1]) / 100
            if not 0 < ratio < 1:
                raise ValueError
            return MethodSpec(f"{head}@{budget}", kind, ratio=ratio, settings=settings)
        tokens = int(budget)
        if tokens <= WINDOW:
            raise ValueError
        return MethodSpec(f"{head}@{tokens}", kind, tokens=tokens, settings=settings)
    except ValueError:
        raise ValueError(
            f"method {spec!r}: the budget must be a percentage in (0%, 100%) or an integer > {WINDOW}"
        ) from None


def expand(methods: Sequence[str], budgets: Sequence[str]) -> list[MethodSpec]:
    """``full`` plus every spec; a bare KIND gets each of ``budgets``. ``full`` is always included:
    it is the fidelity reference and the engine decodes it anyway."""
    specs = [MethodSpec("full", "full")]
    for item in methods:
        item = item.strip()
        if not item or item == "full":
            continue
        names = [item] if "@" in item else [f"{item}@{b.strip()}" for b in budgets]
        if "@" not in item and not budgets:
            raise ValueError(f"method {item!r} has no budget: write {item}@25% or give --budgets")
        for name in names:
            spec = parse_spec(name)
            if spec.name not in {s.name for s in specs}:
                specs.append(spec)
    return specs


def configs_for_cell(specs: Sequence[MethodSpec], mean_prompt_tokens: float) -> tuple[dict[str, Any], dict[str, int]]:
    """The ``methods`` mapping for ``compare()`` and each method's integer budget in this cell."""
    configs, budgets = {}, {}
    for spec in specs:
        budget = spec.budget(mean_prompt_tokens)
        configs[spec.name] = None if budget is None else spec.config(budget)
        if budget is not None:
            budgets[spec.name] = configs[spec.name].max_capacity_prompt
    return configs, budgets
