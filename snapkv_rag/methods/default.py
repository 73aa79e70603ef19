"""The compression a caller gets without asking for one, in one place: :data:`DEFAULT_COMPRESSION`
is the engine's ``snapkv`` default (``SnapKVLLM()``, ``snapkv=True``), the command line's and the
server's (``snapkv-rag ask`` / ``serve`` without ``--method`` / ``--budget``), and so the LangChain
and LlamaIndex adapters' (they keep the engine's default unless given ``snapkv``).

Lookahead SnapKV (:class:`~snapkv_rag.methods.LookaheadSnapKVConfig`: SnapKV whose votes also come
from the first :data:`DRAFTED` tokens of the answer, drafted over the full cache; every head the same
count, so SnapKV's bytes) keeping half of each prompt, never fewer than :data:`FLOOR` tokens. Why
(``evals/results/equal_bytes/``: 200 NQ / HotpotQA / MuSiQue prompts, the embedded model, every
method at equal bytes): of the methods within about 1.25x SnapKV's time to the compressed cache at
600-1,100-token prompts (``benchmarks/results/lookahead_cost_half.json``: 1.24x at 662 tokens), it
keeps the full cache's answer most often (0.590 at 50%, SnapKV 0.525, +0.065 [+0.01, +0.12]
paired). Drafting 8 tokens keeps more (0.695) at 1.42-1.54x SnapKV's time below 700 tokens; the
head-adaptive, pyramid and KVzip methods keep fewer than SnapKV at equal bytes. Asking for a config
is unchanged by this default: ``SnapKVConfig()`` is plain SnapKV at 1,024 tokens, and
``LookaheadSnapKVConfig()`` drafts 8.
"""

from __future__ import annotations

from .lookahead import LookaheadSnapKVConfig

RATIO = 0.5
"""The share of each prompt the default keeps."""
FLOOR = 512
"""The fewest prompt tokens the default keeps (per layer and KV head, window included): a prompt of
at most 512 tokens is kept whole and drafts nothing, one of up to 1,024 keeps 512. Below it a 50%
cache keeps few answers (0.40 of ~325-token prompts), the draft costs most against the prefill
(1.26x at 360 tokens) and the bytes saved are the fewest (23.6 MB of the embedded model's cache)."""
DRAFTED = 4
"""Tokens of the answer the default drafts to vote with (the method's own default is 8)."""
DEFAULT_COMPRESSION = LookaheadSnapKVConfig(ratio=RATIO, min_capacity_prompt=FLOOR, lookahead=DRAFTED)
"""Lookahead SnapKV drafting :data:`DRAFTED` tokens, at half of each prompt, never below :data:`FLOOR` tokens."""
