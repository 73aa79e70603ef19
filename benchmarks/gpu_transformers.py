"""transformers' own fast path on the grid's prompts: static cache, compiled decode step, greedy.

The same random-weight model as ``gpu_decode.py`` (the Llama-3.1-8B shape, bf16) and the same
prompts, token for token; for each prompt length, ``model.generate`` with a ``StaticCache`` sized
for that prompt and the new tokens, greedy, a fixed number of new tokens, the decode step compiled
with ``mode="reduce-overhead", fullgraph=True`` (CUDA graphs of the inductor-compiled step):
- ``--compile generate`` (the default): transformers' own way, its ``compile_config``: generate
  compiles the model's call for the decode steps and runs the prefill eagerly;
- ``--compile forward``: the older recipe, ``model.forward = torch.compile(model.forward, ...)``
  (generate's own compile off), which compiles every prompt length's prefill too.
The cache object is made once per length (so that every call at that length has the same shapes
and addresses) and reset before each call. A warm-up call on a short prompt first compiles (and
records the CUDA graphs of) the decode step for that cache: its time is recorded as
``warm_up_s`` and kept out of the figure. The figure: the timed call's per-step times, from a
streamer that stamps each new token when generate hands it over (after the step's device sync),
the first ``WARM_STEPS`` steps left out, the median; the prefill (prompt to first token) apart.
Each row stands beside the same floor as our full cache's ((weights + KV bytes read per step) /
the copy bandwidth measured in this run). Then the kernels per layer of one decode step (the
profiler, ``gpu_support.kernels_per_step``) and torch.compile's counters.

Bounded like ``gpu_decode.py``: a row runs only if its predicted time (compile included where one
is expected) fits what is left, the results are rewritten after every row, a watchdog ends the
process 30 s past the budget.

    PYTHONPATH=. python benchmarks/gpu_transformers.py OUT_DIR                  # writes gpu_transformers.json
    PYTHONPATH=. python benchmarks/gpu_transformers.py --tiny --device cpu OUT  # tiny, on CPU

``--tiny --device cpu`` takes the same code path with torch.compile's ``eager`` backend (and no
mode: CUDA graphs need CUDA; inductor on a shared CPU takes minutes): dynamo still traces the
whole step (``fullgraph``), so graph breaks and recompiles show as they would.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before the heavy imports: the time budget counts them

import argparse  # noqa: E402
import inspect  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # a copied tree works without installing the package

import torch  # noqa: E402
from gpu_report import describe_kernels, transformers_table  # noqa: E402
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
    rag_ids,
    random_prompt,
    weight_bytes_read,
    word_tokenizer,
)

SHORT_PROMPT = 256  # tokens of the warm-up and kernel-count calls (tiny: 96)


class Stamps:
    """A streamer that stamps the time of each ``put``: the prompt first, then each new token (handed
    over after ``.cpu()``, so after the step's work is done)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class Transformers:
    """``model.generate`` over a static cache with the decode step compiled, as the options say."""

    def __init__(self, model, device: Device, args):
        from transformers import CompileConfig

        self.model, self.device, self.args = model, device, args
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x / 5.1x
        dynamic = {"none": None, "true": True, "false": False}[args.dynamic]
        options = {
            "fullgraph": True,
            "dynamic": dynamic,
            "backend": "inductor" if device.cuda else "eager",
            "mode": "reduce-overhead" if device.cuda else None,
        }
        self.how = {"compile": args.compile, **options}
        self.kwargs: dict = {"do_sample": False}
        if args.compile == "generate":
            config = CompileConfig(**options)
            config._compile_all_devices = not device.cuda or None  # the CPU test: compile there too
            self.kwargs["compile_config"] = config
        else:
            self.kwargs["disable_compile"] = True
            if args.compile == "forward":
                model.forward = torch.compile(model.forward, **options)

    def cache(self, length: int):
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=length)

    def generate(self, ids: list[int], new_tokens: int, cache, streamer=None) -> int:
        """Greedy, exactly ``new_tokens`` (the EOS logit is zeroed); returns how many came."""
        cache.reset()
        input_ids = torch.tensor([ids], device=self.device.device)
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            streamer=streamer,
            **{self.cache_kwarg: cache},
            **self.kwargs,
        )
        self.device.sync()
        return out.shape[1] - len(ids)


