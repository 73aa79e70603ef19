"""Peer comparison: the same RAG prompts and budget through kvpress's ``SnapKVPress``.

kvpress pins transformers < 5.3, so its half runs in its own virtual environment (``make peer``
creates ``benchmarks/.venv-kvpress``) as a worker process (``kvpress_worker.py``) that stays
loaded. This half loads ``SnapKVLLM`` on the same model folder and, prompt by prompt, asks both for
an answer in alternating order (so that a busy machine slows both alike), feeding kvpress the very
token ids our engine builds. Printed: time per answer (ours / kvpress, median of the per-prompt
ratios) and agreement (share of identical greedy answers, mean token F1 between the answers).

Both sides use window 32 and kernel 7. kvpress pools with an average only, so ours uses
``pooling="avg"`` here (``--pooling max`` for our default); kvpress keeps
``int(L * (1 - compression_ratio))`` positions, and the ratio is chosen so that this is the budget.

    make -C benchmarks peer      # creates the kvpress venv, then runs this script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rag_prompts import build_prompt, prompt_ids  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from evals.metrics import token_f1  # noqa: E402  (SQuAD-normalised token F1)


class KVPressWorker:
    """The kvpress process: one JSON request in, one JSON answer out."""

    def __init__(self, python: str, model_dir: str, threads: int | None):
        env = {
            **os.environ,
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TQDM_DISABLE": "1",
            "HF_HUB_OFFLINE": "1",
        }
        command = [python, str(HERE / "kvpress_worker.py"), model_dir] + (
            ["--threads", str(threads)] if threads else []
        )
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the kvpress worker exited (code {self.process.wait()}); see its stderr above")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def submit(self, requests: list[dict]):
        """Send ``requests`` from a thread and return a function that waits for their answers, in
        order: the worker runs them while this process does other work (one core each)."""

        def send() -> None:
            for request in requests:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()

        def answers() -> list[dict]:
            out = [self._read() for _ in requests]
            sender.join()
            return out

        return answers

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--kvpress-python",
        default=str(HERE / ".venv-kvpress" / "bin" / "python"),
        help="the interpreter of the kvpress virtual environment",
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model's cached folder)")
    parser.add_argument("--size", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--questions", type=int, default=8, help="number of prompts (default 8)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--pooling", choices=["avg", "max"], default="avg")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads, both halves")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "peer_kvpress.json")
    args = parser.parse_args()

    import torch

    from snapkv_rag import SnapKVConfig, SnapKVLLM
    from snapkv_rag.models.loading import default_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or str(default_model_dir())
    worker = KVPressWorker(args.kvpress_python, model_dir, args.threads)
    llm = SnapKVLLM(model_dir)
    config = SnapKVConfig(max_capacity_prompt=args.budget, window_size=32, kernel_size=7, pooling=args.pooling)
    eos = sorted(
        {
            llm.tokenizer.eos_token_id,
            *(
                [llm.model.generation_config.eos_token_id]
                if isinstance(llm.model.generation_config.eos_token_id, int)
                else llm.model.generation_config.eos_token_id or []
            ),
        }
        - {None}
    )

    def ask_both(prompt, first_ours: bool) -> tuple:
        ids = prompt_ids(llm.tokenizer, prompt.question, prompt.documents)
        request = {
            "input_ids": ids,
            "budget": args.budget,
            "window_size": 32,
            "kernel_size": 7,
            "max_new_tokens": args.max_new_tokens,
            "eos_ids": eos,
        }
        runs = {}
        for side in ["ours", "kvpress"] if first_ours else ["kvpress", "ours"]:
            if side == "ours":
                start = time.perf_counter()
                result = llm.generate(
                    prompt.question, prompt.documents, max_new_tokens=args.max_new_tokens, snapkv=config
                )
                runs["ours"] = (result, time.perf_counter() - start)
            else:
                runs["kvpress"] = worker.ask(request)
        return ids, runs["ours"], runs["kvpress"]

    try:
        ask_both(build_prompt(llm.tokenizer, min(args.size, 512), index=199), True)  # warm-up, not counted
        rows = []
        for i in range(args.questions):
            prompt = build_prompt(llm.tokenizer, args.size, index=i)
            ids, (ours, ours_s), peer = ask_both(prompt, first_ours=i % 2 == 0)
            peer_text = llm.tokenizer.decode(peer["tokens"], skip_special_tokens=True)
            if ours.usage.prompt_tokens != len(ids):
                raise RuntimeError(f"prompt {i}: the engine saw {ours.usage.prompt_tokens} tokens, kvpress {len(ids)}")
            row = {
                "question": prompt.question,
                "prompt_tokens": len(ids),
                "ours_text": ours.text,
                "kvpress_text": peer_text,
                "identical": ours.text.strip() == peer_text.strip(),
                "token_f1": token_f1(ours.text, peer_text),
                "ours_answer_s": ours_s,
                "kvpress_answer_s": peer["answer_s"],
                "time_ratio_ours_over_kvpress": ours_s / peer["answer_s"],
                "ours_prefill_s": ours.timings.prefill_s,
                "kvpress_prefill_s": peer["prefill_s"],
                "ours_decode_ms_per_token": ours.timings.decode_ms_per_token,
                "kvpress_decode_ms_per_token": peer["decode_ms_per_token"],
                "ours_kept": max(ours.compression.kept_tokens),
                "kvpress_kept": peer["kept"],
            }
            rows.append(row)
            print(
                f"  {i}: ours {ours_s:.2f} s, kvpress {peer['answer_s']:.2f} s, "
                f"identical={row['identical']}, F1={row['token_f1']:.2f}",
                flush=True,
            )
    finally:
        worker.close()
    summary = {
        "prompts": len(rows),
        "time_ratio_ours_over_kvpress_median": statistics.median(r["time_ratio_ours_over_kvpress"] for r in rows),
        "ours_answer_s_median": statistics.median(r["ours_answer_s"] for r in rows),
        "kvpress_answer_s_median": statistics.median(r["kvpress_answer_s"] for r in rows),
        "identical_share": sum(r["identical"] for r in rows) / len(rows),
        "token_f1_mean": statistics.mean(r["token_f1"] for r in rows),
    }
    report = {
        "benchmark": "peer_kvpress",
        "model": Path(model_dir).name,
        "size": args.size,
        "budget": args.budget,
        "pooling_ours": args.pooling,
        "window_size": 32,
        "kernel_size": 7,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "peer": worker.info,
        "command": "python benchmarks/peer_kvpress.py " + " ".join(sys.argv[1:]),
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"| prompts | tokens | budget | ours s/answer | kvpress s/answer | ours/kvpress | identical answers | token F1 |\n"
        f"|---|---|---|---|---|---|---|---|\n"
        f"| {len(rows)} | ~{args.size} | {args.budget} | {summary['ours_answer_s_median']:.2f} | "
        f"{summary['kvpress_answer_s_median']:.2f} | {summary['time_ratio_ours_over_kvpress_median']:.2f} | "
        f"{100 * summary['identical_share']:.0f}% | {summary['token_f1_mean']:.2f} |"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
