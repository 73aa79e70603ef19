"""The standing GPU check: everything a lent GPU should run, in one command that ends in 7 minutes.

    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT_DIR

runs, from a copied tree with nothing installed but torch and transformers, each step in its own
process with its own time limit (so one step's failure or hang cannot take the others' time):
1. ``gpu_decode.py``: decode speed and memory, full cache vs SnapKV, eager and graph, against
   the bandwidth floor, at 16K-64K tokens x batch 1 and 2 (see that script); gets 60% of the
   time the later steps do not need;
2. ``gpu_decode.py --concurrent``: 1, 8 and 16 concurrent requests through the scheduler, the
   same figures and tokens/s against one request's; gets the rest of that time;
3. the engine's tiny-model tests (``tests/test_engine_tiny.py``, ``tests/test_compression.py``, the slot
   cache's growth and, on CUDA only, the CUDA-graph step: ``tests/test_cuda_graphs.py``; the tail over
   stored recurrent states on the image's transformers: ``tests/test_recurrent_tail.py``)
   on the device in float32 and then bfloat16, with a word-level tokenizer written here (the
   embedded model is not on that machine);
4. an eval smoke run (``python -m evals --smoke``) on the device, with a random-weight model folder
   written here (``kv`` only when rank-bm25, which the other datasets need, is not installed).
OUT_DIR gets 8 files at most (what a lent machine sends back): gpu_check.json (every step's
status, time and log tail, and the evals' summary), gpu_decode.json, gpu_concurrent.json and one
log per step. ``--tiny --device cpu`` runs the same steps at toy size on
the CPU (the test of this script).
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


def step(name: str, command: list[str], limit_s: float, out: Path, env: dict, report: dict) -> dict:
    """Run ``command`` with a hard time limit, its output in ``out/name.log``; record the outcome."""
    log = out / f"{name}.log"
    started = time.monotonic()
    print(f"[{time.monotonic() - STARTED:5.0f} s] {name}: {' '.join(command)} (limit {limit_s:.0f} s)", flush=True)
    with log.open("w") as handle:
        try:
            code = subprocess.run(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=max(limit_s, 1)
            ).returncode
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
    tail = log.read_text(errors="replace").splitlines()[-15:]
    report["steps"][name] = {
        "status": status,
        "seconds": time.monotonic() - started,
        "limit_s": limit_s,
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
    p.add_argument("--tests-s", type=float, default=60.0, help="time for the engine tests (default 60)")
    p.add_argument(
        "--tests-k",
        default="not compiled",
        help="pytest -k expression for the engine tests (default: "
        "all but the compiled-decode test; the benchmark compiles on real shapes)",
    )
    p.add_argument(
        "--evals-s", type=float, default=30.0, help="time for the eval smoke run (default 30; it took 15 s on an H200)"
    )
    p.add_argument(
        "--grid-share",
        type=float,
        default=0.6,
        help="the batch grid's share of the benchmarks' time (default 0.6; the concurrent run gets the rest)",
    )
    args = p.parse_args(argv)
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
    margin = 15.0
    left = lambda: args.time_budget_s - (time.monotonic() - STARTED) - margin  # noqa: E731

    # 1-2. the benchmarks, with what the later steps do not need (each one's watchdog ends it 30 s past
    # its budget; what the grid leaves unused goes to the concurrent run)
    tiny = (
        ["--tiny", "--steps", "4", "--models", "tiny-gqa", "--compile-estimate-s", "5", "--sizes", "160"]
        if args.tiny
        else []
    )  # tiny: the grid alone compiles (slow on a CPU), the concurrent run is eager
    bench_s = args.grid_share * (left() - args.tests_s - args.evals_s - 2 * 35)
    grid = [
        sys.executable,
        str(HERE / "gpu_decode.py"),
        str(out),
        "--time-budget-s",
        f"{bench_s:.0f}",
        "--device",
        args.device,
        *tiny,
    ]
    step("gpu_decode", grid, bench_s + 35, out, env, report)
    bench_s = left() - args.tests_s - args.evals_s - 35
    concurrent = [
        sys.executable,
        str(HERE / "gpu_decode.py"),
        str(out),
        "--concurrent",
        "--time-budget-s",
        f"{bench_s:.0f}",
        "--device",
        args.device,
        *tiny,
    ] + (["--batches", "1", "2", "--no-compile"] if args.tiny else [])
    step("gpu_concurrent", concurrent, bench_s + 35, out, env, report)

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
            step(f"engine_tests_{dtype}", pytest, budget, out, test_env, report)
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
        outcome = step("evals_smoke", evals, left(), out, env, report)
        summary = Path(scratch) / "evals" / "summary.md"
        if outcome["status"] == "passed" and summary.exists():
            report["evals_summary"] = summary.read_text()
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