def measure(hf: Transformers, ids: list[int], short: list[int], steps: int, cache) -> dict:
    """The warm-up (compile) call on the short prompt, then the timed call on ``ids``."""
    device = hf.device
    started = time.perf_counter()
    hf.generate(short, WARM_STEPS + 5, cache)
    warm_up_s = time.perf_counter() - started
    device.reset_peak()
    stamps = Stamps()
    started = time.perf_counter()
    came = hf.generate(ids, steps + 1, cache, stamps)
    wall = time.perf_counter() - started
    intervals = [1000 * (b - a) for a, b in zip(stamps.times[1:], stamps.times[2:])]
    steady = intervals[WARM_STEPS:] or intervals
    return {
        "status": "ok",
        "prompt_tokens": len(ids),
        "completion_tokens": came,
        "decode_ms_per_token": statistics.median(steady),
        "decode_ms_first_steps": intervals[:WARM_STEPS],
        "decode_ms_mean_all_steps": statistics.fmean(intervals) if intervals else None,
        "steps_timed": len(steady),
        "prefill_s": stamps.times[1] - stamps.times[0] if len(stamps.times) > 1 else None,
        "warm_up_s": warm_up_s,
        "peak_bytes": device.peak_bytes(),
        "wall_s": wall,
    }


def kernels(hf: Transformers, short: list[int], cache, layers: int) -> dict:
    """Kernels per layer of transformers' decode step: 12 new tokens against 4 on the short prompt, in
    the cache whose step was just compiled (its failure is this figure's, not the row's)."""
    try:
        return kernels_per_step(lambda tokens: hf.generate(short, tokens, cache), 4, 12, layers, hf.device)
    except Exception as error:  # noqa: BLE001 - recorded
        return {"status": "error", "error": f"{type(error).__name__}: {error}"[:500]}


