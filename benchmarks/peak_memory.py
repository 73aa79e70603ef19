"""Peak memory of one ``generate`` call, in a process of its own.

Loads the model, builds a RAG prompt of the requested length, resets the process's peak resident
set (Linux ``/proc/self/clear_refs``), answers once and prints one JSON line: the peak RSS above
the RSS right after loading, with the engine's own count of KV-cache bytes. ``cpu_decode.py`` runs
it once per (prompt size, method) so that one method's peak cannot hide another's.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_prompts import build_prompt  # noqa: E402


def _status_kib(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` from ``/proc/self/status`` in KiB (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Make ``VmHWM`` restart from the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def probe(
    model: str | None,
    size: int,
    budget: int,
    max_new_tokens: int,
    threads: int | None = None,
    prefill_chunk: int | None = 4096,
    env: dict | None = None,
) -> dict:
    """Run :func:`measure` in a fresh process (so that one answer's peak cannot hide another's)
    and return its JSON line; ``env`` adds environment variables."""
    import os
    import subprocess

    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--size",
        str(size),
        "--budget",
        str(budget),
        "--max-new-tokens",
        str(max_new_tokens),
        "--prefill-chunk",
        str(prefill_chunk or 0),
    ]
    command += (["--model", model] if model else []) + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        raise SystemExit(f"peak_memory.py failed ({' '.join(command[1:])}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(
    model: str | None,
    size: int,
    budget: int,
    max_new_tokens: int,
    threads: int | None = None,
    prefill_chunk: int | None = 4096,
) -> dict:
    import torch

    from snapkv_rag import SnapKVConfig, SnapKVLLM

    if threads:
        torch.set_num_threads(threads)
    llm = SnapKVLLM(model, prefill_chunk=prefill_chunk)
    prompt = build_prompt(llm.tokenizer, size)
    warm = build_prompt(llm.tokenizer, 256, index=199)  # pages the weights in: they are not the cache's cost
    llm.generate(warm.question, warm.documents, max_new_tokens=2, snapkv=False)
    gc.collect()
    rss_loaded = _status_kib("VmRSS")
    reset = _reset_peak()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    config = SnapKVConfig(max_capacity_prompt=budget) if budget else False
    result = llm.generate(prompt.question, prompt.documents, max_new_tokens=max_new_tokens, snapkv=config)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if not reset and peak <= before:
        peak_delta = None  # the load's own peak was higher: this process cannot tell
    else:
        peak_delta = peak - rss_loaded
    return {
        "size": size,
        "method": f"snapkv@{budget}" if budget else "full",
        "prefill_chunk": prefill_chunk,
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "peak_rss_delta_mib": None if peak_delta is None else peak_delta / 1024,
        "peak_source": "VmHWM after clear_refs" if reset else "ru_maxrss",
        "kv_bytes_full": result.compression.kv_bytes_full,
        "kv_bytes_kept": result.compression.kv_bytes_kept,
        "kept_tokens_max": max(result.compression.kept_tokens),
        "prefill_s": result.timings.prefill_s,
        "selection_ms": result.compression.selection_ms,
        "decode_ms_per_token": result.timings.decode_ms_per_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder/GGUF/hub id (default: the embedded model)")
    parser.add_argument("--size", type=int, required=True, help="prompt length in tokens")
    parser.add_argument("--budget", type=int, default=0, help="SnapKV max_capacity_prompt; 0 = full cache")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=4096,
        help="the engine's prefill_chunk (MLP slice in tokens); 0 = the whole prompt at once",
    )
    args = parser.parse_args()
    print(
        json.dumps(
            measure(args.model, args.size, args.budget, args.max_new_tokens, args.threads, args.prefill_chunk or None)
        )
    )


if __name__ == "__main__":
    main()
