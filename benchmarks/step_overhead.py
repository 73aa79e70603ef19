"""What a decode step costs beyond its arithmetic: the CPU proxy of issue 23.

A 32-layer Llama of hidden size 64 (random weights, built from a config) does almost no arithmetic,
so a decode step's time is dispatch: how many operators it launches and what the host does between
them. On 1,000-token RAG prompts, at batch 1 and 8, this prints

(a) aten operators per eager decode step of the engine (``SnapKVLLM(compile=False)``, everything its
    worker thread runs per step: cache bookkeeping, forward, sampling) against one forward of
    transformers' own model over a ``DynamicCache``, counted with a ``TorchDispatchMode``; the
    engine's figure is the difference between two runs of 8 and 8 + N tokens, over N;
(b) per-step time of the engine's compiled step (``compile=True``) and its eager step against
    transformers' eager step (forward + argmax over a ``DynamicCache``): at batch 1 one request,
    at batch 8 eight concurrent requests through the scheduler (``generate_batch``), the mean of
    their ``timings.decode_ms_per_token``;

with the ratios and the issue's targets (operators <= 1.05x transformers', compiled <= 0.5x
transformers' eager time), and writes JSON. Only the engine's public API is used (``SnapKVLLM``,
``llm.model``, results' timings), so the script measures whatever execution path the engine has.

    python benchmarks/step_overhead.py --out benchmarks/results/step_overhead.json
    python benchmarks/step_overhead.py --quick          # a smoke run: 2 layers, short prompts
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rag_prompts import build_prompt, prompt_ids  # noqa: E402

FULL = dict(layers=32, prompt_tokens=1000, batches=[1, 8], base_tokens=8, extra_tokens=24)
QUICK = dict(layers=2, prompt_tokens=160, batches=[1, 2], base_tokens=3, extra_tokens=4)


class OpCounter(TorchDispatchMode):
    """Counts aten operators into a shared tally while ``armed`` is set."""

    def __init__(self, tally: collections.Counter, armed: threading.Event):
        super().__init__()
        self.tally, self.armed = tally, armed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed.is_set():
            self.tally[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class WorkerOps:
    """Counts the operators of the threads the engine starts (its worker). A dispatch mode is
    thread-local and, entered inside ``torch.inference_mode``, lasts only until that block ends; so
    each new thread enters one as it starts (``threading.setprofile``, removed at its first call)
    and keeps it for its life: everything it runs is counted while ``armed``."""

    def __init__(self):
        self.tally: collections.Counter = collections.Counter()
        self.armed = threading.Event()

    def __enter__(self) -> WorkerOps:
        threading.setprofile(self._start_thread)
        return self

    def __exit__(self, *exc) -> None:
        threading.setprofile(None)

    def _start_thread(self, frame, event, arg) -> None:
        sys.setprofile(None)
        OpCounter(self.tally, self.armed).__enter__()

    def count(self, run) -> int:
        self.tally.clear()
        self.armed.set()
        try:
            run()
        finally:
            self.armed.clear()
        return sum(self.tally.values())


def build_model(vocab_size: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def prompts(tokenizer, tokens: int, count: int) -> list:
    return [build_prompt(tokenizer, tokens, index=i) for i in range(count)]


def run_batch(llm, chosen: list, tokens: int) -> list:
    """``len(chosen)`` concurrent requests of exactly ``tokens`` new tokens each, full cache."""
    return llm.generate_batch(
        [p.question for p in chosen],
        [p.documents for p in chosen],
        batch_size=len(chosen),
        max_new_tokens=tokens,
        ignore_eos=True,
        snapkv=False,
    )


def engine_ops_per_step(llm, counter: WorkerOps, chosen: list, base: int, extra: int) -> float:
    """Operators of one eager decode step at ``len(chosen)`` rows: two runs that differ only by
    ``extra`` decode steps, so that prefill, joining and leaving cancel out."""
    run_batch(llm, chosen, base)  # warms up
    short = counter.count(lambda: run_batch(llm, chosen, base))
    return (counter.count(lambda: run_batch(llm, chosen, base + extra)) - short) / extra


def transformers_step(model, ids: torch.Tensor, steps: int) -> dict:
    """Transformers' own decode over a ``DynamicCache``: operators of one forward (counted on the
    first step) and the mean wall time of a step (forward + argmax) over ``steps`` steps."""
    from transformers import DynamicCache

    takes_cache = "cache" in inspect.signature(model.forward).parameters  # newer name of past_key_values
    cache = DynamicCache(config=model.config)
    kwargs = {"cache" if takes_cache else "past_key_values": cache, "use_cache": True, "logits_to_keep": 1}
    tally, armed = collections.Counter(), threading.Event()
    with torch.inference_mode():
        token = model(input_ids=ids, **kwargs).logits[:, -1].argmax(-1, keepdim=True)
        with OpCounter(tally, armed):
            armed.set()
            model(input_ids=token, **kwargs)
            armed.clear()
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            token = model(input_ids=token, **kwargs).logits[:, -1].argmax(-1, keepdim=True)
            times.append(1000 * (time.perf_counter() - begin))
    return {"ops_per_forward": sum(tally.values()), "ms_per_step": statistics.mean(times[1:])}


def engine_ms_per_step(llm, chosen: list, tokens: int) -> float:
    """Mean decode ms/token of ``len(chosen)`` concurrent requests (after a warm-up round that pays
    compilation), from each result's ``timings.decode_ms_per_token``."""
    run_batch(llm, chosen, tokens)
    return statistics.mean(r.timings.decode_ms_per_token for r in run_batch(llm, chosen, tokens))


