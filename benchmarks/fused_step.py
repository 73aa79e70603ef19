"""The compiled decode step against transformers' eager step: the CPU proxy of issue 46.

A 32-layer Llama of hidden size 64 (random weights, built from a config, as in ``step_overhead.py``)
does almost no arithmetic, so a step's time is what the step launches and reads. On equal
``--prompt-tokens`` prompts (real RAG prompts, cut to one length), at batch 1 and 8, this times one
decode step of the engine's runner (``compile=True``: ``torch.compile``, inductor, one graph, the
next tokens picked inside it; the rows read their slots in use, not the allocation) against
transformers' own eager step (forward + argmax over a ``DynamicCache`` holding the same prompts),
in interleaved rounds, each followed by its one copy of the tokens to the host; and prints, per
batch:

- the median ms/step of each and their ratio (target: compiled <= 0.5x transformers' eager);
- the kernels one step launches, per layer (target <= 15), read from the code inductor generated
  for the step's graph: its own fused C++/Triton kernels and its calls to precompiled ones
  (matmuls, attention);
- graph breaks and the graphs compiled after the warm-up (target: 0 and 0), from ``torch._dynamo``.

    python benchmarks/fused_step.py --out benchmarks/results/fused_step.json
    python benchmarks/fused_step.py --quick          # a smoke run: 2 layers, short prompts
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from rag_prompts import build_prompt, prompt_ids  # noqa: E402
from step_overhead import build_model  # noqa: E402

FULL = dict(layers=32, prompt_tokens=896, batches=[1, 8], steps=10, rounds=5)
QUICK = dict(layers=2, prompt_tokens=100, batches=[1, 2], steps=6, rounds=2)


def equal_prompts(tokenizer, tokens: int, count: int) -> list[list[int]]:
    """``count`` RAG prompts' token ids, each cut to exactly ``tokens`` (one length: both sides hold
    the same cache, and the view length stays in one bucket over the timed steps)."""
    out = []
    for index in range(count):
        prompt = build_prompt(tokenizer, tokens + 256, index=index)
        out.append(prompt_ids(tokenizer, prompt.question, prompt.documents)[:tokens])
    return out


class Ours:
    """The engine's runner over a slot cache holding ``prompts`` (full cache), stepped ``steps`` at a time."""

    def __init__(self, llm, prompts: list[list[int]], room: int):
        self.runner = llm.runner
        self.slots = self.runner.new_slots(len(prompts))
        for row, ids in enumerate(prompts):
            pre = self.runner.prefill([ids], {"full": None})
            self.slots.join(row, pre.compressed["full"][0], room=room, token=int(pre.logits[0].argmax()))
        self.b = self.slots.batch_rows()

    def step(self) -> None:
        self.runner.to_host(self.runner.decode_step(self.slots, self.b))


class Theirs:
    """Transformers' eager decode over a ``DynamicCache`` prefilled with the same prompts."""

    def __init__(self, model, prompts: list[list[int]]):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache(config=model.config)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor(prompts), past_key_values=self.cache, logits_to_keep=1).logits
        self.token = logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        with torch.inference_mode():
            logits = self.model(input_ids=self.token, past_key_values=self.cache, logits_to_keep=1).logits
            self.token = logits[:, -1].argmax(-1, keepdim=True)
        self.token.tolist()


def timed(step, steps: int) -> float:
    """Median ms of ``steps`` calls of ``step``."""
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


FUSED_CALL = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+(?:\.run)?)\(")  # a kernel inductor generated
EXTERN_CALL = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.aten\.\w+)")  # one it calls out to


def launches(code: str) -> dict[str, int]:
    """The kernel calls in the ``call`` function of inductor's output ``code`` (what one run of the
    graph launches): generated kernels and calls out to precompiled ones (matmuls, attention)."""
    body = code[code.index("def call(") :] if "def call(" in code else ""
    fused = sum(1 for line in body.splitlines() if FUSED_CALL.match(line))
    extern = sum(1 for line in body.splitlines() if EXTERN_CALL.match(line))
    return {"generated": fused, "extern": extern}


