"""An independent SnapKV, written from its paper, to check the engine's selection against: an attention
function that records each call's queries and keys (:class:`Capture`), the selection from them
(:func:`reference_positions`) and the whole check of a compressed cache against a model's own full
cache (:func:`assert_kept_kv_are_an_independent_selection`). Used by the family matrix and by the
quantized-model tests (a unique module name: other test folders have a conftest)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class Capture:
    """This test's own attention function: records each attention call's query, key and scoring
    kwargs in call order, then attends as the engine's base implementation does (so later layers
    see the same inputs). Calls are matched to layers afterwards by :meth:`by_layer` (an attention
    module shared by several layers, as Zamba's, has no layer index of its own)."""

    def __init__(self, base: str):
        self.calls: list[tuple] = []
        self.base = base

    def by_layer(self, cache: DynamicCache) -> dict[int, tuple]:
        """The calls keyed by the layers whose K/V transformers' own ``cache`` holds, in layer order."""
        holding = [i for i, layer in enumerate(cache.layers) if getattr(layer, "keys", None) is not None]
        assert len(holding) == len(self.calls)
        return dict(zip(holding, self.calls))

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append(
            (
                query.detach().clone(),
                key.detach().clone(),
                kwargs.get("scaling"),
                kwargs.get("softcap"),
                kwargs.get("s_aux"),
            )
        )
        if self.base == "eager":
            import sys

            return sys.modules[type(module).__module__].eager_attention_forward(
                module, query, key, value, attention_mask, **kwargs
            )
        return ALL_ATTENTION_FUNCTIONS[self.base](module, query, key, value, attention_mask, **kwargs)


def reference_positions(query, key, scale, softcap, sinks, budget: int, window: int, shared: bool) -> torch.Tensor:
    """SnapKV over ``key`` ``[1, H_kv, n, D]`` voted by the last ``window`` queries ``[1, H, n, D]``."""
    n = key.shape[-2]
    if n <= budget:
        return torch.arange(n).expand(1, 1 if shared else key.shape[1], n)
    heads, kv_heads = query.shape[1], key.shape[1]
    keys = key.float().repeat_interleave(heads // kv_heads, dim=1)
    logits = query[..., -window:, :].float() @ keys.transpose(-1, -2) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    causal = torch.arange(n)[None, :] <= torch.arange(n - window, n)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().view(1, heads, 1, 1).expand(1, heads, window, 1)], dim=-1)
    weights = logits.softmax(dim=-1)[..., :n].sum(dim=-2)  # [1, H, n]
    groups = heads if shared else heads // kv_heads
    votes = weights.view(1, heads // groups, groups, n).mean(dim=2)[..., : n - window]
    pooled = F.max_pool1d(votes, 7, stride=1, padding=3)
    chosen = []
    for head in range(pooled.shape[1]):
        ranked = sorted(range(n - window), key=lambda p: (-pooled[0, head, p].item(), p))
        chosen.append(sorted(ranked[: budget - window] + list(range(n - window, n))))
    return torch.tensor([chosen])


def assert_kept_kv_are_an_independent_selection(llm, ids: list[int], budget) -> None:
    """The engine's compressed cache of prompt ``ids`` under SnapKV ``budget``, layer by layer: the
    positions :func:`reference_positions` selects from the queries and keys this module's own
    attention function captured in one full forward of ``llm.model``, and exactly the K/V transformers
    itself caches there. Closes ``llm`` (its attention is switched back for the capture)."""
    model = llm.model
    length = len(ids)
    capture, dyn = Capture(llm.attn_implementation), DynamicCache(config=model.config)
    AttentionInterface.register("family_capture", capture)
    ALL_MASK_ATTENTION_FUNCTIONS.register("family_capture", ALL_MASK_ATTENTION_FUNCTIONS[llm.attn_implementation])
    model.set_attn_implementation("family_capture")
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]), **{llm.runner.cache_kwarg: dyn}, use_cache=True)
    finally:
        llm.close()
    kept_cache = llm.runner.prefill([ids], {"snap": budget}).compressed["snap"][0]
    calls = capture.by_layer(dyn)
    checked = 0
    for i, layer in enumerate(kept_cache.layers):
        if i not in calls:  # a recurrent / conv or MLP-only layer: passed through
            assert not hasattr(layer, "positions")
            continue
        query, key, scale, softcap, sinks = calls[i]
        full_k, full_v = dyn.layers[i].keys, dyn.layers[i].values  # what transformers caches
        share = full_k.shape[-2]
        start = length - share
        shared = key.shape[1] != full_k.shape[1]  # a latent shared by all heads (DeepSeek-V3)
        expected = (
            reference_positions(
                query[..., start:, :],
                key[..., start:, :],
                scale,
                softcap,
                sinks,
                budget.max_capacity_prompt,
                budget.window_size,
                shared,
            )
            + start
        )
        if shared:
            expected = expected.expand(1, full_k.shape[1], -1)
        kept = layer.positions
        assert torch.equal(kept, expected), f"layer {i}"
        index = (kept - start)[..., None]
        assert torch.equal(layer.keys, full_k.gather(2, index.expand(-1, -1, -1, full_k.shape[-1])))
        assert torch.equal(layer.values, full_v.gather(2, index.expand(-1, -1, -1, full_v.shape[-1])))
        checked += 1
    assert checked >= 1
    if isinstance(dyn.layers[0], DynamicSlidingWindowLayer):  # the sliding share is never exceeded
        assert kept_cache.layers[0].slots <= dyn.layers[0].sliding_window - 1
