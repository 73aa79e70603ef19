"""Load benchmark: many concurrent clients against OpenAI-compatible servers, in one run.

Systems, on the same model and the same NQ RAG requests (5-10 documents, greedy, answer length
forced): (a) ``snapkv-rag serve`` with batching (its default max batch), (b) the same server with
``--max-batch 1`` (one request at a time), (c) ``transformers serve --continuous-batching`` (paged,
full cache), and in process (d) transformers' ``model.generate`` over left-padded batches. Each
server runs as a subprocess on a free 127.0.0.1 port, one at a time, and is stopped by this script.

For each system, answer length and number of concurrent clients (closed loop: each client sends
its next request when the last one ends; ``max(clients, --min-requests)`` requests per level):
output tokens/s, p50/p95 latency and time to first token (streaming), failed requests, requests
whose answer was not the forced length, peak RSS of the server's process tree. Beside each
tokens/s, its fraction of the "ideal for this machine": each request's prefill measured alone
(one after another) plus the decode steps of batches of ``clients`` rows (step time measured at
that batch size), both with our engine in process. Then the issue's ratios, and JSON + a markdown
table in ``--out``.

    python benchmarks/load.py --out benchmarks/results/load          # the full run (see README)
    python benchmarks/load.py --quick --out load-quick           # tiny random model, seconds
    python benchmarks/load.py --model-family bamba --systems batched --no-inprocess --levels 1 8 \
        --long-tokens 0 --min-requests 8 --out benchmarks/results/load-hybrid   # a tiny hybrid model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import httpx  # noqa: E402
import load_client as lc  # noqa: E402
import load_report  # noqa: E402
import load_workload as wl  # noqa: E402

SYSTEMS = ("batched", "one_at_a_time", "transformers_serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "load", help="folder for load.json and load.md")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2, converted)")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrent clients, 32-token answers"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=128, help="the long-answer variant (0: none)")
    parser.add_argument("--long-levels", type=int, nargs="*", default=[16], help="clients for the long variant")
    parser.add_argument("--min-requests", type=int, default=16, help="requests per level: max(clients, this)")
    parser.add_argument("--ratio-clients", type=int, default=16, help="the level the ratios compare")
    parser.add_argument("--padded-batches", type=int, nargs="*", default=[8, 16], help="model.generate batch sizes")
    parser.add_argument(
        "--ideal-max-batch",
        type=int,
        default=16,
        help="the ideal's largest decode batch (default: 16, the server's default --max-batch)",
    )
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--no-inprocess", action="store_true", help="skip the ideal and model.generate")
    parser.add_argument("--request-timeout-s", type=float, default=900)
    parser.add_argument("--time-limit-s", type=float, default=4 * 3600, help="the whole run; later levels are skipped")
    parser.add_argument("--start-timeout-s", type=float, default=600, help="each server's start (model load)")
    parser.add_argument("--quick", action="store_true", help="a tiny random model and tiny counts (a smoke test)")
    parser.add_argument(
        "--model-family",
        default=None,
        help="serve a tiny random-weight model of this family of "
        "tests/families.py (e.g. bamba, qwen3-next, lfm2: hybrids) instead of --model",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.ideal_max_batch = 3
        args.levels, args.new_tokens, args.long_tokens, args.long_levels = [1, 3], 6, 10, [3]
        args.min_requests, args.ratio_clients, args.padded_batches = 3, 3, [3]
    if args.long_tokens == 0:
        args.long_levels = []
    for name in ("levels", "long_levels", "padded_batches"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')}: every value must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 1 or args.long_tokens < 0 or args.min_requests < 1:
        parser.error("--new-tokens and --min-requests must be >= 1, --long-tokens >= 0")
    return args


def tiny_model_dir(scratch: Path, family: str | None = None) -> Path:
    """A tiny random-weight Llama (or a model of ``family`` from tests/families.py) with the embedded
    model's tokenizer, saved as a model folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from snapkv_rag.models import loading

    tokenizer = AutoTokenizer.from_pretrained(loading.default_model_dir())
    torch.manual_seed(0)
    if family is not None:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from families import tiny_model

        folder = scratch / f"tiny-{family}"
        model = tiny_model(family, len(tokenizer))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = scratch / "tiny-model"
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def plan(args) -> list[tuple[int, int]]:
    """(new tokens, clients) of every level, in run order."""
    cells = [(args.new_tokens, c) for c in args.levels]
    if args.long_tokens:
        cells += [(args.long_tokens, c) for c in args.long_levels]
    return cells


