"""Load with Locust: 64 simulated users of mixed traffic against ``snapkv-rag serve`` for 10 minutes.

Starts the server on a free 127.0.0.1 port (the embedded model by default; ``--api-key``,
``--max-body-bytes``, ``--max-prompt-tokens`` set so that the hostile requests meet each limit),
fetches each prompt's answer sequentially (one request at a time, greedy), then runs Locust
headless (``locustfile.py`` beside this file) while the server's RSS is sampled every
``--rss-every-s`` seconds. Writes ``load_locust.json`` and ``load_locust.md`` in ``--out``:
requests and failures by kind, p50/p95 latency (a stream's is its whole answer), completion
tokens/s (the server's own counter), the RSS curve, and the checks:

- 0 wrong answers: every answered chat, completion, whole stream, structured and document-store
  request equals its prompt's sequential answer (the structured ones also parse as JSON);
- 0 5xx, and every hostile request refused with its 4xx;
- RSS flat after warm-up: every sample of the last third within 5% of that third's first one.

    python benchmarks/load_locust/run.py --out benchmarks/results/load_locust     # 64 users, 10 min
    python benchmarks/load_locust/run.py --quick --out locust-quick               # tiny model, seconds
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import httpx  # noqa: E402
import load_client as lc  # noqa: E402
import load_workload as wl  # noqa: E402

KEY = "locust-key"
HOSTILE = {  # the hostile requests of locustfile.py, and the status each must get
    "bad_json": 400,
    "too_large": 413,
    "too_many_documents": 400,
    "over_prompt_limit": 400,
    "bad_type": 400,
    "other_model": 404,
    "bad_key": 401,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "load_locust")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2)")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--spawn-rate", type=float, default=4, help="users started per second")
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--rss-every-s", type=float, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts per kind (answers fetched first)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--docs", type=int, default=3, help="documents per request (the NQ passages around the gold one)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 4 users, 10 s: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.seconds, args.rss_every_s, args.prompts, args.new_tokens, args.spawn_rate = 4, 10, 3, 2, 6, 4
    if min(args.users, args.seconds, args.prompts, args.new_tokens) < 1 or args.rss_every_s <= 0:
        parser.error("--users, --seconds, --prompts and --new-tokens must be >= 1, --rss-every-s > 0")
    return args


def plan(model: str, args, limits: dict) -> dict:
    """The prompts of each kind (their answers added by :func:`with_answers`) and the server's limits."""
    requests = [
        wl.RagRequest(r.question, _around_middle(r.documents, args.docs))
        for r in wl.nq_requests(args.prompts * 2, seed=48)
    ]
    chat, docs = requests[: args.prompts], requests[args.prompts :]
    greedy = {"model": model, "max_tokens": args.new_tokens, "temperature": 0}

    def chat_body(r, **extra) -> dict:
        return {
            **greedy,
            "messages": [{"role": "user", "content": r.question}],
            "documents": list(r.documents),
            **extra,
        }

    structured = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    shared = list(docs[0].documents)  # one document set, many questions: the store compresses it once
    keynorm = {"method": "keynorm", "budget": "50%"}
    return {
        "api_key": KEY,
        "hostile": HOSTILE,
        **limits,
        "chat": [{"path": "/v1/chat/completions", "body": chat_body(r)} for r in chat],
        "completion": [
            {"path": "/v1/completions", "body": {**greedy, "prompt": r.question, "documents": list(r.documents)}}
            for r in chat
        ],
        "structured": [
            {
                "path": "/v1/chat/completions",
                "body": chat_body(r, response_format=structured, max_tokens=max(args.new_tokens, 48)),
            }
            for r in chat
        ],
        "doc_store": [
            {
                "path": "/v1/chat/completions",
                "body": {
                    **greedy,
                    "messages": [{"role": "user", "content": r.question}],
                    "documents": shared,
                    "snapkv": keynorm,
                },
            }
            for r in docs
        ],
    }