def run_model(args, name: str, shape: dict, device: Device, dtype, results: ResultFile, watchdog, deadline, bandwidth):
    tokenizer = word_tokenizer()
    from snapkv_rag.request.prompts import DEFAULT_INSTRUCTION  # the engine's default: the grid's prompts

    entry: dict = {"shape": shape, "rows": []}
    results.report["models"][name] = entry
    model = build_model(shape, device, dtype, tokenizer)
    weights, per_token = weight_bytes_read(model), kv_bytes_per_token(model)
    layers = model.config.num_hidden_layers
    cost = CostModel(model, first_rate_flops=2.5e14 if device.cuda else 2e10, first_compile_s=args.compile_estimate_s)
    hf = Transformers(model, device, args)
    entry.update(weight_bytes_read_per_step=weights, kv_bytes_per_token=per_token, how=hf.how)
    results.write()
    short = rag_ids(tokenizer, DEFAULT_INSTRUCTION, *random_prompt(tokenizer, DEFAULT_INSTRUCTION, args.short, seed=1))
    compiles_expected = {"none": 2, "true": 1, "false": len(args.sizes)}[args.dynamic]  # static, then dynamic
    for i, size in enumerate(args.sizes):
        row: dict = {"size": size}
        entry["rows"].append(row)
        read, floor = floor_ms(weights, per_token, 1, size + (args.steps + 1) / 2, bandwidth)
        row.update(floor_bytes_read=read, floor_ms_per_token=floor)
        length = size + args.steps + 16
        # the static cache, the prefill's [prompt x cache] mask, and its whole-prompt activations
        need = (
            per_token * length
            + size * length
            + size * (12 * model.config.hidden_size + 3 * shape["intermediate_size"]) * dtype.itemsize
        )
        predicted = cost.seconds(size, 1, args.steps, floor, prefills=2) + (
            cost.compile_s if i < compiles_expected else 0
        )
        row["predicted_s"] = predicted
        left = deadline - time.monotonic()
        if predicted > left:
            row.update(status="skipped (time budget)", reason=f"predicted {predicted:.0f} s, {max(left, 0):.0f} s left")
        elif device.cuda and need > 0.95 * device.free_bytes():
            row.update(status="OOM", error=f"predicted: needs {need / 2**30:.1f} GiB")
        else:
            watchdog.doing = f"{name} {size}: warm-up (compile) and timed call"
            cache = None
            try:
                ids = rag_ids(tokenizer, DEFAULT_INSTRUCTION, *random_prompt(tokenizer, DEFAULT_INSTRUCTION, size))
                cache = hf.cache(length)
                row.update(measure(hf, ids, short, args.steps, cache))
                row["ratio_to_floor"] = row["decode_ms_per_token"] / floor
                if i < compiles_expected:
                    cost.compile_s = max(row["warm_up_s"], 1.0)
                if row["prefill_s"]:
                    cost.learn_prefill(size, 1, row["prefill_s"])
                if i == 0 and not args.no_kernels:
                    watchdog.doing = f"{name}: kernels per layer"
                    entry["kernels"] = kernels(hf, short, cache, layers)
                    print(f"  {name} kernels per layer, transformers: {describe_kernels(entry['kernels'])}", flush=True)
            except torch.OutOfMemoryError as error:
                row.update(status="OOM", error=str(error).splitlines()[0])
            except Exception as error:  # one row's failure must not lose the others
                row.update(
                    status="error",
                    error=f"{type(error).__name__}: {error}"[:500],
                    where=traceback.format_exc().splitlines()[-3:],
                )
            finally:
                del cache
                device.clean()
        results.write()
        shown = (
            f"{row['decode_ms_per_token']:.2f} ms/token ({row['ratio_to_floor']:.2f}x floor), prefill "
            f"{row['prefill_s']:.2f} s, warm-up {row['warm_up_s']:.1f} s"
            if row.get("status") == "ok"
            else f"[{row['status']}] {row.get('reason') or row.get('error') or ''}"
        )
        print(f"  {name} {size} transformers: {shown}", flush=True)
    entry["dynamo"] = dynamo_summary()
    results.write()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="folder to write gpu_transformers.json into")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and prompts: a test of the code path")
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"subset of {list(MODELS)} (default: the first; tiny: {list(TINY_MODELS)[0]})",
    )
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="prompt lengths (default 16K 32K 64K)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed, the first 3 left out (default 32)")
    p.add_argument(
        "--compile",
        choices=("generate", "forward", "none"),
        default="generate",
        help="generate: transformers' compile_config (decode steps compiled, prefill eager; default); forward: "
        "model.forward = torch.compile(model.forward, ...); none: eager",
    )
    p.add_argument(
        "--dynamic",
        choices=("none", "true", "false"),
        default="none",
        help="torch.compile's dynamic= (default none: static shapes first, then dynamic after a change)",
    )
    p.add_argument("--time-budget-s", type=float, default=150.0, help="seconds from the process start (default 150)")
    p.add_argument(
        "--compile-estimate-s",
        type=float,
        default=None,
        help="predicted seconds of a compile before one is measured (default 45 on CUDA, 20 on the CPU)",
    )
    p.add_argument("--no-kernels", action="store_true", help="skip counting the decode step's kernels")
    args = p.parse_args(argv)
    args.sizes = args.sizes or ([160] if args.tiny else [16384, 32768, 65536])
    args.short = 96 if args.tiny else SHORT_PROMPT
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = Device(args.device)
    args.compile_estimate_s = args.compile_estimate_s or (45.0 if device.cuda else 20.0)
    models, names = pick_models(args.models, args.tiny)
    names = names if args.models or not args.tiny else names[:1]
    dtype = torch.float32 if (args.tiny and not device.cuda) else torch.bfloat16
    deadline = STARTED + args.time_budget_s
    import transformers

    results = ResultFile(
        args.out_dir / "gpu_transformers.json",
        {
            "benchmark": "gpu_transformers",
            "device": device.name(),
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "steps": args.steps,
            "warm_steps_left_out": WARM_STEPS,
            "sizes": args.sizes,
            "tiny": args.tiny,
            "time_budget_s": args.time_budget_s,
            "command": "python benchmarks/gpu_transformers.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "models": {},
            "ended": "running",
        },
    )
    watchdog = Watchdog(results, deadline, grace_s=30.0)
    bandwidth = device.copy_bandwidth(64 if args.tiny else 4096)
    results.write(copy_bandwidth_bytes_per_s=bandwidth)
    print(f"{device.name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for name in names:
        if deadline - time.monotonic() < 30:
            results.report["models"][name] = {"skipped": "time budget"}
            continue
        try:
            run_model(args, name, models[name], device, dtype, results, watchdog, deadline, bandwidth)
        except Exception as error:
            results.report["models"].setdefault(name, {})["error"] = f"{type(error).__name__}: {error}"[:500]
        device.clean()  # the model and its compiled step go with run_model's frame
        results.write()
    results.write(ended="finished", wall_s=time.monotonic() - STARTED)
    print(transformers_table(results.report))
    print(f"wrote {results.path} in {time.monotonic() - STARTED:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
