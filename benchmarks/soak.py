"""Soak: a few minutes of mixed load against ``snapkv-rag serve``, bounded, on a loopback port.

Concurrent clients send, in a seeded random mix: normal RAG requests (streamed or not; each answer
must equal the request's sequential greedy answer, computed beforehand in process with the same
engine settings), streams the client cuts after a few pieces, bad JSON, over-long prompts (over
the context window, 400 expected) and, every ``--burst-every-s``, a burst of more requests than
the batch and the queue hold (429s expected). Counted: every status by kind, wrong answers, any
5xx (none allowed for bad input), the server's RSS after warm-up and at the end (peak too), and
``/health`` plus one more correct answer at the end. Prints a summary, writes JSON.

    python benchmarks/soak.py --seconds 300 --out benchmarks/results/soak     # the embedded model
    python benchmarks/soak.py --quick --out soak-quick                          # tiny random model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import httpx  # noqa: E402
import load_client as lc  # noqa: E402
import load_workload as wl  # noqa: E402

KINDS = {"normal": 5, "normal_plain": 3, "cut_stream": 2, "bad_json": 1, "too_long": 1}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "soak")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2)")
    parser.add_argument("--seconds", type=float, default=240, help="length of the mixed load (default 240)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients of the mix")
    parser.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch")
    parser.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue (small: bursts fill it)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct NQ requests (answers computed beforehand)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--burst-every-s", type=float, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 15 s, small counts")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.prompts, args.new_tokens, args.burst_every_s = min(args.seconds, 15), 4, 8, 6
    if min(args.clients, args.max_batch, args.prompts, args.new_tokens) < 1 or args.max_queue < 0 or args.seconds <= 0:
        parser.error("--clients, --max-batch, --prompts, --new-tokens must be >= 1, --max-queue >= 0, --seconds > 0")
    return args


def references(model_dir: Path, requests: list[wl.RagRequest], new_tokens: int) -> tuple[list[str], int]:
    """Each request's sequential greedy answer, and the engine's context window."""
    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(str(model_dir))
    try:
        return [
            llm.generate(r.question, list(r.documents), max_new_tokens=new_tokens).text for r in requests
        ], llm.context_window
    finally:
        llm.close()


class Soak:
    def __init__(self, server: lc.Server, requests, answers, context_window: int, args):
        self.server, self.requests, self.answers, self.args = server, requests, answers, args
        self.url = server.base_url + "/v1/chat/completions"
        self.statuses: dict[str, Counter] = {kind: Counter() for kind in [*KINDS, "burst"]}
        self.wrong: list[dict] = []
        self.errors: Counter = Counter()
        # documents whose text alone is over the context window (about 1.5 words a token), within the body limit
        self.too_long = [{"title": "Long", "text": "river " * (context_window * 2)}]

    def body(self, i: int) -> dict:
        request = self.requests[i]
        return {
            "model": self.server.model,
            "messages": [{"role": "user", "content": request.question}],
            "documents": list(request.documents),
            "max_tokens": self.args.new_tokens,
            "temperature": 0,
        }

    def check(self, kind: str, i: int, status, text: str | None) -> None:
        self.statuses[kind][str(status)] += 1
        if status == 200 and text is not None and text != self.answers[i]:
            self.wrong.append({"kind": kind, "prompt": i, "got": text[:200], "expected": self.answers[i][:200]})

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        i = rng.randrange(len(self.requests))
        try:
            if kind in ("normal", "cut_stream"):
                cut = rng.randint(1, 3) if kind == "cut_stream" else None
                out = await lc.stream_chat(client, self.url, self.body(i), 600, cut_after_chunks=cut)
                if out.error and out.status == 200:
                    self.errors[out.error[:120]] += 1
                self.check(kind, i, out.status, out.text if kind == "normal" and out.ok else None)
            elif kind == "normal_plain":
                response = await client.post(self.url, json=self.body(i), timeout=600)
                text = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else None
                self.check(kind, i, response.status_code, text)
            elif kind == "bad_json":
                response = await client.post(
                    self.url,
                    content=b'{"model": "x", "messages": [',
                    timeout=60,
                    headers={"content-type": "application/json"},
                )
                self.check(kind, i, response.status_code, None)
            else:
                body = {**self.body(i), "documents": self.too_long}
                response = await client.post(self.url, json=body, timeout=120)
                self.check(kind, i, response.status_code, None)
        except (httpx.HTTPError, ValueError, KeyError) as error:
            self.errors[f"{kind}: {type(error).__name__}: {str(error)[:100]}"] += 1

    async def warm_up(self) -> None:
        """One normal request (checked like the others) before the RSS baseline."""
        async with httpx.AsyncClient() as client:
            await self.one(client, "normal", random.Random(self.args.seed))

    async def burst(self, client: httpx.AsyncClient) -> None:
        """More requests at once than the batch and the queue hold: the surplus gets 429."""
        count = self.args.max_batch + self.args.max_queue + 4
        outs = await asyncio.gather(
            *(lc.stream_chat(client, self.url, self.body(k % len(self.requests)), 600) for k in range(count))
        )
        for k, out in enumerate(outs):
            self.check("burst", k % len(self.requests), out.status, out.text if out.ok else None)

    async def run(self) -> None:
        rng = random.Random(self.args.seed)
        names, weights = list(KINDS), list(KINDS.values())
        end = time.monotonic() + self.args.seconds
        limits = httpx.Limits(max_connections=self.args.clients + self.args.max_batch + self.args.max_queue + 16)
        async with httpx.AsyncClient(limits=limits) as client:

            async def mixer(seed: int, first: int) -> None:
                local, sent = random.Random(seed), 0
                while time.monotonic() < end:
                    # each client's first requests go through every kind, from its own starting kind
                    kind = names[(first + sent) % len(names)] if sent < len(names) else local.choices(names, weights)[0]
                    await self.one(client, kind, local)
                    sent += 1

            async def burster() -> None:
                while time.monotonic() + self.args.burst_every_s / 2 < end:
                    await asyncio.sleep(min(self.args.burst_every_s / 2, max(end - time.monotonic(), 0)))
                    await self.burst(client)
                    await asyncio.sleep(self.args.burst_every_s / 2)

            await asyncio.gather(burster(), *(mixer(rng.randrange(2**31), k) for k in range(self.args.clients)))


def summarise(soak: Soak, rss: dict, health: int, final_ok: bool, wall: float) -> dict:
    statuses = {kind: dict(counter) for kind, counter in soak.statuses.items()}
    five = {kind: sum(n for s, n in c.items() if s.startswith("5")) for kind, c in statuses.items()}
    bad_input_5xx = five["bad_json"] + five["too_long"]
    answered = sum(c.get("200", 0) for k, c in statuses.items() if k in ("normal", "normal_plain", "burst"))
    return {
        "wall_s": round(wall, 1),
        "statuses": statuses,
        "answers_checked": answered,
        "wrong_answers": len(soak.wrong),
        "wrong": soak.wrong[:10],
        "client_errors": dict(soak.errors),
        "five_xx": five,
        "bad_input_5xx": bad_input_5xx,
        "bad_json_400": statuses["bad_json"].get("400", 0),
        "too_long_400": statuses["too_long"].get("400", 0),
        "queue_full_429": statuses["burst"].get("429", 0),
        "rss_mib": rss,
        "health_at_end": health,
        "answer_after_soak_correct": final_ok,
        "passed": bool(
            answered
            and not soak.wrong
            and not any(five.values())
            and health == 200
            and final_ok
            and statuses["burst"].get("429", 0) > 0
        ),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    lc.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch_name:
        scratch = Path(scratch_name)
        from snapkv_rag.models import loading

        if args.quick:
            import load

            model_dir = load.tiny_model_dir(scratch)
        else:
            model_dir = Path(args.model or loading.default_model_dir())
        requests = wl.nq_requests(args.prompts, seed=args.seed)
        print(f"[{time.strftime('%H:%M:%S')}] sequential greedy answers of {len(requests)} requests", flush=True)
        answers, context_window = references(model_dir, requests, args.new_tokens)
        port = lc.free_port()
        command = lc.ours_command(str(model_dir), port, args.max_batch, ["--max-queue", str(args.max_queue)])
        with (
            lc.running_server("soak", command, port, log_dir=scratch / "logs") as server,
            lc.PeakRSS(server.process.pid) as peak,
        ):
            soak = Soak(server, requests, answers, context_window, args)
            asyncio.run(soak.warm_up())
            start_rss = lc.tree_rss(server.process.pid)
            peak.reset()
            print(f"[{time.strftime('%H:%M:%S')}] mixed load for {args.seconds:.0f} s", flush=True)
            started = time.monotonic()
            asyncio.run(soak.run())
            wall = time.monotonic() - started
            end_rss = lc.tree_rss(server.process.pid)
            health = httpx.get(server.base_url + "/health", timeout=30).status_code
            final = httpx.post(server.base_url + "/v1/chat/completions", json=soak.body(0), timeout=600)
            final_ok = final.status_code == 200 and final.json()["choices"][0]["message"]["content"] == answers[0]
            rss = {
                "after_warmup": round(start_rss / 2**20, 1),
                "end": round(end_rss / 2**20, 1),
                "peak": round(peak.peak / 2**20, 1),
                "growth": round((end_rss - start_rss) / 2**20, 1),
            }
            result = summarise(soak, rss, health, final_ok, wall)
        result["exit_code_after_sigterm"], result["pid"] = server.process.returncode, server.process.pid
        result["server_log_tail"] = server.log_tail(1500)
    result["command"] = "python benchmarks/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("wrong", "server_log_tail")}, indent=1))
    print("PASSED" if result["passed"] else "FAILED")
    return result


if __name__ == "__main__":
    main()
