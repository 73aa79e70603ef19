"""Prompt passes that start from, or keep, less than a whole prompt's cache: a question's tail over
a stored compressed document set (:mod:`snapkv_rag.documents.store`), and a pass that keeps only the
recurrent states (KVzip's re-read on a model with recurrent layers).

A tail over a stored set runs on top of the stored kept K/V at the positions it has in the whole
prompt, and is kept whole (:func:`tail_hook`). On a model with recurrent layers (Mamba, linear
attention, short convolutions; hybrid layers) the tail starts from copies of the stored states
(:func:`with_states`). Where the model continues a state through a multi-token pass
(:func:`snapkv_rag.models.layer_kinds.state_break` is ``None``: most families from transformers 5.17) the tail
is one pass; elsewhere (Jamba, older transformers) it goes one token per step (:func:`stepwise_tail`: a
one-token step is how every model decodes from a state), the attention layers seeing the stored slots
and the tail so far.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import LinearAttentionLayer

from ..models.layer_kinds import ONE_PASS, ONE_PASS_FROM  # noqa: F401 (where the tests read them)
from .prompt_cache import LayerKV, PromptCache, PromptLayer, move_state


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


def with_states(cache: PromptCache, states: Sequence) -> PromptCache:
    """``cache`` with its recurrent layers starting from copies of ``states`` (per layer the stored
    state, ``None`` where there is none): the stored entry is shared, so it is never stepped in place."""
    for i, state in enumerate(states):
        if state is None:
            continue
        own = copy.deepcopy(state)
        if isinstance(cache.layers[i], PromptLayer):  # a hybrid layer: attention part + this state
            move_state(own, cache.layers[i])
        else:
            cache.layers[i] = own
    return cache


def stepwise_tail(
    forward: Callable, cache: PromptCache, prefix, ids: list[int], device: torch.device
) -> tuple[list, torch.Tensor]:
    """``ids[prefix.length:]`` one token per step over ``cache`` (made over ``prefix``, the stored
    layers padded, with :func:`with_states`): each step's K/V join the slots the next step sees.
    Returns the layers (the kept K/V and the tail's) and the last token's logits.
    ``forward(ids, mask, positions, cache)`` runs the model."""
    layers, logits = list(prefix.layers), None
    for at in range(prefix.length, len(ids)):
        cache.compress = hook = tail_hook(cache, layers, at, at + 1)
        logits = forward(torch.tensor([[ids[at]]], device=device), None, torch.tensor([[at]], device=device), cache)
        for i, kv in enumerate(hook.layers):
            if kv is not None:  # the next token runs over the slots so far
                layers[i] = cache.layers[i].prefix = kv
                cache.layers[i].prefix_length, cache.layers[i].done = at + 1, False
    return layers, logits


def states_after(cache: PromptCache, layers: list) -> list:
    """``layers`` (a tail's K/V per attention layer) with the recurrent states ``cache`` ends with
    (:func:`states_of`), placed by :func:`place_states`."""
    return place_states(layers, states_of(cache, cache.specs))


def place_states(layers: list, states: Sequence, copies: bool = False) -> list:
    """``layers`` (a compressed prompt's, per layer) with ``states`` in them (deep copies with
    ``copies``): a recurrent layer's state object in its place, a hybrid layer's beside its K/V."""
    for i, state in enumerate(states):
        state = copy.deepcopy(state) if copies and state is not None else state
        if isinstance(layers[i], LayerKV):
            layers[i].state = state
        elif state is not None:
            layers[i] = state
    return layers


def held_states(layers: Sequence) -> tuple:
    """Per layer the recurrent state a compressed prompt's ``layers`` hold (a hybrid layer's beside
    its K/V, a recurrent layer's object itself), ``None`` where there is none."""
    return tuple(kv.state if isinstance(kv, LayerKV) else None if kv is None else kv for kv in layers)


def capture_only(cache: PromptCache, capture) -> PromptCache:
    """``cache`` set to hand each attention layer's K/V and queries to ``capture`` (a
    :class:`~snapkv_rag.kv.prefix_cache.Capture`) and keep nothing else: a pass over a prefix alone,
    which leaves the recurrent states at its end (:func:`states_of`)."""

    def hook(layer_idx: int, query, vote_keys, scoring) -> None:
        layer = cache.layers[layer_idx]
        capture(layer_idx, query, *layer.pending)
        layer.pending, layer.done = None, True

    cache.compress = hook
    return cache


def states_of(cache: PromptCache, specs) -> tuple:
    """Per layer the state object ``cache`` ends with (a hybrid layer's moved out of its attention
    part), ``None`` for a layer without one."""
    out = []
    for spec, layer in zip(specs, cache.layers):
        if spec.state and isinstance(layer, PromptLayer):
            state = LinearAttentionLayer(number_of_states=layer.number_of_states)
            move_state(layer, state)
            out.append(state)
        else:
            out.append(layer if spec.state else None)
    return tuple(out)
