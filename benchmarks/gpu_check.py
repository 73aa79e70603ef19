"""The standing GPU check: everything a lent GPU should run, in one command that ends in 7 minutes.

    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT_DIR

runs, from a copied tree with nothing installed but torch and transformers, each step in its own
process with its own time limit (so one step's failure or hang cannot take the others' time), on
the Llama-3.1-8B shape (random bf16 weights):
1. ``gpu_decode.py``: our decode speed and memory, full cache vs SnapKV@1024, eager and graph, against
   the bandwidth floor, at 16K-64K tokens, batch 1; the kernels per layer of one decode step
   (profiler); the longest prompt each fits under a memory cap, measured (see that script);
2. ``gpu_transformers.py``: transformers' own fast path (static cache, decode step compiled with
   reduce-overhead + fullgraph) on the same prompts, ms/token against the same floor, and its
   kernels per layer;
3. ``gpu_decode.py --concurrent``: 1, 4 and 16 concurrent 4K requests through the scheduler, the
   same figures and tokens/s against one request's;
   (1-3 share the benchmarks' time by ``--shares``; what one leaves unused goes to the next)
4. the engine's tiny-model tests (``tests/test_engine_tiny.py``, ``tests/test_compression.py``, the slot
   cache's growth and, on CUDA only, the CUDA-graph step: ``tests/test_cuda_graphs.py``; the tail over
   stored recurrent states on the image's transformers: ``tests/test_recurrent_tail.py``)
   on the device in float32 and then bfloat16, with a word-level tokenizer written here (the
   embedded model is not on that machine);
5. an eval smoke run (``python -m evals --smoke``) on the device, with a random-weight model folder
   written here (``kv`` only when rank-bm25, which the other datasets need, is not installed).
Then the issue's targets, judged on those files (``gpu_report.targets``), printed and recorded as
booleans. OUT_DIR gets 8 files (what a lent machine sends back at most): gpu_check.json (every
step's status, time and log tail, the targets, the evals' summary), gpu_decode.json,
gpu_transformers.json, gpu_concurrent.json, one log per benchmark and tests.log (the engine tests
and the eval run). ``--tiny --device cpu`` runs the same steps at toy size on the CPU (the test of
this script).
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

TESTS = [
    "tests/test_engine_tiny.py",
    "tests/test_compression.py",
    "tests/test_slot_growth.py",
    "tests/test_cuda_graphs.py",
    "tests/test_recurrent_tail.py",
]


def step(
    name: str, command: list[str], limit_s: float, out: Path, env: dict, report: dict, log_name: str | None = None
) -> dict:
    """Run ``command`` with a hard time limit, its output appended to ``out/<log_name or name>.log``
    (several steps may share one log: the files that come back are few); record the outcome."""
    log = out / f"{log_name or name}.log"
    started = time.monotonic()
    print(f"[{time.monotonic() - STARTED:5.0f} s] {name}: {' '.join(command)} (limit {limit_s:.0f} s)", flush=True)
    with log.open("a") as handle:
        handle.write(f"==== {name} (limit {limit_s:.0f} s)\n")
        handle.flush()
        offset = handle.tell()
        try:
            code = subprocess.run(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=max(limit_s, 1)
            ).returncode
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
    with log.open("rb") as handle:
        handle.seek(offset)
        tail = handle.read().decode(errors="replace").splitlines()[-15:]
    report["steps"][name] = {
        "status": status,
        "seconds": time.monotonic() - started,
        "limit_s": limit_s,
        "log": log.name,
        "log_tail": tail,
    }
    write(out, report)
    print(f"[{time.monotonic() - STARTED:5.0f} s] {name}: {status}\n  " + "\n  ".join(tail[-4:]), flush=True)
    return report["steps"][name]


def write(out: Path, report: dict) -> None:
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "gpu_check.json")


def random_model_folder(folder: Path, tokenizer, tiny: bool) -> Path:
    """A random-weight Llama with the word-level tokenizer, saved as a model folder the evals load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = 64 if tiny else 256
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size,
        intermediate_size=2 * size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for a test of this script on the CPU")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=410.0,
        help="seconds for the whole check from the process start (default 410: under 7 minutes)",
    )
    p.add_argument(
        "--tests-s",
        type=float,
        default=None,
        help="time kept for the engine tests (default 50; they took 38 s on an H200; what is left goes to them; "
        "tiny: 100, the CPU is slower at them)",
    )
    p.add_argument(
        "--tests-k",
        default="not compiled",
        help="pytest -k expression for the engine tests (default: "
        "all but the compiled-decode test; the benchmark compiles on real shapes)",
    )
    p.add_argument(
        "--evals-s", type=float, default=25.0, help="time for the eval smoke run (default 25; it took 15 s on an H200)"
    )
    p.add_argument(
        "--shares",
        type=float,
        nargs=3,
        default=[0.40, 0.34, 0.26],
        metavar=("GRID", "TRANSFORMERS", "CONCURRENT"),
        help="the benchmarks' shares of their time (default 0.40 0.34 0.26); each gets its share of what "
        "is left when it starts, so that what one leaves unused goes to the next",
    )
    p.add_argument(
        "--grid-batches",
        type=int,
        nargs="+",
        default=[1],
        help="the grid's batch sizes (default 1: batch 2 has no time in 7 minutes)",
    )
    args = p.parse_args(argv)
    args.tests_s = args.tests_s or (100.0 if args.tiny else 50.0)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers
    from gpu_support import word_tokenizer

    report = {
        "check": "gpu_check",
        "device": args.device,
        "tiny": args.tiny,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "time_budget_s": args.time_budget_s,
        "steps": {},
    }
    write(out, report)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    margin, grace = 15.0, 35.0  # the end's margin; one benchmark's overrun (its watchdog's 30 s + 5)
    left = lambda: args.time_budget_s - (time.monotonic() - STARTED) - margin  # noqa: E731

    def bench_budget(shares: list[float]) -> float:
        """This benchmark's share of what the benchmarks have left: the later steps' reserve and one
        overrun's grace apart."""
        return shares[0] / sum(shares) * (left() - args.tests_s - args.evals_s - grace)

    common = ["--device", args.device]
    if args.tiny:  # the grid alone compiles our step (slow on a CPU); the concurrent run is eager
        common += ["--tiny", "--steps", "4", "--models", "tiny-gqa", "--sizes", "160"]
    # 1. our grid (batch 1 by default), kernels per layer, the longest prompts under a memory cap
    bench_s = bench_budget(args.shares)
    grid = [sys.executable, str(HERE / "gpu_decode.py"), str(out), "--time-budget-s", f"{bench_s:.0f}", *common]
    grid += ["--batches", *map(str, args.grid_batches)] + (["--compile-estimate-s", "5"] if args.tiny else [])
    step("gpu_decode", grid, bench_s + grace, out, env, report)
    # 2. transformers' static cache + compiled decode on the same prompts (one compile: dynamic shapes
    # from the start; with torch's default the second length recompiles dynamic anyway)
    bench_s = bench_budget(args.shares[1:])
    hf = [sys.executable, str(HERE / "gpu_transformers.py"), str(out), "--time-budget-s", f"{bench_s:.0f}"]
    step("gpu_transformers", hf + common + ["--dynamic", "true"], bench_s + grace, out, env, report)
    # 3. concurrent requests
    bench_s = bench_budget(args.shares[2:])
    concurrent = [sys.executable, str(HERE / "gpu_decode.py"), str(out), "--concurrent"]
    concurrent += ["--time-budget-s", f"{bench_s:.0f}", *common]
    concurrent += ["--batches", "1", "4", "--no-compile"] if args.tiny else []
    step("gpu_concurrent", concurrent, bench_s + grace, out, env, report)

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = word_tokenizer()
        tokenizer_dir = Path(scratch) / "tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        # 3. the engine's tests on the device: float32, then bfloat16 (the compiled test once)
        pytest = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not model",
            "-k",
            args.tests_k,
            *TESTS,
        ]
        for dtype in ("float32", "bfloat16"):
            test_env = {
                **env,
                "SNAPKV_TEST_DEVICE": args.device,
                "SNAPKV_TEST_DTYPE": dtype,
                "SNAPKV_TEST_TOKENIZER": str(tokenizer_dir),
            }
            budget = left() - args.evals_s if dtype == "bfloat16" else min(0.75 * args.tests_s, left() - args.evals_s)
            step(f"engine_tests_{dtype}", pytest, budget, out, test_env, report, log_name="tests")
        # 4. an eval smoke run on the device from a random-weight model folder
        model_dir = random_model_folder(Path(scratch) / "model", tokenizer, args.tiny)
        datasets = "nq,musique,kv" if importlib.util.find_spec("rank_bm25") and not args.tiny else "kv"
        report["evals_datasets"] = datasets
        evals = [
            sys.executable,
            "-m",
            "evals",
            "--smoke",
            "--model",
            str(model_dir),
            "--device",
            args.device,
            "--dtype",
            "float32" if args.tiny else "bfloat16",
            "--datasets",
            datasets,
            "--out",
            str(Path(scratch) / "evals"),
        ]
        outcome = step("evals_smoke", evals, left(), out, env, report, log_name="tests")
        summary = Path(scratch) / "evals" / "summary.md"
        if outcome["status"] == "passed" and summary.exists():
            report["evals_summary"] = summary.read_text()
    # the targets, judged on what the benchmarks wrote
    from gpu_report import targets, targets_text

    found = {}
    for name in ("gpu_decode", "gpu_transformers", "gpu_concurrent"):
        path = out / f"{name}.json"
        try:
            found[name] = json.loads(path.read_text()) if path.exists() else None
        except ValueError:  # a step killed mid-write cannot leave this (the writes are atomic); be safe
            found[name] = None
    report["targets"] = targets(found["gpu_decode"], found["gpu_transformers"], found["gpu_concurrent"])
    print(targets_text(report["targets"]), flush=True)
    report["wall_s"] = time.monotonic() - STARTED
    report["passed"] = all(s["status"] == "passed" for s in report["steps"].values())
    write(out, report)
    print(
        f"gpu_check: {'all steps passed' if report['passed'] else 'some steps did not pass'} in "
        f"{report['wall_s']:.0f} s; {out / 'gpu_check.json'}",
        flush=True,
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