def _around_middle(documents: tuple, count: int) -> tuple:
    """``count`` documents around the middle one (where the gold passage is)."""
    start = max(0, len(documents) // 2 - count // 2)
    return documents[start : start + count]


def with_answers(base_url: str, prompts: dict) -> None:
    """Each prompt's answer, asked one at a time (the reference the load's answers must equal)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for kind in ("chat", "completion", "structured", "doc_store"):
        for prompt in prompts[kind]:
            reply = httpx.post(base_url + prompt["path"], json=prompt["body"], headers=headers, timeout=600)
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            prompt["answer"] = choice["message"]["content"] if "message" in choice else choice["text"]
            if kind == "structured":
                json.loads(prompt["answer"])  # a structured answer is JSON (cut by max_tokens it would not be)


def generated_tokens(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    found = re.search(r"^snapkv_rag_generation_tokens_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class RSSSampler:
    """The server's RSS (its process tree) every ``every_s`` seconds, from the load's start."""

    def __init__(self, pid: int, every_s: float):
        self.pid, self.every_s, self.samples = pid, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while True:
            self.samples.append((round(time.monotonic() - start, 1), round(lc.tree_rss(self.pid) / 2**20, 1)))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def locust_stats(prefix: Path) -> tuple[dict, list[dict]]:
    """Per request name: count, failures, p50/p95 ms (Locust's CSV); and the failures by name and error."""
    stats = {}
    with open(f"{prefix}_stats.csv") as f:
        for row in csv.DictReader(f):
            stats[row["Name"]] = {
                "requests": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "p50_ms": float(row["50%"] or 0),
                "p95_ms": float(row["95%"] or 0),
                "median_ms": float(row["Median Response Time"] or 0),
            }
    with open(f"{prefix}_failures.csv") as f:
        failures = [{"name": r["Name"], "error": r["Error"], "count": int(r["Occurrences"])} for r in csv.DictReader(f)]
    return stats, failures


def flat(samples: list[tuple[float, float]], tolerance: float = 0.05) -> dict:
    """Whether the last third of the RSS samples stays within ``tolerance`` of that third's first one."""
    third = samples[len(samples) - -(-len(samples) // 3) :]
    first = third[0][1]
    worst = max(abs(mib - first) / first for _, mib in third) if first else 0.0
    return {"first_mib": first, "samples": len(third), "worst_change": round(worst, 4), "flat": worst <= tolerance}


def run_locust(base_url: str, plan_path: Path, counts_path: Path, prefix: Path, args) -> int:
    env = {**os.environ, "SNAPKV_LOCUST_PLAN": str(plan_path), "SNAPKV_LOCUST_COUNTS": str(counts_path)}
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(HERE / "locustfile.py"),
        "--headless",
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.spawn_rate),
        "--run-time",
        f"{args.seconds}s",
        "--stop-timeout",
        "120",
        "--host",
        base_url,
        "--csv",
        str(prefix),
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    return subprocess.run(command, env=env, timeout=args.seconds + 600).returncode


def report(args, stats: dict, failures: list, counts: dict, rss: list, tokens: float, wall: float) -> dict:
    five = {kind: sum(n for status, n in by.items() if status[:1] == "5") for kind, by in counts["statuses"].items()}
    hostile_refused = all(
        set(by) == {str(HOSTILE[kind.split(":", 1)[1]])}
        for kind, by in counts["statuses"].items()
        if kind.startswith("hostile:")
    )
    total = stats.get("Aggregated", {})
    checks = {
        "wrong_answers": counts["wrong_count"],
        "answers_checked": sum(counts["checked"].values()),
        "five_xx": sum(five.values()),
        "hostile_all_refused_with_their_4xx": hostile_refused,
        "rss": flat(rss),
    }
    checks["passed"] = bool(
        checks["wrong_answers"] == 0
        and checks["answers_checked"] > 0
        and checks["five_xx"] == 0
        and hostile_refused
        and checks["rss"]["flat"]
    )
    return {
        "users": args.users,
        "seconds": args.seconds,
        "wall_s": round(wall, 1),
        "requests": total.get("requests", 0),
        "failures": total.get("failures", 0),
        "p50_ms": total.get("p50_ms"),
        "p95_ms": total.get("p95_ms"),
        "completion_tokens_per_s": round(tokens / wall, 2) if wall else None,
        "completion_tokens": int(tokens),
        "by_kind": {name: s for name, s in stats.items() if name != "Aggregated"},
        "statuses_by_kind": counts["statuses"],
        "failures_by_kind": failures,
        "wrong": counts["wrong"],
        "rss_mib": [{"t_s": t, "mib": mib} for t, mib in rss],
        "checks": checks,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Locust: {result['users']} users, {result['seconds']} s",
        "",
        f"{result['requests']} requests, {result['failures']} failures; p50 {result['p50_ms']:.0f} ms, "
        f"p95 {result['p95_ms']:.0f} ms; {result['completion_tokens_per_s']} completion tokens/s.",
        "",
        "| kind | requests | failures | p50 ms | p95 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, s in sorted(result["by_kind"].items()):
        lines.append(f"| {name} | {s['requests']} | {s['failures']} | {s['p50_ms']:.0f} | {s['p95_ms']:.0f} |")
    lines += ["", "RSS (MiB) every sample: " + ", ".join(f"{r['mib']:.0f}" for r in result["rss_mib"]), ""]
    lines.append("Checks: " + json.dumps(result["checks"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    lc.exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="locust-") as scratch_name:
        scratch = Path(scratch_name)
        from snapkv_rag.models import loading

        if args.quick:
            import load

            model_dir = load.tiny_model_dir(scratch)
        else:
            model_dir = Path(args.model or loading.default_model_dir())
        limits = {"max_body_bytes": 262_144, "max_documents": 64, "max_prompt_tokens": 4096}
        port = lc.free_port()
        extra = ["--api-key", KEY, "--served-model-name", "rag", "--max-body-bytes", str(limits["max_body_bytes"])]
        extra += [
            "--max-documents",
            str(limits["max_documents"]),
            "--max-prompt-tokens",
            str(limits["max_prompt_tokens"]),
        ]
        command = lc.ours_command(str(model_dir), port, None, extra)
        with lc.running_server("locust", command, port, model="rag", log_dir=scratch / "logs") as server:
            prompts = plan(server.model, args, limits)
            print(
                f"[{time.strftime('%H:%M:%S')}] sequential answers of {sum(map(len, (prompts[k] for k in ('chat', 'completion', 'structured', 'doc_store'))))} prompts",
                flush=True,
            )
            with_answers(server.base_url, prompts)
            plan_path, counts_path, prefix = scratch / "plan.json", scratch / "counts.json", scratch / "locust"
            plan_path.write_text(json.dumps(prompts))
            before = generated_tokens(server.base_url)
            print(f"[{time.strftime('%H:%M:%S')}] locust: {args.users} users for {args.seconds} s", flush=True)
            started = time.monotonic()
            with RSSSampler(server.process.pid, args.rss_every_s) as rss:
                code = run_locust(server.base_url, plan_path, counts_path, prefix, args)
            wall = time.monotonic() - started
            tokens = generated_tokens(server.base_url) - before
            health = httpx.get(server.base_url + "/health", timeout=30).status_code
            stats, failures = locust_stats(prefix)
            counts = json.loads(counts_path.read_text())
            result = report(args, stats, failures, counts, rss.samples, tokens, wall)
            result["health_at_end"], result["locust_exit_code"] = health, code
            result["checks"]["passed"] = result["checks"]["passed"] and health == 200
            log_tail = server.log_tail(2000)
        result["server_log_tail"] = log_tail.replace(str(scratch), "<scratch>")
    root = str(BENCH.parent) + os.sep  # the command as run from the repository, without this machine's paths
    given = sys.argv[1:] if argv is None else argv
    result["command"] = "python benchmarks/load_locust/run.py " + " ".join(a.removeprefix(root) for a in given)
    (args.out / "load_locust.json").write_text(json.dumps(result, indent=1))
    (args.out / "load_locust.md").write_text(markdown(result))
    print(markdown(result))
    print("PASSED" if result["checks"]["passed"] else "FAILED")
    return result


if __name__ == "__main__":
    main()
