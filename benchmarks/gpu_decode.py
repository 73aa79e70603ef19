"""GPU decode speed and memory against the bandwidth floor: full cache vs SnapKV, eager vs graph.

Builds a Llama-3.1-8B-shaped model (GQA 32/8 heads, vocab 128256: the issue's model; ``--models
llama3-8b llama2-7b`` adds the Llama-2-7B shape, MHA as the paper's LWM-7B) with random bf16
weights on the device (no weight files) and times decoding through the public ``generate_batch``
(the scheduler) with the full cache and with SnapKV@1024, through the eager step
(``compile=False``) and the graph step (``compile=True``: the engine's compiled step, CUDA graphs
where it captures them):
- the batch grid: prompts of 16K-64K tokens at batch 1 and 2 (``--batches``); after the first
  length's cells, the kernels per layer of one decode step of each engine (``torch.profiler``:
  the kernels of 12 new tokens minus those of 4, over 8 steps, over the layers); then torch.compile's
  counters, and the longest prompt the full cache and SnapKV each prefill and decode under a memory
  cap (``torch.cuda.set_per_process_memory_fraction``), measured by a short search, and their ratio;
- ``--concurrent``: 1, 4 and 16 concurrent requests of 4K tokens, with tokens/s against one
  request's (the engines one after the other, so that only one holds its cache buffers).
Each figure stands beside the bandwidth floor of the same run ((weight bytes + KV bytes read per
decode step) / device copy bandwidth), and each speedup beside its ceiling (full floor / SnapKV
floor: the most the hardware allows) and the fraction of it reached. transformers' own path on the
same prompts: ``gpu_transformers.py``.

The run is bounded by construction: the clock starts with the process; a cell whose predicted
time (FLOPs at the measured rate) or memory does not fit what is left is skipped, with the
prediction recorded; results are rewritten atomically after every cell, an error in one cell is
recorded and the run goes on, and a watchdog ends the process shortly after the deadline.

    PYTHONPATH=. python benchmarks/gpu_decode.py OUT_DIR                  # the grid
    PYTHONPATH=. python benchmarks/gpu_decode.py OUT_DIR --concurrent     # 1 / 4 / 16 requests
    PYTHONPATH=. python benchmarks/gpu_decode.py --tiny --device cpu OUT  # the same code, tiny, on CPU
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before the heavy imports: the time budget counts them

import os  # noqa: E402

# the full cache's compiled cells allocate new fixed-size buffers per prompt length next to CUDA-graph
# pools: without expandable segments, 32 GiB sat reserved but unusable at 64K x 2 on the H200
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # a copied tree works without installing the package

import torch  # noqa: E402
from gpu_report import describe, describe_kernels, describe_longest, finish, table, throughput  # noqa: E402
from gpu_support import (  # noqa: E402
    MODELS,
    TINY_MODELS,
    WARM_STEPS,
    CostModel,
    Device,
    ResultFile,
    Watchdog,
    build_model,
    dynamo_summary,
    floor_ms,
    kernels_per_step,
    kv_bytes_per_token,
    pick_models,
    random_prompt,
    weight_bytes_read,
    word_tokenizer,
)


def run_cell(llm, device: Device, prompt: tuple[str, list[str]], batch: int, budget: int | None, steps: int) -> dict:
    """One (prompt, batch, method): ``batch`` concurrent requests through the scheduler
    (``generate_batch``); steady decode ms/token, prefill time, peak memory.

    The requests join one after another, so the figure comes from the first one's steps after
    the last one joined (its first ``batch - 1`` steps ran fewer rows) and after ``WARM_STEPS``
    more; it decodes ``steps + batch`` tokens, so that ``steps - WARM_STEPS`` steps remain."""
    from snapkv_rag import GenerationOutOfMemoryError, SnapKVConfig

    question, docs = prompt
    config = SnapKVConfig(max_capacity_prompt=budget) if budget else False
    device.reset_peak()
    base = device.peak_bytes()
    started = time.perf_counter()
    try:
        results = llm.generate_batch(
            [question] * batch,
            [docs] * batch,
            batch_size=batch,
            max_new_tokens=steps + batch,
            snapkv=config,
            ignore_eos=True,
        )
    except (torch.OutOfMemoryError, GenerationOutOfMemoryError) as error:
        return {"status": "OOM", "error": str(error).splitlines()[0], "wall_s": time.perf_counter() - started}
    finally:
        device.clean()
    result = results[0]
    step_ms = result.timings.decode_step_ms
    left_out = batch - 1 + WARM_STEPS
    steady = step_ms[left_out:] or step_ms
    return {
        "status": "ok",
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "steps_left_out": min(left_out, len(step_ms)),
        "decode_ms_per_token": statistics.median(steady),
        "decode_ms_first_steps": step_ms[:WARM_STEPS],
        "decode_ms_mean_all_steps": result.timings.decode_ms_per_token,
        "prefill_s": result.timings.prefill_s,
        "batch_seen": max(r.timings.batch_size for r in results),
        "selection_ms": result.compression.selection_ms,
        "kept_tokens_max": max(result.compression.kept_tokens),
        "peak_bytes": device.peak_bytes(),
        "peak_above_start_bytes": device.peak_bytes() - base,
        "wall_s": time.perf_counter() - started,
    }


class Run:
    """The grid for one model, cell by cell, inside the time and memory left."""

    def __init__(
        self,
        args,
        device: Device,
        results: ResultFile,
        watchdog: Watchdog,
        deadline: float,
        bandwidth: float,
        tokenizer,
    ):
        self.args, self.device, self.results, self.watchdog = args, device, results, watchdog
        self.deadline, self.bandwidth, self.tokenizer = deadline, bandwidth, tokenizer
        self.prompts: dict[int, tuple[str, list[str]]] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def prompt(self, llm, size: int):
        if size not in self.prompts:
            self.prompts[size] = random_prompt(self.tokenizer, llm.instruction, size)
        return self.prompts[size]

    def attempt(self, what: str, predicted_s: float, action) -> dict:
        """Run ``action`` if ``predicted_s`` fits the time left; its errors become the record."""
        if predicted_s > self.left():
            return {
                "status": "skipped (time budget)",
                "reason": f"predicted {predicted_s:.0f} s, {max(self.left(), 0):.0f} s left",
            }
        self.watchdog.doing = what
        try:
            return action()
        except Exception as error:  # one cell's failure must not lose the others
            self.device.clean()
            return {
                "status": "error",
                "error": f"{type(error).__name__}: {error}"[:500],
                "where": traceback.format_exc().splitlines()[-3:],
            }

    def model(self, name: str, shape: dict, dtype: torch.dtype, compile_mode) -> dict:
        """Every cell of one model. The batch grid runs every method at one size before the next
        (complete cells first), the graph engine made anew for each size and closed after it (the
        eager one gives its buffers back after every request); the concurrent run goes engine by
        engine, closing each before the next starts, so that only one holds its buffers."""
        args, device = self.args, self.device
        entry: dict = {"shape": shape, "cells": []}
        self.results.report["models"][name] = entry
        model = build_model(shape, device, dtype, self.tokenizer)
        weights, per_token = weight_bytes_read(model), kv_bytes_per_token(model)
        layers = model.config.num_hidden_layers
        cost = CostModel(
            model, first_rate_flops=2.5e14 if device.cuda else 2e10, first_compile_s=args.compile_estimate_s
        )
        entry.update(
            weight_bytes_read_per_step=weights,
            kv_bytes_per_token=per_token,
            compile_mode=compile_mode,
            free_bytes_after_load=device.free_bytes(),
            allocated_bytes_after_load=device.allocated_bytes(),
        )
        print(
            f"{name}: {weights / 2**30:.1f} GiB of weights read per step, {per_token / 2**10:.0f} KiB KV/token, "
            f"{entry['free_bytes_after_load'] / 2**30:.1f} GiB free",
            flush=True,
        )
        cells = {(size, batch): {"size": size, "batch": batch} for size in args.sizes for batch in args.batches}
        entry["cells"] = list(cells.values())
        kinds = ["eager"] + ([] if compile_mode is None else ["graph"])
        order = (
            [(kind, size) for kind in kinds for size in args.sizes]
            if args.concurrent
            else [(kind, size) for size in args.sizes for kind in kinds]
        )
        engines: dict = {}
        for i, (kind, size) in enumerate(order):
            if kind not in engines:
                engines[kind] = self.engine(name, model, kind, compile_mode, cost, entry)
            suffix = "_compiled" if kind == "graph" else ""
            for method, budget in (
                ("snapkv" + suffix, args.budget),
                ("full" + suffix, None),
            ):  # SnapKV first: a full cache that runs out of memory cannot starve it
                for batch in args.batches:
                    cell = cells[size, batch]
                    cell[method] = self.cell(
                        name, engines[kind], method, budget, size, batch, cost, weights, per_token, entry
                    )
                    finish(cell)
                    throughput(entry["cells"])
                    self.results.write()
                    print(f"  {name} {size} x{batch} {method}: {describe(cell[method])}", flush=True)
            if not args.concurrent and not args.no_kernels and size == args.sizes[0]:
                # kernels of one decode step of this engine (the graph: what its CUDA graph replays)
                entry.setdefault("kernels", {})[kind] = self.attempt(
                    f"{name} kernels {kind}",
                    cost.seconds(2 * args.budget, 1, 40, 1.0, prefills=4),
                    lambda llm=engines[kind]: self.kernels(llm, layers),
                )
                self.results.write()
                print(
                    f"  {name} kernels per layer, {kind} step: {describe_kernels(entry['kernels'][kind])}", flush=True
                )
            # the graph engine keeps its slot buffers for every row between requests (its graphs use
            # them): closed after its cells, so that no later cell's memory includes them
            if (args.concurrent or kind == "graph") and (i + 1 == len(order) or order[i + 1][0] != kind):
                engines.pop(kind).close()
                device.clean()
        # torch.compile's counters after the compiled cells (on CUDA compile=True captures CUDA graphs
        # without torch.compile: then they stay empty)
        entry["dynamo"] = dynamo_summary()
        if not args.no_longest and not args.concurrent and "eager" in engines:
            entry["longest"] = self.longest_pair(name, engines["eager"], entry, cost)
            self.results.write()
        for llm in engines.values():
            llm.close()
        del engines, model
        device.clean()
        return entry

    def kernels(self, llm, layers: int) -> dict:
        """Kernels per layer of one decode step of ``llm`` (full cache, one request, a short prompt),
        from the profiler: the difference between 12 and 4 new tokens, over 8 steps."""
        question, docs = self.prompt(llm, 2 * self.args.budget)

        def generate(tokens: int) -> None:
            llm.generate_batch([question], [docs], batch_size=1, max_new_tokens=tokens, snapkv=False, ignore_eos=True)

        return kernels_per_step(generate, 4, 12, layers, self.device)

    def engine(self, name: str, model, kind: str, compile_mode, cost: CostModel, entry: dict):
        """A SnapKVLLM on ``model``, eager or graph (``compile_mode``), for as many concurrent
        requests as the largest batch, after untimed calls that pay its first-use costs: the
        eager path's warm-up, or the compilation (and graph capture) of the step, whose time is
        recorded per batch size."""
        from snapkv_rag import SnapKVLLM

        llm = SnapKVLLM(
            model=model,
            tokenizer=self.tokenizer,
            snapkv=False,
            max_batch=max(self.args.batches),
            compile=False if kind == "eager" else compile_mode,
        )
        llm.runner.decode_attention = self.args.decode_attention
        small = 2 * self.args.budget
        if kind == "graph":
            entry["compile_s"] = self.compile(name, llm, cost)
            return llm
        entry["warm_up"] = {
            batch: self.attempt(
                f"{name} warm-up x{batch}",
                cost.seconds(small, batch, 4, 1.0, prefills=2),
                lambda b=batch: [
                    run_cell(llm, self.device, self.prompt(llm, small), b, budget, 4)
                    for budget in (None, self.args.budget)
                ][-1],
            )
            for batch in self.args.batches
        }
        return llm

    def compile(self, name: str, compiled, cost: CostModel) -> dict:
        """Untimed calls that compile the step (and capture its CUDA graphs) for each batch size,
        for the SnapKV and the full cache's shapes."""
        out = {}
        small = 2 * self.args.budget
        for batch in self.args.batches:
            started = time.perf_counter()
            outcome = self.attempt(
                f"{name} compile x{batch}",
                cost.compile_s + cost.seconds(small, batch, 8, 1.0, 2),
                lambda b=batch: [
                    run_cell(compiled, self.device, self.prompt(compiled, small), b, budget, 8)
                    for budget in (self.args.budget, None)
                ][-1],
            )
            seconds = time.perf_counter() - started
            if outcome["status"] == "ok":
                cost.compile_s = seconds  # later batch sizes: one recompile at most
            out[batch] = {
                "status": outcome["status"],
                "seconds": seconds,
                **{k: outcome[k] for k in outcome if k in ("error", "reason")},
            }
            self.results.write()
        return out

    def cell(self, name, llm, method, budget, size, batch, cost: CostModel, weights, per_token, entry) -> dict:
        args = self.args
        steps = args.steps + batch  # what run_cell decodes
        cached = (size if budget is None else min(size, budget)) + steps / 2
        read, floor = floor_ms(weights, per_token, batch, cached, self.bandwidth)
        base = {"floor_bytes_read": read, "floor_ms_per_token": floor}
        if method.endswith("compiled") and any(v["status"] != "ok" for v in entry["compile_s"].values()):
            return {"status": "skipped (not compiled)", **base}
        need = cost.bytes_needed(size, batch, steps)
        free = self.device.free_bytes()
        if need > 0.95 * free:
            return {
                "status": "OOM",
                "error": f"predicted: needs {need / 2**30:.1f} GiB (KV and activations), {free / 2**30:.1f} GiB free",
                **base,
            }
        predicted = cost.seconds(size, batch, steps, floor)
        outcome = self.attempt(
            f"{name} {size} x{batch} {method}",
            predicted,
            lambda: run_cell(llm, self.device, self.prompt(llm, size), batch, budget, args.steps),
        )
        outcome.update(base, predicted_s=predicted)
        if outcome["status"] == "ok":
            outcome["ratio_to_floor"] = outcome["decode_ms_per_token"] / floor
            cost.learn_prefill(size, batch, outcome["prefill_s"])
        return outcome

    def longest_pair(self, name: str, llm, entry: dict, cost: CostModel) -> dict:
        """The longest batch-1 prompt the full cache and SnapKV each prefill and decode (a few tokens)
        under a memory cap, measured; and their ratio (the paper: 8.2x).

        On CUDA the cap is ``torch.cuda.set_per_process_memory_fraction``: what is allocated now (the
        weights) plus ``--longest-headroom-mib``, so that the search ends soon; an out-of-memory error
        is a prompt that does not fit. The CPU has no allocator cap: there (the tiny test) the same
        search runs with the cap simulated, a prompt "fitting" when the cost model's bytes for it
        (``CostModel.bytes_needed``) are within the headroom, and the fitting ones run for real."""
        args, device = self.args, self.device
        headroom = int(args.longest_headroom_mib * 2**20)
        device.clean()
        if device.cuda:
            total = torch.cuda.get_device_properties(device.device).total_memory
            allocated = torch.cuda.memory_allocated(device.device)
            fraction = min(1.0, (allocated + headroom) / total)
            cap = {
                "kind": "torch.cuda.set_per_process_memory_fraction",
                "fraction": fraction,
                "cap_bytes": int(fraction * total),
                "allocated_before_bytes": allocated,
                "headroom_bytes": headroom,
            }
            torch.cuda.set_per_process_memory_fraction(fraction, device.device)
        else:
            cap = {
                "kind": "simulated (CPU: no allocator cap): fits when CostModel.bytes_needed <= headroom_bytes",
                "headroom_bytes": headroom,
            }
        out: dict = {"cap": cap}
        try:
            for method, budget in (("full", None), ("snapkv", args.budget)):
                out[method] = self.longest(name, llm, method, budget, cost, headroom, entry)
                self.results.write()
                print(f"  {name} longest prompt, {method}: {describe_longest(out[method])}", flush=True)
        finally:
            if device.cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, device.device)
            device.clean()
        full, snap = out["full"].get("longest_tokens"), out["snapkv"].get("longest_tokens")
        both = out["full"]["status"] == out["snapkv"]["status"] == "measured"
        out["ratio"] = snap / full if full and snap else None
        out["status"] = "measured" if both else "not measured (see each method's search)"
        return out

    def longest(
        self, name: str, llm, method: str, budget: int | None, cost: CostModel, headroom: int, entry: dict
    ) -> dict:
        """Doubling from ``--longest-start`` until a prompt does not fit, then ``--longest-bisect``
        bisection steps between the longest that fit and the shortest that did not. Each attempt
        prefills and decodes 5 tokens, if its predicted time fits ``--longest-attempt-s`` and the time
        left; otherwise the search stops there (a lower bound)."""
        args, device = self.args, self.device
        step = 16 if args.tiny else 1024
        attempts: list[dict] = []
        fits: int | None = None
        misses: int | None = None
        stopped = None

        def attempt(tokens: int) -> str:
            cached = tokens if budget is None else min(tokens, budget)
            _, floor = floor_ms(entry["weight_bytes_read_per_step"], cost.kv_per_token, 1, cached, self.bandwidth)
            predicted = cost.seconds(tokens, 1, 5, floor) + tokens * 2e-5  # + building the prompt
            need = cost.bytes_needed(tokens, 1, 5, budget)
            record: dict = {"tokens": tokens, "predicted_s": predicted, "predicted_bytes": need}
            attempts.append(record)
            if predicted > min(args.longest_attempt_s, self.left()):
                record["status"] = "not tried (time)"
                return "stop"
            if not device.cuda and need > headroom:
                record["status"] = "does not fit (simulated cap)"
                return "miss"
            started = time.perf_counter()
            outcome = self.attempt(
                f"{name} longest {method} {tokens}",
                0.0,
                lambda: run_cell(llm, device, random_prompt(self.tokenizer, llm.instruction, tokens), 1, budget, 4),
            )
            record.update(
                {k: outcome[k] for k in ("status", "error", "peak_bytes", "prefill_s") if k in outcome},
                wall_s=time.perf_counter() - started,
            )
            device.clean()
            if outcome["status"] == "ok":
                cost.learn_prefill(tokens, 1, outcome["prefill_s"])
                return "fit"
            return "miss" if outcome["status"] == "OOM" else "stop"

        tokens = args.longest_start
        while misses is None and stopped is None:
            if tokens > args.longest_max:
                stopped = f"reached --longest-max {args.longest_max}"
                break
            verdict = attempt(tokens)
            if verdict == "fit":
                fits, tokens = tokens, 2 * tokens
            elif verdict == "miss":
                misses = tokens
            else:
                stopped = attempts[-1]["status"]
        for _ in range(args.longest_bisect):
            if fits is None or misses is None or stopped is not None:
                break
            middle = (fits + misses) // 2 // step * step
            if middle <= fits:
                break
            verdict = attempt(middle)
            if verdict == "fit":
                fits = middle
            elif verdict == "miss":
                misses = middle
            else:
                stopped = attempts[-1]["status"]
        if fits is not None and misses is not None:
            status = "measured"
        elif fits is not None:
            status = "lower bound"
        else:
            status = "none fits" if misses is not None else "not measured"
        return {
            "status": status,
            "longest_tokens": fits,
            "first_miss_tokens": misses,
            "stopped": stopped,
            "attempts": attempts,
        }


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "out_dir",
        type=Path,
        help="folder to write gpu_decode.json (or gpu_concurrent.json) into, rewritten after every cell",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and prompts: a test of the code path")
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"subset of {list(MODELS)} (default: the first; tiny: {list(TINY_MODELS)})",
    )
    p.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="prompt lengths (default 16K 32K 64K; with --concurrent 4K)"
    )
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=None,
        help="requests decoded together (default 1 2; with --concurrent 1 4 16)",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="the concurrency run: many requests at a moderate "
        "length, engine by engine, tokens/s against one request's; writes gpu_concurrent.json",
    )
    p.add_argument("--budget", type=int, default=None, help="SnapKV max_capacity_prompt (default 1024; tiny 64)")
    p.add_argument(
        "--steps",
        type=int,
        default=32,
        help="decode steps per cell; the first 3 are left out of the steady-state ms/token (default 32)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=300.0,
        help="seconds from the process start: no cell "
        "starts that is predicted to end after it, and the watchdog ends the run 30 s past it "
        "(default 300)",
    )
    p.add_argument(
        "--compile-estimate-s",
        type=float,
        default=None,
        help="predicted first compile time before "
        "one is measured (default 20 on CUDA with --compile-mode True: a CUDA graph capture; 120 with "
        "a torch.compile mode; 60 on the CPU)",
    )
    p.add_argument("--no-longest", action="store_true", help="skip the longest-prompt search")
    p.add_argument(
        "--longest-headroom-mib",
        type=float,
        default=None,
        help="the longest-prompt search's memory cap above what is allocated before it (the weights): "
        "default 8192 (on the Llama-3-8B shape the full cache tops out near 40K tokens); tiny 8 (simulated)",
    )
    p.add_argument(
        "--longest-start", type=int, default=None, help="the search's first prompt length (default 16384; tiny 512)"
    )
    p.add_argument(
        "--longest-bisect", type=int, default=None, help="bisection steps after the doubling (default 2; tiny 4)"
    )
    p.add_argument(
        "--longest-attempt-s",
        type=float,
        default=None,
        help="the most predicted seconds one attempt may take (default 40; tiny 20)",
    )
    p.add_argument("--longest-max", type=int, default=2**20, help="no attempt above this many tokens (default 1M)")
    p.add_argument("--no-kernels", action="store_true", help="skip counting the decode step's kernels")
    p.add_argument("--no-compile", action="store_true", help="leave out the graph (compiled) methods")
    p.add_argument(
        "--compile-mode",
        default="True",
        help="the engines' compile= for the graph methods: True (default) or a torch.compile mode name",
    )
    p.add_argument(
        "--decode-attention",
        choices=["sdpa", "split"],
        default="sdpa",
        help="the compiled step's attention over the slots: torch's kernel (default) or plain ops "
        "inductor fuses into split reductions",
    )
    args = p.parse_args(argv)
    args.budget = args.budget or (64 if args.tiny else 1024)
    if args.concurrent:
        args.sizes = args.sizes or ([128] if args.tiny else [4096])
        args.batches = args.batches or ([1, 2, 4] if args.tiny else [1, 4, 16])
    args.sizes = args.sizes or ([256, 512] if args.tiny else [16384, 32768, 65536])
    args.batches = args.batches or [1, 2]
    args.compile_mode = True if args.compile_mode == "True" else args.compile_mode
    args.longest_headroom_mib = args.longest_headroom_mib or (8.0 if args.tiny else 8192.0)
    args.longest_start = args.longest_start or (512 if args.tiny else 16384)
    args.longest_bisect = args.longest_bisect if args.longest_bisect is not None else (4 if args.tiny else 2)
    args.longest_attempt_s = args.longest_attempt_s or (20.0 if args.tiny else 40.0)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = Device(args.device)
    if args.compile_estimate_s is None:
        # CUDA with compile=True compiles the step with inductor and captures it in CUDA graphs (about a
        # minute, guessed: not yet measured); "eager-graph" captures only (seconds; an H200 took 1.7 s);
        # another torch.compile mode, or the CPU, compiles with inductor (minutes)
        captured_only = device.cuda and args.compile_mode == "eager-graph"
        args.compile_estimate_s = 20.0 if captured_only else 90.0 if device.cuda else 60.0
    models, names = pick_models(args.models, args.tiny)
    dtype = torch.float32 if (args.tiny and not device.cuda) else torch.bfloat16
    compile_mode = None if args.no_compile else args.compile_mode
    deadline = STARTED + args.time_budget_s
    results = ResultFile(
        args.out_dir / ("gpu_concurrent.json" if args.concurrent else "gpu_decode.json"),
        {
            "benchmark": "gpu_decode",
            "concurrent": args.concurrent,
            "device": device.name(),
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "budget": args.budget,
            "steps": args.steps,
            "warm_steps_left_out": WARM_STEPS,
            "sizes": args.sizes,
            "batches": args.batches,
            "tiny": args.tiny,
            "time_budget_s": args.time_budget_s,
            "command": "python benchmarks/gpu_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "models": {},
            "ended": "running",
        },
    )
    watchdog = Watchdog(results, deadline, grace_s=30.0)
    import transformers

    bandwidth = device.copy_bandwidth(64 if args.tiny else 4096)
    results.write(transformers=transformers.__version__, copy_bandwidth_bytes_per_s=bandwidth)
    print(f"{device.name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    run = Run(args, device, results, watchdog, deadline, bandwidth, word_tokenizer())
    for name in names:
        if run.left() < 30:
            results.report["models"][name] = {"skipped": f"time budget ({max(run.left(), 0):.0f} s left)"}
            continue
        watchdog.doing = f"{name}: building"
        try:
            run.model(name, models[name], dtype, compile_mode)
        except Exception as error:
            results.report["models"].setdefault(name, {})["error"] = f"{type(error).__name__}: {error}"[:500]
            device.clean()
        results.write()
    results.write(ended="finished", wall_s=time.monotonic() - STARTED)
    print(table(results.report))
    print(f"wrote {results.path} in {time.monotonic() - STARTED:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
