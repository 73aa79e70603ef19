"""The decode side of the cache: static per-row slots that requests join and leave.

Per attention layer, keys and values ``[rows, H_kv, capacity, D]`` are allocated once (rows and
capacity in buckets, see :func:`bucket`), next to the original position of every slot, one tensor
for all attention layers, ``positions`` ``[layers, rows, H_kv, capacity]`` (``-1``: empty). A
request's compressed prompt (:class:`~snapkv_rag.kv.prompt_cache.Compressed`, a value) joins by being written
into the lowest free row, each layer right-aligned to the row's longest layer, so that one write
index per row (``write_at``) serves every layer; nothing of another row is copied. A row that
leaves is freed by metadata (its index and position reset on the device).

A decode step runs rows ``[0, b)`` for a batch bucket ``b`` over the first ``length`` slots of each
row (:meth:`SlotCache.view_length`: the longest row's slots in use, rounded up to a coarse grain), so
that a step reads what the rows hold, not the allocation: a buffer grown for a 64K prompt and holding
16K costs 16K of reads. :meth:`SlotCache.begin_step` marks the slot each row writes and derives every
layer's mask from ``positions`` in a few device ops (a sliding layer also drops what left its
window), without a host sync; :meth:`SlotCache.end_step` advances the rows in use on the device, and
:meth:`SlotCache.stepped` counts the step on the host. A row of the bucket holding no request writes at its slot 0 and attends
to it: its numbers stay finite and its token is ignored.

Under a ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`) the keys and values buffers are 8-bit, each
with a scale buffer ``[rows, H_kv, capacity, G]`` in the compute dtype: a joining request's layers are
written quantized, a step's token is quantized as it is written, and the model's attention reads
the step's slots dequantized (:class:`SlotLayer`).

Recurrent layers (Mamba / linear attention / conv state) keep their states per row, in
:class:`~snapkv_rag.kv.row_states.RowStates` buffers: a joining request's states are written into its
row, a leaving row is freed by metadata, and a step over rows ``[0, b)`` hands the model views of
those rows. A hybrid layer (attention + Mamba state in one layer) has its attention part in slots
like any attention layer and its state in the same per-row buffers. Rows of hybrid models therefore
decode together like any others. Layers with no cache (MLP / MoE only) are transformers' own
placeholders.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from ..models.layer_kinds import SLIDING, LayerSpec
from . import quantized
from .prompt_cache import Compressed, LayerKV, LayerTrackingCache
from .row_states import RowStates, StateLayer

BATCH_BUCKETS = (1, 2, 4, 8, 16)
MIN_CAPACITY = 256
MIN_GRAIN = 64  # the finest step of a decode view's length (in slots)
log = logging.getLogger("snapkv_rag")


def bucket(needed: int) -> int:
    """The power of two at least ``needed``: the batch sizes a step is compiled for."""
    size = 1
    while size < needed:
        size *= 2
    return size


def view_bucket(needed: int) -> int:
    """``needed`` slots rounded up to a grain of 1/16 of its power of two (at least ``MIN_GRAIN``):
    a step reads at most ~6% more than the rows hold, and a CUDA graph captured per view length is
    replaced at most once every ~6% of the rows' growth."""
    grain = max(MIN_GRAIN, 1 << max(needed.bit_length() - 5, 0))
    return -(-needed // grain) * grain


def capacity_bucket(needed: int) -> int:
    """The slot count at least ``needed`` among 256, 384, 512, 768, 1024, 1536, ... (a power of two or
    1.5 times one): few sizes to compile for, and at most a third of the buffer unused."""
    size = MIN_CAPACITY
    while size < needed:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


class SlotLayer(DynamicLayer):
    """One attention layer's slots. ``update`` (called by the model's attention) writes the step's
    token at each row's write index and returns the step's view of the buffer: the bucket's rows,
    their first ``length`` slots (the width of the step's masks). Under the cache's ``kv_dtype``
    the buffers are 8-bit with a scale buffer each (``key_scale``/``value_scale``
    ``[rows, H_kv, capacity, G]``, the compute dtype): the step's token is quantized as it is written,
    and what ``update`` returns is those slots dequantized (a copy in the compute dtype)."""

    def __init__(self, spec: LayerSpec, cache: SlotCache, index: int):
        super().__init__()
        self.spec, self.cache, self.index = spec, cache, index
        self.is_sliding = spec.kind == SLIDING
        self.sliding_window = spec.window
        self.keys = self.values = None
        self.key_scale = self.value_scale = None  # under a kv_dtype: the per-slot, per-head scales

    def update(self, key_states, value_states, *args, **kwargs):
        b, length = key_states.shape[0], self.cache.masks[self.index].shape[-1]
        at, kv_dtype = self.cache.step_index, self.cache.kv_dtype
        if kv_dtype is None:
            self.keys.index_put_(at, key_states)  # into the buffer itself, not a view of it
            self.values.index_put_(at, value_states)
            return self.keys[:b, :, :length], self.values[:b, :, :length]
        for buffer, scales, states in (
            (self.keys, self.key_scale, key_states),
            (self.values, self.value_scale, value_states),
        ):
            q, scale = quantized.quantize(states, kv_dtype)
            if q.dtype != torch.int8:  # float8: written as its bytes (index_put_ need not take float8)
                buffer, q = buffer.view(torch.uint8), q.view(torch.uint8)
            buffer.index_put_(at, q)
            scales.index_put_(at, scale)
        return (
            quantized.dequantize(self.keys[:b, :, :length], self.key_scale[:b, :, :length], key_states.dtype),
            quantized.dequantize(self.values[:b, :, :length], self.value_scale[:b, :, :length], value_states.dtype),
        )

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer this layer holds (keys, values and, under a ``kv_dtype``, their scales)."""
        return [t for t in (self.keys, self.values, self.key_scale, self.value_scale) if t is not None]

    def get_seq_length(self) -> int:
        """Slots held by the longest row in use (host bookkeeping: no device read)."""
        return max((held[self.index] + self.cache.decoded[row] for row, held in self.cache.held.items()), default=0)

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return self.cache.capacity, 0

    def get_max_length(self) -> int:
        return -1


class SlotHybridLayer(LinearAttentionLayer, SlotLayer):
    """A hybrid layer's slots: the attention part as a :class:`SlotLayer`, the conv / SSM states views
    of the batch's rows of :class:`~snapkv_rag.kv.row_states.RowStates` buffers, updated in place by
    transformers' own ``LinearAttentionLayer`` code (as in :class:`~snapkv_rag.kv.prompt_cache.PromptHybridLayer`)."""

    def __init__(self, spec: LayerSpec, cache: SlotCache, index: int, number_of_states: int):
        SlotLayer.__init__(self, spec, cache, index)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


class SlotCache(LayerTrackingCache):
    """The running batch's cache: at most ``max_rows`` requests.
    When the last row leaves, the buffers are given back, unless ``keep`` (compiled steps: their
    graphs belong to one allocation, so it stays for the next requests). ``kv_dtype`` (``None``,
    ``"int8"``, ``"fp8"``): how the slots store keys and values (:mod:`snapkv_rag.kv.quantized`);
    a joining request's layers are stored that way whatever they came as."""

    def __init__(
        self,
        model_config,
        specs: list[LayerSpec],
        max_rows: int,
        device: torch.device,
        keep: bool = False,
        kv_dtype: str | None = None,
    ):
        super().__init__(config=model_config)
        self.kv_dtype = quantized.check_kv_dtype(kv_dtype, device)
        layers = list(self.layers) + [None] * (len(specs) - len(self.layers))
        self.recurrent = any(spec.state for spec in specs)  # recurrent or hybrid layers: per-row states
        self.max_rows = max_rows
        self.specs, self.device, self.keep = specs, device, keep
        attention = [i for i, spec in enumerate(specs) if spec.attends]
        self.layers = [
            (StateLayer(number_of_states=layer.number_of_states) if spec.state else layer)
            if not spec.attends
            else SlotLayer(spec, self, attention.index(i))
            if not spec.state
            else SlotHybridLayer(spec, self, attention.index(i), layer.number_of_states)
            for i, (spec, layer) in enumerate(zip(specs, layers))
        ]
        self.states = RowStates({i: self.layers[i] for i, spec in enumerate(specs) if spec.state})
        self.layer_class_to_replicate = None
        self.attention = [self.layers[i] for i in attention]
        windows = [spec.window if spec.kind == SLIDING else 1 << 62 for spec in specs if spec.attends]
        self.window = torch.tensor(windows, dtype=torch.long, device=device)[:, None]
        self.sliding = any(spec.kind == SLIDING for spec in specs)
        self.rows = self.capacity = 0
        self.held: dict[int, list[int]] = {}  # row in use -> prompt slots per attention layer
        self.decoded: dict[int, int] = {}  # row in use -> tokens decoded into it
        self.recorder = None  # called as recorder(layer_idx, query, keys, scoring) by eager decode steps
        # a compiled step's attention: "sdpa" (torch's kernel) or "split" (plain ops inductor fuses
        # into split reductions over the slots, see runtime.attention.fused_decode_attention)
        self.decode_attention = "sdpa"
        self.record_s = 0.0
        self.generation = 0  # bumped by every allocation: a captured graph belongs to one
        self.masks: tuple[torch.Tensor, ...] = ()
        self.step_index: tuple[torch.Tensor, torch.Tensor] = ()

    # ------------------------------------------------------------ joining and leaving (between steps)
    def free_row(self) -> int | None:
        """The lowest row no request holds, ``None`` when all ``max_rows`` are taken."""
        return next((row for row in range(self.max_rows) if row not in self.held), None)

    def join(self, row: int, compressed: Compressed, room: int, token: int, consume: bool = False) -> None:
        """Write ``compressed`` into ``row`` with ``room`` slots to decode into; ``token`` (sampled
        from the prompt's logits) is what the row's first step feeds. ``consume``: ``compressed`` is
        the caller's alone (no other request shares its prefill), so each layer is dropped from it as
        soon as it is written, and a long prompt's prefilled cache and its row are never both held
        whole. If the buffers cannot grow (out of memory), the cache is left as it was: the rows in
        use go on, and with none in use the memory is given back."""
        kvs = [i for i, layer in enumerate(compressed.layers) if isinstance(layer, LayerKV)]
        held = [compressed.layers[i].slots for i in kvs]
        start = max(held, default=0)
        states = request_states(compressed, self.specs)
        positions = [compressed.layers[i].positions[0] for i in kvs]

        def write(slot_layer) -> None:  # one layer's keys and values into the row (positions below)
            i = kvs[slot_layer.index]
            kv = compressed.layers[i].as_kv_dtype(self.kv_dtype)
            at = slice(start - kv.slots, start)
            slot_layer.keys[row, :, at] = kv.keys[0]
            slot_layer.values[row, :, at] = kv.values[0]
            if kv.key_scale is not None:
                slot_layer.key_scale[row, :, at] = kv.key_scale[0]
                slot_layer.value_scale[row, :, at] = kv.value_scale[0]
            if consume:
                compressed.layers[i] = None

        grown = self._reserve(row + 1, start + room, compressed, write)  # grown: every layer written
        with torch.inference_mode():
            for slot_layer, layer_positions in zip(self.attention, positions):
                if not grown:
                    write(slot_layer)
                n = layer_positions.shape[-1]
                self.positions[slot_layer.index, row] = -1
                self.positions[slot_layer.index, row, :, start - n : start] = layer_positions
            self.counters[:, row] = torch.tensor([start, compressed.prompt_tokens, 1, token])
            if states:
                self.states.reserve(self.rows, states)
                self.states.write(row, states)
        self.held[row], self.decoded[row] = held, 0

    def leave(self, row: int) -> None:
        """Free ``row``: metadata only (its slots are overwritten by the next request there)."""
        self.held.pop(row, None)
        self.decoded.pop(row, None)
        with torch.inference_mode():
            self.write_at[row], self.next_position[row], self.active[row] = 0, 0, 0
        if not self.held and not self.keep:  # nothing runs: give the memory back
            self._release()

    def batch_rows(self) -> int:
        """The batch bucket a step runs: the smallest that covers every row in use."""
        return min(bucket(max(self.held) + 1), self.rows)

    def _reserve(self, rows: int, slots: int, like: Compressed, write=None) -> bool:
        """Room for ``rows`` rows of ``slots`` slots: reallocated to the next buckets when short (rare:
        at most a few times per run; each time the rows in use are copied once). The layers' head
        counts, head sizes and dtype are those of ``like``. ``write(layer)`` is called on each layer
        right after its new buffers are in place (the joining row written before the next layer's
        buffers are allocated); returns whether it grew (and so wrote every layer)."""
        if rows <= self.rows and slots <= self.capacity:
            return False
        # rows by buckets, also for kept allocations (compiled steps): a lone request does not hold
        # max_rows rows; a graph belongs to one allocation (``generation``), so rows growing as more
        # requests join cost one capture per bucket reached (at most log2(max_rows) + 1 per capacity)
        new_rows = max(self.rows, min(bucket(rows), self.max_rows))
        # eager, with no row in use: what is needed, rounded to MIN_CAPACITY (a long lone prompt does not
        # pay the bucket's up to 1.5x); buckets where rows would be copied again or graphs captured again
        fresh = not self.keep and not self.held
        new_capacity = max(self.capacity, -(-slots // MIN_CAPACITY) * MIN_CAPACITY if fresh else capacity_bucket(slots))
        if self.rows:
            log.info("snapkv_rag: slot cache grows to %d rows x %d slots", new_rows, new_capacity)
        written: set[int] = set()
        try:
            with torch.inference_mode():
                self._grow(new_rows, new_capacity, like, write, written)
        except BaseException:
            self._undo_growth(written)
            raise
        if self.device.type == "cuda":  # written in place by every step: fixed addresses for CUDA graphs
            for buffer in [self.positions, self.counters, *(t for layer in self.attention for t in layer.buffers())]:
                torch._dynamo.mark_static_address(buffer, guard=False)
        self.rows, self.capacity = new_rows, new_capacity
        return True

    def _grow(self, new_rows: int, new_capacity: int, like: Compressed, write, written: set[int]) -> None:
        """Layer by layer: the new buffers, the rows in use copied in, the old ones let go."""
        indices = [i for i, layer in enumerate(like.layers) if isinstance(layer, LayerKV)]
        for layer, i in zip(self.attention, indices):
            new = self._new_buffers(like.layers[i], new_rows, new_capacity)  # `write` may drop like's layer
            for name, buffer in new.items():
                if getattr(layer, name) is not None:
                    buffer[: self.rows, :, : self.capacity] = getattr(layer, name)
                setattr(layer, name, buffer)
            written.add(layer.index)
            if write is not None:
                write(layer)
        heads = self.attention[0].keys.shape[1]
        positions = torch.full(
            (len(self.attention), new_rows, heads, new_capacity), -1, dtype=torch.long, device=self.device
        )
        counters = torch.zeros((4, new_rows), dtype=torch.long, device=self.device)
        if self.rows:
            positions[:, : self.rows, :, : self.capacity] = self.positions
            counters[:, : self.rows] = self.counters
        head_index = torch.arange(heads, device=self.device)[None, :, None]
        row_index = torch.arange(new_rows, device=self.device)[:, None, None]
        no_mask = torch.ones((new_rows, 1, 1, 1), dtype=torch.bool, device=self.device)
        # all allocated: nothing below can fail part way
        self.positions, self.counters = positions, counters
        # per row: where the next token is written, its position, 1 while a request holds the row,
        # and the token the next step feeds (the last one sampled)
        self.write_at, self.next_position, self.active, self.tokens = counters.unbind(0)
        self.generation += 1
        self.heads, self.row_index, self._no_mask = head_index, row_index, no_mask

    def _new_buffers(self, kv: LayerKV, rows: int, capacity: int) -> dict[str, torch.Tensor]:
        """Zeroed buffers for ``rows`` x ``capacity`` slots of a layer like ``kv`` (its device, heads,
        head sizes and compute dtype), stored as this cache's ``kv_dtype``, each allocated before
        the next (so that a failed allocation leaves no more than it has taken)."""
        heads, dtype = kv.keys.shape[1], kv.compute_dtype
        storage = dtype if self.kv_dtype is None else quantized.STORAGE[self.kv_dtype]
        shapes = {"keys": kv.keys.shape[-1], "values": kv.values.shape[-1]}
        out = {name: kv.keys.new_zeros((rows, heads, capacity, size), dtype=storage) for name, size in shapes.items()}
        if self.kv_dtype is not None:
            for name, size in (("key_scale", shapes["keys"]), ("value_scale", shapes["values"])):
                out[name] = kv.keys.new_zeros((rows, heads, capacity, quantized.groups(size)), dtype=dtype)
        return out

    def buffer_bytes(self) -> int:
        """The bytes the attention layers' buffers take (keys, values, and their scales under a
        ``kv_dtype``): what the allocation holds, whatever the rows in use hold."""
        return sum(t.numel() * t.element_size() for layer in self.attention for t in layer.buffers())

    def _undo_growth(self, grown: set[int]) -> None:
        """A growth that failed part way (out of memory): with no row in use, every buffer is given
        back; else each layer already grown is seen again at its old size (a view of the new buffer,
        which holds the rows in use), the positions and counters being the old ones."""
        self.generation += 1  # a captured graph may hold the addresses of the layers grown
        if not self.held:
            self._release()
            return
        for layer in self.attention:
            if layer.index in grown:
                for name in ("keys", "values", "key_scale", "value_scale"):
                    if getattr(layer, name) is not None:
                        setattr(layer, name, getattr(layer, name)[: self.rows, :, : self.capacity])

    def _release(self) -> None:
        self.rows = self.capacity = 0
        for layer in self.attention:
            layer.keys = layer.values = layer.key_scale = layer.value_scale = None
        self.states.release()

    # ------------------------------------------------------------ one step (device ops only)
    def no_mask(self, b: int) -> torch.Tensor | None:
        """The ``attention_mask`` a step hands the model: a 4-D placeholder, which transformers passes
        through as it is (no mask is built; every layer masks itself); ``None`` for recurrent models,
        whose linear-attention layers read the mask."""
        return None if self.recurrent else self._no_mask[:b]

    def view_length(self, b: int) -> int:
        """The slots a step over rows ``[0, b)`` reads (host bookkeeping, no device read): those the
        longest row holds after the step writes, rounded up by :func:`view_bucket`, within the
        allocation. A row's slots in use are its prompt's (right-aligned to its longest layer) and
        its decoded tokens'."""
        needed = max(
            (max(held, default=0) + self.decoded[row] + 1 for row, held in self.held.items() if row < b), default=1
        )
        return min(self.capacity, view_bucket(needed))

    def begin_step(self, b: int, length: int | None = None) -> torch.Tensor:
        """Prepare rows ``[0, b)`` for a step over their first ``length`` slots (default: the whole
        allocation): each row's slot to write holds its next position, and every layer's mask
        ``[b, H_kv, 1, length]`` says what it may attend to. Returns the positions ``[b]`` of the tokens fed."""
        rows, write, position = self.row_index[:b], self.write_at[:b, None, None], self.next_position[:b]
        self.states.bind(b)
        self.step_index = (rows, self.heads, write)  # [b, H_kv, 1]: the slot of each row and head
        self.positions[:, rows, self.heads, write] = position[:, None, None]
        held = self.positions[:, :b, :, : self.capacity if length is None else length]
        if self.sliding:  # a slot is seen while its position is inside the layer's window
            lower = (position[None, :] - self.window).clamp(min=-1)
            self.masks = (held > lower[:, :, None, None]).unsqueeze(3).unbind(0)
        else:
            self.masks = (held >= 0).unsqueeze(3).unbind(0)
        return position

    def end_step(self, b: int) -> None:
        """After a step over rows ``[0, b)``: the rows in use move on by one slot and one position."""
        self.write_at[:b] += self.active[:b]
        self.next_position[:b] += self.active[:b]

    def stepped(self, b: int) -> None:
        """The host's side of a step over rows ``[0, b)``: each row in use among them decoded one more token."""
        for row in self.decoded:
            if row < b:
                self.decoded[row] += 1


def request_states(compressed: Compressed, specs: list[LayerSpec]) -> dict:
    """Layer -> the request's conv / SSM state after its prompt (a recurrent layer's own object, or
    the state a hybrid layer carries beside its kept K/V)."""
    out = {}
    for i, (spec, layer) in enumerate(zip(specs, compressed.layers)):
        if spec.state:
            state = layer.state if isinstance(layer, LayerKV) else layer
            if state is None:
                raise ValueError(f"slot cache: layer {i} holds a recurrent state but the joining request has none")
            out[i] = state
    return out