async def run_level(base_url: str, bodies: list[dict], clients: int, timeout_s: float, budget_s: float):
    """``bodies`` sent by ``clients`` concurrent clients (closed loop); requests not done within
    ``budget_s`` count as failed. Returns the outcomes and the wall time."""
    outcomes: list[lc.Outcome | None] = [None] * len(bodies)
    pending = list(range(len(bodies)))[::-1]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def worker() -> None:
            while pending:
                i = pending.pop()
                outcomes[i] = await lc.stream_chat(client, base_url + "/v1/chat/completions", bodies[i], timeout_s)

        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), max(budget_s, 1))
        except TimeoutError:
            pass
        wall = time.perf_counter() - start
    cut = lc.Outcome(error="not done within the run's time limit")
    return [o if o is not None else cut for o in outcomes], wall


def bodies_for(system: str, requests: list[wl.RagRequest], model: str, count: int, new_tokens: int) -> list[dict]:
    make = wl.transformers_body if system == "transformers_serve" else wl.ours_body
    return [make(requests[i % len(requests)], model, new_tokens) for i in range(count)]


def server_for(system: str, model_dir: Path, scratch: Path, blocks: int):
    port = lc.free_port()
    if system == "transformers_serve":
        served = lc.served_model_dir(model_dir, scratch)
        return lc.running_server(
            system, lc.transformers_command(served, port, blocks), port, model=str(served), log_dir=scratch / "logs"
        )
    command = lc.ours_command(str(model_dir), port, max_batch=1 if system == "one_at_a_time" else None)
    return lc.running_server(system, command, port, log_dir=scratch / "logs")


def run_system(system: str, args, requests, model_dir: Path, scratch: Path, deadline: float, blocks: int) -> dict:
    """One server: started, warmed up by one request, every level in turn, stopped."""
    entry: dict = {"levels": {}}
    print(f"[{time.strftime('%H:%M:%S')}] {system}: starting", flush=True)
    with server_for(system, model_dir, scratch, blocks) as server, lc.PeakRSS(server.process.pid) as rss:
        entry["pid"] = server.process.pid
        entry["idle_rss_mib"] = round(lc.tree_rss(server.process.pid) / 2**20, 1)
        warm = asyncio.run(
            run_level(
                server.base_url,
                bodies_for(system, requests, server.model, 1, args.new_tokens),
                1,
                args.request_timeout_s,
                args.start_timeout_s,
            )
        )[0][0]
        if not warm.ok:
            raise RuntimeError(f"{system}: the warm-up request failed: {warm.error}\n{server.log_tail()}")
        for new_tokens, clients in plan(args):
            key = f"{new_tokens}x{clients}"
            left = deadline - time.monotonic()
            if left <= 0:
                entry["levels"][key] = {"skipped": "the run's time limit"}
                continue
            count = max(clients, args.min_requests)
            rss.reset()
            outcomes, wall = asyncio.run(
                run_level(
                    server.base_url,
                    bodies_for(system, requests, server.model, count, new_tokens),
                    clients,
                    args.request_timeout_s,
                    left,
                )
            )
            stats = lc.summarise(outcomes, clients, wall, new_tokens, rss.peak)
            entry["levels"][key] = {
                **asdict(stats),
                "new_tokens": new_tokens,
                "answers": [o.text for o in outcomes[: len(requests)]],
            }
            print(
                f"{system:>18} {new_tokens:>4} tok {clients:>3} clients: {stats.tokens_per_s:8.2f} tok/s, "
                f"p50/p95 latency {load_report.fmt(stats.latency_p50_s)}/{load_report.fmt(stats.latency_p95_s)} s, "
                f"TTFT {load_report.fmt(stats.ttft_p50_s)}/{load_report.fmt(stats.ttft_p95_s)} s, "
                f"failed {stats.failed}, peak RSS {stats.peak_rss_mib:.0f} MiB",
                flush=True,
            )
        entry["server_log_tail"] = server.log_tail(1500).replace(str(scratch), "<scratch>")  # no machine paths
    entry["exit_code"] = server.process.returncode
    return entry


