"""What every compression method is: one frozen, validated settings object that also does the
method's work, so that a method is one thing you can open (kvpress's presses are the model).

A method owns its settings' validation, its budget (tokens, or a share of each prompt), its
selection of one layer's K/V, and the answers to the few questions the rest of the engine asks of
it: the class attributes and properties of :class:`Method`. The runner, the caches and the stores
ask those; nothing outside :mod:`snapkv_rag.methods` looks at a method's class.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ..config import PromptSpans, require

if TYPE_CHECKING:  # settings load without torch (the command line's --help stays fast)
    import torch

DEFAULT_BUDGET = 1024
POOLINGS = ("max", "avg")


def check_budget(config, floor_name: str, floor: int) -> None:
    """The budget in tokens (``max_capacity_prompt``, default 1024) or as a share of each prompt
    (``ratio``, never below ``min_capacity_prompt``): one of the two, validated against the kept
    window (``floor_name`` = ``floor``)."""
    if config.ratio is None:
        if config.max_capacity_prompt is None:
            object.__setattr__(config, "max_capacity_prompt", DEFAULT_BUDGET)
        require(
            isinstance(config.max_capacity_prompt, int) and config.max_capacity_prompt > floor,
            "max_capacity_prompt",
            f"must be an integer larger than {floor_name}={floor}, got {config.max_capacity_prompt!r}",
        )
        return
    require(
        config.max_capacity_prompt is None,
        "ratio",
        "give max_capacity_prompt (tokens kept) or ratio (a "
        f"share of each prompt), not both; got max_capacity_prompt={config.max_capacity_prompt!r}",
    )
    require(
        isinstance(config.ratio, (int, float)) and not isinstance(config.ratio, bool) and 0 < config.ratio <= 1,
        "ratio",
        f"must be a share of the prompt in (0, 1], e.g. 0.5, got {config.ratio!r}",
    )
    require(
        isinstance(config.min_capacity_prompt, int) and config.min_capacity_prompt > floor,
        "min_capacity_prompt",
        f"must be an integer larger than {floor_name}={floor}, got {config.min_capacity_prompt!r}",
    )


def first_head(keys: torch.Tensor, values: torch.Tensor, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For a selection shared by all heads that scores positions without votes per head: any head's
    K/V will do, the first one's (multi-head latent attention's one latent)."""
    return (keys[:, :1], values[:, :1]) if shared else (keys, values)


class Method:
    """The base of every method config (the dataclasses that subclass it hold the settings).

    ``method`` is the method's name: in results, the registry, the CLI and the server."""

    method = ""
    query_agnostic = False
    """The selection never looks at the question: a compressed document set may be stored and
    asked many questions (:mod:`snapkv_rag.documents`)."""
    rereads = False
    """Its votes come from a re-read of the prompt in the same pass (KVzip): the runner appends it."""
    drafts = False
    """It votes with the queries of a drafted answer too (lookahead): the runner drafts first."""
    ragged = False
    """Heads keep different counts: a layer is padded to its widest head, empty slots masked."""
    per_row = False
    """Its selection depends on the batch's shape (seeded draws): each row of a batch selects alone."""

    @property
    def prompt_queries(self) -> int | None:
        """How many of the prompt's last queries the selection reads (``None``: all of them, so a
        prompt is never split at a cached prefix for it)."""
        return 0

    def with_spans(self, spans: PromptSpans | None):
        """This config bound to one prompt's document spans: only the document-aware method uses them;
        every other method is returned as it is."""
        return self

    def for_prompt(self, prompt_tokens: int):
        """This config with its budget in tokens for a prompt of ``prompt_tokens``: a ``ratio``
        becomes ``max(min_capacity_prompt, ceil(ratio * prompt_tokens))`` (a prompt no longer than
        that is kept whole); a budget in tokens is returned as it is."""
        if self.ratio is None:
            return self
        budget = max(self.min_capacity_prompt, math.ceil(self.ratio * prompt_tokens))
        return replace(self, max_capacity_prompt=budget, ratio=None)

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        """Prompt positions kept by layer ``layer_idx`` (per KV head; PyramidKV varies it by depth)."""
        return self.max_capacity_prompt

    def select(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_idx: int,
        num_layers: int,
        *,
        shared: bool = False,
        **scoring,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's kept ``(keys, values, kept_positions)`` (:mod:`snapkv_rag.methods.selection`'s
        shapes). ``query`` holds all prompt queries ``[B, H, L, D]``: a window method reads its end.
        ``scoring``: the layer's ``scale``, ``softcap``, ``sinks``; ``shared``: one selection for all
        heads (multi-head latent attention)."""
        raise NotImplementedError(f"{type(self).__name__}: a method selects each layer's positions")
