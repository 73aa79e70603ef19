"""The compression a caller gets without asking for one, in one place: :data:`DEFAULT_COMPRESSION`
is the engine's ``snapkv`` default (``SnapKVLLM()``, ``snapkv=True``), the command line's and the
server's (``snapkv-rag ask`` / ``serve`` without ``--method`` / ``--budget``), and so the LangChain
and LlamaIndex adapters' (they keep the engine's default unless given ``snapkv``).

Lookahead SnapKV (:class:`~snapkv_rag.methods.LookaheadSnapKVConfig`: SnapKV whose votes also come
from the first 8 tokens of the answer, drafted over the full cache; every head the same count, so
SnapKV's bytes) keeping half of each prompt, never fewer than :data:`FLOOR` tokens. Why: in the
project's paired comparison at equal bytes on the embedded model (``evals/results/equal_bytes/``,
its README has the command and the figures) it keeps the full cache's answer most often of the
methods whose time to the compressed cache stays within about 1.25x plain SnapKV's
(``benchmarks/results/lookahead_cost_half.json``). The floor: a prompt of at most :data:`FLOOR`
tokens is kept whole (and drafts nothing, so it costs nothing), one of up to twice that keeps
:data:`FLOOR`; see :data:`FLOOR`. Asking for a config is unchanged by this default:
``SnapKVConfig()`` is plain SnapKV at 1,024 tokens.
"""

from __future__ import annotations

from .lookahead import LookaheadSnapKVConfig

RATIO = 0.5
"""The share of each prompt the default keeps."""
FLOOR = 512
"""The fewest prompt tokens the default keeps (per layer and KV head, window included): short
prompts are where the draft costs most against the prefill and where a halved cache saves the
fewest bytes (see the module)."""
DEFAULT_COMPRESSION = LookaheadSnapKVConfig(ratio=RATIO, min_capacity_prompt=FLOOR)
"""Lookahead SnapKV at half of each prompt, never below :data:`FLOOR` tokens."""
