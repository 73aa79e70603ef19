"""Document-aware SnapKV: SnapKV's votes, shared out between the prompt's documents."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import PromptSpans, require
from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class DocSnapKVConfig(SnapKVConfig):
    """Document-aware SnapKV: SnapKV's votes, read with the prompt's structure.

    Every token outside the documents (system turn, instruction, question, the window) is kept;
    the rest of the budget is shared out between the documents in proportion to the vote mass each
    receives (averaged over the layer's heads), so a document nobody attends to can go whole and
    the one the question reads keeps more; inside its share each head keeps its own best-voted
    tokens, pooled within the document only (a cluster never spills into the next one). ``spans``
    is bound per request by the engine (:meth:`with_spans`); without spans (no documents, or a
    prompt built by hand) this is plain SnapKV with the same settings.
    """

    spans: PromptSpans | None = None

    method = "docsnapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.spans is None or isinstance(self.spans, PromptSpans),
            "spans",
            f"must be a PromptSpans or None, got {type(self.spans).__name__}",
        )

    def with_spans(self, spans: PromptSpans | None) -> DocSnapKVConfig:
        return replace(self, spans=spans)

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        return selection.doc_snapkv_select(
            query,
            keys,
            values,
            self,
            attention_mask,
            capacity=self.budget_for_layer(layer_idx, num_layers),
            shared=shared,
            **scoring,
        )