def run_inprocess(args, requests, model_dir: Path) -> dict:
    """Lone prefills and decode step times (our engine), then transformers' padded ``generate``."""
    from snapkv_rag import SnapKVLLM

    batches = {c: min(c, args.ideal_max_batch) for c in args.levels + args.long_levels}
    llm = SnapKVLLM(str(model_dir), max_batch=max(batches.values()))
    used = requests[: max(max(args.levels + args.long_levels), args.min_requests)]
    out: dict = {
        "prefill_alone_s": [round(s, 4) for s in wl.prefill_alone_s(llm, used)],
        "prompt_tokens": [len(llm.request(r.question, list(r.documents)).input_ids) for r in used],
        "decode_steps": {},
    }
    for new_tokens, clients in plan(args):
        key = f"{new_tokens}x{clients}"
        batch = batches[clients]
        if str(batch) not in out["decode_steps"]:
            out["decode_steps"][str(batch)] = wl.decode_step_s(llm, used, batch)
        step = out["decode_steps"][str(batch)]["step_s"]
        out.setdefault("ideal", {})[key] = {
            **wl.ideal(out["prefill_alone_s"], max(clients, args.min_requests), batch, step, new_tokens),
            "batch": batch,
        }
    ids = [
        llm.request(r.question, list(r.documents)).input_ids
        for r in requests[: max(args.ratio_clients, args.min_requests)]
    ]
    llm.close()
    del llm
    out["padded_generate"] = {}
    for new_tokens in sorted({args.new_tokens, args.long_tokens} - {0}):
        for batch in args.padded_batches:
            result = wl.padded_generate(str(model_dir), ids, batch, new_tokens)
            out["padded_generate"][f"{new_tokens}xb{batch}"] = {**result, "new_tokens": new_tokens}
            print(
                f"{'padded generate':>18} {new_tokens:>4} tok batch {batch:>3}: {result['tokens_per_s']:8.2f} tok/s "
                f"({result['requests']} requests)",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    lc.exit_on_sigterm()
    os.environ.update(lc.QUIET_ENV)
    deadline = time.monotonic() + args.time_limit_s
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "systems": {},
        "ended": "running",
    }
    with tempfile.TemporaryDirectory(prefix="load-bench-") as scratch_name:
        scratch = Path(scratch_name)
        from snapkv_rag.models import loading

        tiny = args.quick or args.model_family is not None
        model_dir = (
            tiny_model_dir(scratch, args.model_family) if tiny else Path(args.model or loading.default_model_dir())
        )
        report["model"] = f"tiny random {args.model_family or 'Llama'}" if tiny else str(model_dir.name)
        report["length_forced"] = wl.engine_forces_length()
        requests = wl.nq_requests(max(max(args.levels + args.long_levels), args.min_requests, args.ratio_clients))
        lengths = wl.prompt_lengths(model_dir, requests)
        report["requests"] = {
            "distinct": len(requests),
            "documents": [len(r.documents) for r in requests],
            "prompt_tokens": lengths,
        }
        # transformers serve's paged cache sized for the largest level (by default it takes most of the RAM)
        blocks = lc.blocks_for(
            max(args.levels + args.long_levels), max(lengths) + max(args.new_tokens, args.long_tokens)
        )
        report["transformers_serve_cache_blocks"] = blocks
        for system in args.systems:
            try:
                report["systems"][system] = run_system(system, args, requests, model_dir, scratch, deadline, blocks)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as error:
                report["systems"][system] = {"error": str(error)[-3000:], "levels": {}}
                print(f"{system}: FAILED: {str(error)[:2000]}", flush=True)
            load_report.write(args.out, report)
        if not args.no_inprocess:
            print(f"[{time.strftime('%H:%M:%S')}] in process: lone prefills, decode steps, padded generate", flush=True)
            report["inprocess"] = run_inprocess(args, requests, model_dir)
    report["ratios"] = load_report.ratios(report, args)
    report["ended"] = "finished"
    load_report.write(args.out, report)
    print(load_report.markdown(report))
    return report


if __name__ == "__main__":
    main()