def compile_and_count(step) -> tuple[float, dict[str, int]]:
    """Run ``step`` (its first call: the one that compiles); its time and the launches of the graph
    it compiled (the last one, where the sizes made it compile more than one)."""
    from torch._inductor.utils import run_and_get_code

    begin = time.perf_counter()
    _, codes = run_and_get_code(step)
    return time.perf_counter() - begin, launches(codes[-1]) if codes else {"generated": 0, "extern": 0}


def measure_batch(args, shape: dict, llm, theirs_model, tokenizer, batch: int) -> dict:
    from torch._dynamo.utils import counters

    prompts = equal_prompts(tokenizer, shape["prompt_tokens"], batch)
    room = shape["steps"] * (shape["rounds"] + 2) + 8
    torch._dynamo.reset()
    counters.clear()
    ours, theirs = Ours(llm, prompts, room), Theirs(theirs_model, prompts)
    compile_s, counted = compile_and_count(ours.step)
    ours.step()
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    mine, other = [], []
    for _ in range(shape["rounds"]):  # interleaved: the machine's load falls on both alike
        mine.append(timed(ours.step, shape["steps"]))
        other.append(timed(theirs.step, shape["steps"]))
    layers = shape["layers"]
    row = {
        "batch": batch,
        "prompt_tokens": shape["prompt_tokens"],
        "view_slots": ours.slots.view_length(ours.b),
        "allocated_slots": ours.slots.capacity,
        "compiled_ms_per_step": statistics.median(mine),
        "transformers_eager_ms_per_step": statistics.median(other),
        "rounds": {"compiled": mine, "transformers_eager": other},
        "compile_s": compile_s,
        "inductor_kernels_per_layer": counted["generated"] / layers,
        "extern_calls_per_layer": counted["extern"] / layers,
        "launches_per_layer": (counted["generated"] + counted["extern"]) / layers,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs_compiled_after_warmup": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "fallback": llm.runner.fallback,
    }
    row["ratio"] = row["compiled_ms_per_step"] / row["transformers_eager_ms_per_step"]
    print(
        f"batch {batch}: compiled {row['compiled_ms_per_step']:.2f} ms/step, transformers eager "
        f"{row['transformers_eager_ms_per_step']:.2f}: ratio {row['ratio']:.2f} (target <= 0.5); "
        f"kernels/layer {row['launches_per_layer']:.1f} (target <= 15): generated "
        f"{row['inductor_kernels_per_layer']:.1f}, precompiled {row['extern_calls_per_layer']:.1f}; graph breaks {row['graph_breaks']}, graphs after warm-up "
        f"{row['graphs_compiled_after_warmup']}; reads {row['view_slots']} of {row['allocated_slots']} slots",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, short prompts, batch 1 and 2")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: less noise on a shared machine)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; quick 2)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8; quick 1 2)")
    args = p.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    shape.update({k: v for k, v in (("layers", args.layers), ("batches", args.batches)) if v})
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(loading.default_model_dir())
    ours, theirs = build_model(len(tokenizer), shape["layers"]), build_model(len(tokenizer), shape["layers"])
    llm = SnapKVLLM(model=ours, tokenizer=tokenizer, compile=True, max_batch=max(shape["batches"]))
    rows = [measure_batch(args, shape, llm, theirs, tokenizer, b) for b in shape["batches"]]
    llm.close()
    result = {
        "rows": rows,
        "model": {"layers": shape["layers"], "hidden_size": 64, "vocab_size": len(tokenizer)},
        "targets": {
            f"batch_{r['batch']}": {
                "compiled_at_most_half_of_transformers_eager": r["ratio"] <= 0.5,
                "kernels_per_layer_at_most_15": r["launches_per_layer"] <= 15,
                "no_graph_break_no_recompile": r["graph_breaks"] == 0 and r["graphs_compiled_after_warmup"] == 0,
            }
            for r in rows
        },
        "command": "python benchmarks/fused_step.py"
        + (" --quick" if args.quick else "")
        + f" --threads {args.threads}",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(result["targets"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
