"""Prompt passes that start from, or keep, less than a whole prompt's cache: a question's tail over
a stored compressed document set (:mod:`snapkv_rag.doc_store`), and a pass that keeps only the
recurrent states (KVzip's re-read on a model with recurrent layers).

A tail over a stored set runs on top of the stored kept K/V at the positions it has in the whole
prompt, and is kept whole (:func:`tail_hook`). On a model with recurrent layers (Mamba, linear
attention, short convolutions; hybrid layers) the tail goes one token at a time
(:func:`stepwise_tail`): transformers continues a stored conv / SSM state only in a one-token step
(its multi-token path starts the state afresh), so each tail token is such a step, from a copy of
the stored states; the attention layers see the stored slots and the tail so far, as in one pass.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from transformers.cache_utils import LinearAttentionLayer

from .cache import LayerKV, PromptCache, PromptLayer, move_state


def tail_hook(cache, layers: Sequence[LayerKV | None], length: int, total: int):
    """The prompt cache's hook while a tail runs over a stored prefix of ``length`` tokens (its
    ``layers``, padded): each layer's K/V (the kept ones, then the tail's) with their positions (the
    kept ones, then the tail's ``length .. total``), kept whole. ``hook.layers`` is filled as the
    layers run."""

    def hook(layer_idx: int, query, vote_keys, scoring) -> None:
        layer = cache.layers[layer_idx]
        keys, values = layer.pending
        stored = layers[layer_idx].positions
        tail = torch.arange(length, total, device=stored.device).expand(1, stored.shape[1], -1)
        hook.layers[layer_idx] = LayerKV(keys, values, torch.cat([stored, tail], dim=-1))
        layer.pending, layer.done = None, True

    hook.layers = [None] * len(layers)
    return hook


def states_only(cache: PromptCache) -> PromptCache:
    """``cache`` set to keep nothing of its attention layers' K/V (each let go after its attention):
    a pass with it leaves only the recurrent states, at the end of what it ran."""

    def drop(layer_idx: int, *_) -> None:
        layer = cache.layers[layer_idx]
        layer.pending, layer.done = None, True

    cache.compress = drop
    return cache


def stepwise_tail(forward: Callable, cache: PromptCache, prefix, states: Sequence, ids: list[int],
                  device: torch.device) -> tuple[list, torch.Tensor]:
    """``ids[prefix.length:]`` one token per step over ``cache`` (made over ``prefix``, the stored
    layers padded), its recurrent layers starting from copies of ``states`` (per layer: the stored
    state, ``None`` where there is none). Returns the layers a :class:`~snapkv_rag.cache.Compressed`
    holds (kept K/V and the tail's; recurrent layers' state objects; a hybrid layer's state beside
    its K/V) and the last token's logits. ``forward(ids, mask, positions, cache)`` runs the model."""
    for i, state in enumerate(states):
        if state is None:
            continue
        own = copy.deepcopy(state)  # the stored entry is shared: never stepped in place
        if isinstance(cache.layers[i], PromptLayer):  # a hybrid layer: attention part + this state
            move_state(own, cache.layers[i])
        else:
            cache.layers[i] = own
    layers, logits = list(prefix.layers), None
    for at in range(prefix.length, len(ids)):
        cache.compress = hook = tail_hook(cache, layers, at, at + 1)
        logits = forward(torch.tensor([[ids[at]]], device=device), None, torch.tensor([[at]], device=device), cache)
        for i, kv in enumerate(hook.layers):
            if kv is not None:  # the next token runs over the slots so far
                layers[i] = cache.layers[i].prefix = kv
                cache.layers[i].prefix_length, cache.layers[i].done = at + 1, False
    for i, state in enumerate(states):
        if state is not None and isinstance(cache.layers[i], PromptLayer):
            layers[i].state = LinearAttentionLayer(number_of_states=cache.layers[i].number_of_states)
            move_state(cache.layers[i], layers[i].state)
        elif state is not None:
            layers[i] = cache.layers[i]
    return layers, logits
