"""Picking the next token on the device, for a whole batch at once, without asking the host anything.

    slots = SamplingSlots(max_rows=16, device="cuda")
    slots.set_row(3, SamplingOptions(temperature=0.7, top_p=0.9, seed=42))   # a request joins row 3
    tokens = sample(logits, slots, rows=logits.shape[0])                    # [B] long, still on the device
    chosen, top_ids, top_logprobs = logprobs(logits, tokens, k=5)

Each row has its own temperature, top-p and seed in persistent device tensors (:class:`SamplingSlots`),
so a decode step captured in a CUDA graph reads the settings of whichever requests sit in its rows
today. The randomness is a counter-based hash of (seed, step, token index) in integer tensor ops,
turned into Gumbel noise: a row's draw depends on its own seed and step and on nothing else, so a
seeded request gives the same tokens alone and inside any batch, on any device that computes the
same logits. (Before this module, sampling went through ``torch.multinomial`` on the host: a seed
gives other tokens now than it did then, and the same ones everywhere.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

GREEDY, SAMPLE, TOP_P = "greedy", "sample", "top_p"
KINDS = (GREEDY, SAMPLE, TOP_P)

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MIX_A, _MIX_B = 0x7FEB352D, 0x5BD1E995
_WEYL = 0x9E3779B1  # spaces consecutive token indices apart before they are mixed
from ..config import MAX_LOGPROBS, MAX_N  # noqa: E402,F401 - answers per request; alternatives per token


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are picked: ``temperature`` 0 is greedy; ``top_p`` nucleus; ``seed`` for sampling;
    ``ignore_eos`` decodes exactly ``max_new_tokens`` tokens (for benchmarks, as vLLM's option);
    ``n`` answers from one prefill; ``logprobs`` (0..20 alternatives, ``None``: off) reports each
    picked token's log-probability (:mod:`snapkv_rag.runtime.choices`)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens <= 0
        ):
            raise ValueError(f"max_new_tokens: must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature: must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed: expected an int, got {type(self.seed).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected True or False, got {self.ignore_eos!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be an integer from 1 to {MAX_N}, got {self.n!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs: must be None or an integer from 0 to {MAX_LOGPROBS} (the alternatives "
                f"reported per token), got {self.logprobs!r}"
            )


class SamplingSlots:
    """The sampling settings of ``max_rows`` batch rows as device tensors updated in place:
    ``temperature`` and ``top_p`` (float32), ``seed`` and ``step`` (int64). A free row is greedy.

    The host keeps a copy of each row's kind, so that :meth:`kind` can tell, without reading the
    device, which of the three code paths of :func:`sample` a batch needs (greedy rows only need an
    argmax; only top-p needs a sort of the vocabulary)."""

    def __init__(self, max_rows: int, device: torch.device | str | None = None):
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows: must be a positive integer, got {max_rows!r}")
        self.max_rows = max_rows
        self.temperature = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.step = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._kinds = [GREEDY] * max_rows

    def set_row(self, row: int, options: SamplingOptions) -> None:
        """Row ``row`` now samples as ``options`` say, from step 0; without a seed, the clock gives one."""
        self._check_row(row)
        if not isinstance(options, SamplingOptions):
            raise TypeError(f"options: expected SamplingOptions, got {type(options).__name__}")
        seed = options.seed if options.seed is not None else time.time_ns()
        self.temperature[row] = float(options.temperature)
        self.top_p[row] = float(options.top_p)
        self.seed[row] = seed % 2**63
        self.step[row] = 0
        self._kinds[row] = GREEDY if options.temperature == 0 else TOP_P if options.top_p < 1 else SAMPLE

    def clear_row(self, row: int) -> None:
        """Row ``row`` is free: greedy again, so that a padding row in a bucket costs no sampling."""
        self._check_row(row)
        self.temperature[row] = 0.0
        self.top_p[row] = 1.0
        self.seed[row] = 0
        self.step[row] = 0
        self._kinds[row] = GREEDY

    def kind(self, rows: int) -> str:
        """The code path rows ``[0, rows)`` need: ``"greedy"``, ``"sample"`` or ``"top_p"`` (the most
        general one any of them needs). A CUDA graph or compiled step is keyed by it."""
        kinds = set(self._kinds[:rows])
        return TOP_P if TOP_P in kinds else SAMPLE if SAMPLE in kinds else GREEDY

    def _check_row(self, row: int) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_rows:
            raise ValueError(f"row: must be an integer in [0, {self.max_rows}), got {row!r}")


def sample(logits: torch.Tensor, slots: SamplingSlots, rows: int, kind: str | None = None) -> torch.Tensor:
    """The next token of rows ``[0, rows)`` (``logits`` is ``[rows, V]``), as a ``[rows]`` long tensor
    on the device; advances those rows' step. Greedy rows (temperature 0) get exactly the argmax;
    the others temperature, then top-p, then a Gumbel-max draw from their own noise.

    Device ops only (no host sync), so it can be captured in a CUDA graph or compiled with
    ``fullgraph=True``. ``kind`` (see :meth:`SamplingSlots.kind`, the default) chooses the code
    path; give it explicitly inside a compiled function, so that the graph is keyed by it alone."""
    if logits.dim() != 2 or logits.shape[0] != rows or not 0 < rows <= slots.max_rows:
        raise ValueError(
            f"logits: expected [rows, vocab] with rows={rows} in [1, {slots.max_rows}], got {tuple(logits.shape)}"
        )
    kind = slots.kind(rows) if kind is None else kind
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    greedy = logits.argmax(dim=-1)
    if kind != GREEDY:
        temperature = slots.temperature[:rows, None]
        scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)
        if kind == TOP_P:
            scaled = _nucleus(scaled, slots.top_p[:rows, None])
        noise = _gumbel(slots.seed[:rows], slots.step[:rows], logits.shape[1])
        greedy = torch.where(temperature[:, 0] > 0, (scaled + noise).argmax(dim=-1), greedy)
    slots.step[:rows] += 1
    return greedy


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under ``logits`` ``[B, V]`` (as given: after a grammar mask where there is
    one, before any temperature): of the chosen ``tokens`` ``[B]``, and the ``k`` most likely tokens
    per row with theirs, ``([B], [B, k] long, [B, k])``, most likely first."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits/tokens: expected [B, V] and [B], got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k: must be an integer in [0, {logits.shape[1]}], got {k!r}")
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(-1, tokens[:, None].long())[:, 0]
    top_logprobs, top_ids = log_probs.topk(k, dim=-1)
    return chosen, top_ids, top_logprobs


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` with every token outside each row's nucleus (the most likely tokens whose mass
    reaches ``top_p``) set to -inf; a row with ``top_p`` 1 keeps all. The cut is a logit threshold, so a token tied with the last one
    kept is kept too, whatever order the sort left ties in."""
    ordered = scaled.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ahead of each one
    threshold = ordered.masked_fill((before >= top_p) & (top_p < 1), float("inf")).amin(dim=-1, keepdim=True)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _gumbel(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise ``[B, vocab]`` (float32), a pure function of each row's (seed, step) and the token
    index: integer hashing on the device, 23 bits per token turned into a uniform in (0, 1). (23, not 24:
    ``2**24 - 0.5`` rounds to ``2**24`` in float32, which made a uniform of exactly 1, infinite noise,
    and a NaN where it met a masked token's -inf, so a grammar-masked token could win.)"""
    key = _mix(_mix(_mix(seed >> 32) ^ (seed & _MASK32)) ^ (step & _MASK32))
    index = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    bits = _mix(_mix((key[:, None] + index[None, :] * _WEYL) & _MASK32) ^ key[:, None])
    return -torch.log(-torch.log(_uniform(bits)))


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 uniforms strictly inside (0, 1) (their top 23 bits, centred)."""
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift, multiply, twice) on non-negative int64 values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & _MASK32
    return x ^ (x >> 16)
