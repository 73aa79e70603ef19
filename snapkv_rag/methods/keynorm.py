"""Key-norm selection (Devoto et al. 2024): query-agnostic, the keys' own norms decide."""

from __future__ import annotations

from dataclasses import dataclass

from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class KeyNormConfig(SnapKVConfig):
    """Key-norm selection (Devoto et al. 2024): query-agnostic, the prompt's own keys decide. Keys
    of small L2 norm draw the most attention in practice, so each head keeps the prefix positions
    whose keys are shortest (norms in float64, pooled with ``kernel_size`` like SnapKV's votes, so
    kept tokens come in clusters), plus the last ``window_size`` positions. No question is looked
    at: the same documents keep the same tokens whatever is asked of them, and no attention scores
    are computed (the cheapest method after StreamingLLM). Same fields as :class:`SnapKVConfig`.
    """

    method = "keynorm"
    query_agnostic = True

    @property
    def prompt_queries(self) -> int:
        return 0

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        return selection.key_norm_select(
            keys, values, self, attention_mask, capacity=self.budget_for_layer(layer_idx, num_layers), shared=shared
        )