def measure(args, shape: dict) -> dict:
    from transformers import AutoTokenizer

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or loading.default_model_dir())
    ours, theirs = build_model(len(tokenizer), shape["layers"]), build_model(len(tokenizer), shape["layers"])
    chosen = prompts(tokenizer, shape["prompt_tokens"], max(shape["batches"]))
    ids = [prompt_ids(tokenizer, p.question, p.documents) for p in chosen]
    rows = []
    counter = WorkerOps()
    with counter:  # the threads this engine starts count their operators
        eager = SnapKVLLM(model=ours, tokenizer=tokenizer, compile=False, max_batch=max(shape["batches"]))
        run_batch(eager, chosen[:1], 2)
    for batch in shape["batches"]:
        shortest = min(len(i) for i in ids[:batch])
        reference = transformers_step(
            theirs, torch.tensor([i[:shortest] for i in ids[:batch]]), shape["base_tokens"] + shape["extra_tokens"]
        )
        ops = engine_ops_per_step(eager, counter, chosen[:batch], shape["base_tokens"], shape["extra_tokens"])
        rows.append(
            {
                "batch": batch,
                "prompt_tokens": [len(i) for i in ids[:batch]],
                "transformers_ops_per_forward": reference["ops_per_forward"],
                "engine_ops_per_step": ops,
                "ops_ratio": ops / reference["ops_per_forward"],
                "transformers_eager_ms_per_step": reference["ms_per_step"],
            }
        )
        print(
            f"batch {batch}: aten operators per decode step: engine {ops:.0f}, transformers' forward "
            f"{reference['ops_per_forward']}, ratio {rows[-1]['ops_ratio']:.2f}",
            flush=True,
        )
    eager.close()  # its worker thread, which still holds a counting mode, ends here
    engines = {"eager": SnapKVLLM(model=ours, tokenizer=tokenizer, compile=False, max_batch=max(shape["batches"]))}
    if not args.no_compile:
        engines["compiled"] = SnapKVLLM(model=ours, tokenizer=tokenizer, compile=True, max_batch=max(shape["batches"]))
    tokens = shape["base_tokens"] + shape["extra_tokens"]
    for row in rows:
        chosen_rows = chosen[: row["batch"]]
        for mode, llm in engines.items():
            ms = engine_ms_per_step(llm, chosen_rows, tokens)
            row[f"engine_{mode}_ms_per_step"] = ms
            row[f"engine_{mode}_vs_transformers_eager"] = ms / row["transformers_eager_ms_per_step"]
            print(
                f"batch {row['batch']}: {mode} step {ms:.2f} ms, transformers' eager step "
                f"{row['transformers_eager_ms_per_step']:.2f} ms, ratio "
                f"{row[f'engine_{mode}_vs_transformers_eager']:.2f}",
                flush=True,
            )
    for llm in engines.values():
        llm.close()
    return {
        "rows": rows,
        "model": {"layers": shape["layers"], "hidden_size": 64, "vocab_size": len(tokenizer)},
        "new_tokens": tokens,
        "targets": targets(rows),
    }


def targets(rows: list[dict]) -> dict:
    """The issue's targets, met or not, per batch."""
    out = {}
    for row in rows:
        out[f"batch_{row['batch']}"] = {
            "ops_within_5_percent_of_transformers": row["ops_ratio"] <= 1.05,
            **(
                {"compiled_at_most_half_of_transformers_eager": row["engine_compiled_vs_transformers_eager"] <= 0.5}
                if "engine_compiled_vs_transformers_eager" in row
                else {}
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 160-token prompts, batch 1 and 2")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled engine")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "step_overhead.json", help="JSON to write")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    started = time.perf_counter()
    report = measure(args, QUICK if args.quick else FULL)
    print(
        "| batch | aten ops / step: engine | transformers | ratio | transformers eager ms | engine eager ms | "
        "engine compiled ms | compiled / transformers |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        compiled = r.get("engine_compiled_ms_per_step")
        print(
            f"| {r['batch']} | {r['engine_ops_per_step']:.0f} | {r['transformers_ops_per_forward']} | "
            f"{r['ops_ratio']:.2f} | {r['transformers_eager_ms_per_step']:.2f} | {r['engine_eager_ms_per_step']:.2f} | "
            + (f"{compiled:.2f} | {r['engine_compiled_vs_transformers_eager']:.2f} |" if compiled else "- | - |")
        )
    report.update(
        {
            "command": " ".join(["python", "benchmarks/step_overhead.py", *sys.argv[1:]]),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "wall_s": time.perf_counter() - started,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
