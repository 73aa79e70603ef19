"""Per-document reuse at any position (opt-in): each document's K/V is computed once, alone, and
stitched into any prompt that holds the document, wherever it sits there.

    handle = llm.reuse_documents(docs, recompute=0.15)   # docs in this prompt's order
    handle.warm()                                        # optional: compute the missing documents now
    result = handle.generate("Who wrote it?")            # the same as llm.generate(q, handle)

A document's cache is its block (``[n] Title: ...`` and text) prefilled right after the prompt's
opening (chat template, ``Documents:``), as if it were the first and only document, and kept in a
byte-bounded LRU keyed by model, tokenizer, opening and document. A prompt over a handle then:

1. takes, per document block, the stored K/V of the tokens its block shares with the stored one
   (the longest common suffix: the ``[n]`` label differs by position) and re-rotates their keys to
   the block's positions in this prompt (RoPE is a rotation per position, so a key at position
   ``p`` moves to ``p + d`` by a rotation of ``d``: :func:`rotate_keys`);
2. CacheBlend-style (Yao et al. 2024), runs the model's first layer over the whole prompt and
   compares the second layer's fresh values with the stitched ones: the ``recompute`` share of
   reused tokens that deviate most is recomputed with the rest of the prompt
   (:func:`most_deviating`);
3. prefills the tokens no document covers (opening, labels, instruction, question) together with
   the recomputed ones, over the stitched K/V, each attending to every position before its own.

The cache decodes whole (no SnapKV selection): what a document saw when it was computed alone is
not what it sees in the prompt, so the answers can differ from a full prefill's; ``evals.stitch``
measures by how much. Under an 8-bit ``kv_dtype`` the per-document caches stay in full precision
(they are rotated and prefilled over, not decoded from); the stitched prompt's cache is quantized
once it is built, as any kept cache is (``Runner.prefill_stored``). Full-attention RoPE models only (default, linear or llama3 RoPE, rotary over
the whole head); anything else is refused with the reason.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..kv.lru import ByteLRU
from ..kv.prompt_cache import Compressed, LayerKV
from ..request.prompts import DocumentLike, to_documents
from .store import PLACEHOLDER, DocumentHandle, unsupported
from .stored import identity

DEFAULT_BYTES = 1 << 30
ROTATIONS = ("default", "linear", "llama3")
"""RoPE types whose rotation of a position does not depend on the sequence: a key can be moved."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[1, H, n, D]`` (already rotated to their positions) moved by the rotation whose
    ``cos``/``sin`` ``[D]`` are those of the shift: ``R(p + d) k = R(d) R(p) k``."""
    out = keys.float() * cos.float() + rotate_half(keys.float()) * sin.float()
    return out.to(keys.dtype)


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many last tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def most_deviating(fresh: torch.Tensor, reused: torch.Tensor, share: float) -> torch.Tensor:
    """Indices (into the reused tokens) of the ``ceil(share x n)`` whose values ``[1, H, n, D]``
    differ most between a fresh computation and the stitched one (L2 over heads and dims)."""
    count = min(math.ceil(share * reused.shape[-2]), reused.shape[-2])
    deviation = (fresh.float() - reused.float()).pow(2).sum(dim=(0, 1, 3))
    return deviation.topk(count).indices.sort().values


@dataclass(frozen=True)
class Chunk:
    """One document's stored K/V: its block's ``ids``, computed at positions ``start ..``; per
    layer ``(keys, values)`` ``[1, H_kv, n, D]`` (``None`` for an MLP-only layer)."""

    ids: tuple[int, ...]
    start: int
    layers: tuple

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers if kv is not None for t in kv)


class ChunkStore:
    """The engine's per-document caches: a byte-bounded LRU, with hit / miss counts."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self._lru = ByteLRU(max_bytes, lambda chunk: chunk.nbytes)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> Chunk | None:
        with self._lock:
            found = self._lru.get(key)
            self.hits, self.misses = self.hits + (found is not None), self.misses + (found is None)
            return found

    def put(self, key: str, chunk: Chunk) -> None:
        with self._lock:
            self._lru.put(key, chunk)


def why_not(llm) -> str | None:
    """Why ``llm``'s model cannot stitch document caches (``None``: it can)."""
    why = unsupported(llm)
    if why is not None:
        return why
    if any(spec.kind != "full" for spec in llm.runner.specs):
        return "every layer must be a full-attention layer"
    rotary = rotary_of(llm.model)
    if rotary is None:
        return f"{type(llm.model).__name__} has no rotary position embedding that can be moved"
    if getattr(rotary, "rope_type", "default") not in ROTATIONS or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return f"its RoPE type {getattr(rotary, 'rope_type', None)!r} is not a fixed rotation per position"
    config = llm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rotary.inv_freq.numel() * 2 != head_dim or getattr(config, "no_rope_layers", None):
        return "RoPE covers only part of each head, or some layers have none"
    return None


def rotary_of(model):
    return next((m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")), None)


class _Stop(Exception):
    pass


class _Capture(DynamicCache):
    """A cache that keeps the values layer ``at`` is handed, then stops the forward pass."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.values = at, None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == self.at:
            self.values = value_states
            raise _Stop
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class StitchedDocuments(DocumentHandle):
    """A handle on documents whose caches are stitched per document (:meth:`SnapKVLLM.reuse_documents`)."""

    def __init__(self, llm, documents: Sequence[DocumentLike], recompute: float):
        why = why_not(llm)
        if why is not None:
            raise ValueError(f"reuse_documents: {why}")
        if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 <= recompute <= 1:
            raise ValueError(f"recompute: expected a share of the reused tokens between 0 and 1, got {recompute!r}")
        self.llm, self.documents, self.recompute = llm, to_documents(documents), float(recompute)
        if not self.documents:
            raise ValueError("documents: give at least one document to reuse")

    def __repr__(self) -> str:
        return f"StitchedDocuments({len(self.documents)} documents, recompute={self.recompute})"

    def bind_request(self, request):
        if request.spans is None or len(request.spans.documents) != len(self.documents):
            raise ValueError(
                "documents: the prompt's document blocks could not be located (a tokenizer without offsets)"
            )
        request.stored = Bound(self, request.spans.in_slice(len(request.input_ids)))
        return request

    def warm(self) -> int:
        """Compute and store the caches of the documents the store lacks; returns how many."""
        with self.llm.runner.lock, torch.inference_mode():
            return sum(self._chunk(doc)[1] for doc in self.documents)

    def next_token_logits(self, question: str) -> torch.Tensor:
        """The stitched prompt's next-token logits ``[1, V]`` for ``question`` (what its first answer
        token is drawn from), to compare with a full prefill's."""
        request = self.llm.request(question, self)
        return request.stored.prefill(self.llm.runner, list(request.input_ids)).logits

    def _chunk(self, doc) -> tuple[Chunk, bool]:
        """``doc``'s stored cache (computed now if the store lacks it) and whether it was computed."""
        request = self.llm.request(PLACEHOLDER, [doc])
        ((start, stop),) = request.spans.in_slice(len(request.input_ids))
        ids = request.input_ids[:stop]
        key = hashlib.sha256(repr((sorted(identity(self.llm).items()), ids)).encode()).hexdigest()
        store = self.llm.chunk_store
        found = store.get(key)
        if found is not None:
            return found, False
        runner = self.llm.runner
        cache = DynamicCache()
        runner.model(input_ids=torch.tensor([ids], device=runner.device), **{runner.cache_kwarg: cache}, use_cache=True)
        layers = tuple((layer.keys[:, :, start:].clone(), layer.values[:, :, start:].clone()) for layer in cache.layers)
        chunk = Chunk(tuple(ids[start:]), start, layers)
        store.put(key, chunk)
        return chunk, True


class Bound:
    """A request's prompt bound to a :class:`StitchedDocuments` handle: the absolute token spans of
    its document blocks; the runner prefills it with :meth:`prefill` (the cache decodes whole)."""

    config = None

    def __init__(self, handle: StitchedDocuments, spans: list[tuple[int, int]]):
        self.handle, self.spans = handle, spans

    def prefill(self, runner, ids: list[int]):
        """The stitched cache of the prompt ``ids`` and its next-token logits (a runner ``Prefilled``)."""
        from ..runtime.runner import Prefilled

        handle, begin = self.handle, time.perf_counter()
        with runner.lock, torch.inference_mode():
            pieces = []  # (new start, chunk, first row, count)
            for doc, (start, stop) in zip(handle.documents, self.spans):
                chunk, _ = handle._chunk(doc)
                n = common_suffix(ids[start:stop], chunk.ids)
                if n:
                    pieces.append((stop - n, chunk, len(chunk.ids) - n, n))
            cache, logits, reused = self._run(runner, ids, pieces)
        layers = [
            LayerKV(layer.keys, layer.values, cache.order.expand(1, layer.keys.shape[1], -1)) for layer in cache.layers
        ]
        compressed = Compressed(None, runner.specs, layers, len(ids))
        return Prefilled(
            compressed={"": [compressed]}, logits=logits, prefill_s=time.perf_counter() - begin, cached_tokens=reused
        )

    def _run(self, runner, ids: list[int], pieces):
        """Stitch ``pieces``, pick the tokens to recompute, prefill them with the uncovered ones."""
        handle = self.handle
        device, rotary = runner.device, rotary_of(runner.model)
        positions = (
            torch.cat([torch.arange(at, at + n) for at, _, _, n in pieces])
            if pieces
            else torch.zeros(0, dtype=torch.long)
        )
        per_layer = []
        for i in range(len(runner.specs) if pieces else 0):
            keys, values = [], []
            for at, chunk, row, n in pieces:
                k, v = chunk.layers[i]
                shift = torch.tensor([[at - (chunk.start + row)]], device=device)
                cos, sin = rotary(k, shift)
                keys.append(rotate_keys(k[:, :, row : row + n], cos[0, 0], sin[0, 0]))
                values.append(v[:, :, row : row + n])
            per_layer.append((torch.cat(keys, dim=2), torch.cat(values, dim=2)))
        keep = torch.ones(len(positions), dtype=torch.bool)
        if handle.recompute > 0 and pieces and len(per_layer) > 1:
            probe = _Capture(1)
            try:
                runner.model(
                    input_ids=torch.tensor([ids], device=device), **{runner.cache_kwarg: probe}, use_cache=True
                )
            except _Stop:
                pass
            fresh = probe.values[:, :, positions.to(device)]
            keep[most_deviating(fresh, per_layer[1][1], handle.recompute).cpu()] = False
        covered = torch.zeros(len(ids), dtype=torch.bool)
        covered[positions[keep]] = True
        run = (~covered).nonzero().flatten()
        kept = positions[keep]
        cache = DynamicCache()
        for i, (k, v) in enumerate(per_layer):
            cache.update(k[:, :, keep.to(device)], v[:, :, keep.to(device)], i)
        order = torch.cat([kept, run]).to(device)
        dtype = runner.model.dtype
        mask = torch.zeros(len(run), len(order), dtype=dtype, device=device)
        mask.masked_fill_(order[None, :] > run.to(device)[:, None], torch.finfo(dtype).min)
        mask = mask[None, None]
        last = {"logits_to_keep": 1} if runner.keep_last else {}
        out = runner.model(
            input_ids=torch.tensor([ids], device=device)[:, run.to(device)],
            attention_mask=mask,
            position_ids=run.to(device)[None],
            **{runner.cache_kwarg: cache},
            use_cache=True,
            **last,
        )
        cache.order = order[None, None]
        return cache, out.logits[:, -1, :], int(keep.sum())
