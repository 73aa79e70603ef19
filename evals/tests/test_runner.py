"""The runner on the tiny random model: resume after SIGKILL, torn lines, the CLI end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evals.__main__ import main
from evals.runner import load_rows

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--datasets",
    "kv",
    "--num-docs",
    "5,8",
    "--gold-positions",
    "every",
    "--num-questions",
    "2",
    "--methods",
    "full,snapkv@64,streaming@50%",
    "--max-new-tokens",
    "4",
    "--no-progress",
]
STABLE = (
    "example_id",
    "method",
    "budget",
    "text",
    "citations",
    "f1",
    "cit_f1",
    "identical_to_full",
    "hit_rate",
    "kept_tokens",
    "prompt_tokens",
)


def _run(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"{out.name}.log", "ab")  # a file, not a pipe nobody reads: no stall when it fills
    return subprocess.Popen(
        [sys.executable, "-m", "evals.tests.tiny", *ARGS, "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stable(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    return sorted(tuple(json.dumps(r[k]) for k in STABLE) for r in rows)


def _rows_written(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.heavy
def test_resume_after_sigkill_loses_and_doubles_nothing(tmp_path, tiny):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = _run(killed)
    deadline = time.monotonic() + 600  # startup alone is slow on a busy machine
    while _rows_written(killed / "rows.jsonl") < 3 * 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = _rows_written(killed / "rows.jsonl")
    assert 0 < partial < 26 * 3
    assert _run(killed).wait(timeout=300) == 0
    assert main([*ARGS, "--out", str(whole)], engine=tiny) == 0  # the uninterrupted reference, same weights
    assert _stable(killed) == _stable(whole)
    assert len(_stable(whole)) == 26 * 3  # 2 questions x (5 + 8 positions) x 3 methods
    assert (killed / "summary.md").read_text().count("\n") == (whole / "summary.md").read_text().count("\n")


def test_torn_line_and_incomplete_example_are_dropped(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = [{"example_id": "a", "method": m} for m in ("full", "snapkv@64")]
    partial = [{"example_id": "b", "method": "full"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in good + partial) + '{"example_id": "c", "met')
    done = load_rows(path, ["full", "snapkv@64"])
    assert list(done) == ["a"]
    assert [json.loads(line)["example_id"] for line in path.read_text().splitlines()] == ["a", "a"]


def test_resume_refuses_changed_settings(tmp_path, tiny):
    args = [
        "--datasets",
        "kv",
        "--num-docs",
        "3",
        "--gold-positions",
        "first",
        "--num-questions",
        "1",
        "--methods",
        "full,h2o@40",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main([*args, "--max-new-tokens", "2"], engine=tiny) == 0
    with pytest.raises(SystemExit, match="max_new_tokens"):
        main([*args, "--max-new-tokens", "3"], engine=tiny)


def test_batched_methods_give_the_answers_and_hit_rates_of_one_at_a_time(tmp_path, tiny):
    args = [
        "--datasets",
        "kv",
        "--num-docs",
        "6",
        "--gold-positions",
        "first,last",
        "--num-questions",
        "2",
        "--methods",
        "full,snapkv@48,h2o@48,streaming@50%,adasnapkv@50%",
        "--max-new-tokens",
        "4",
        "--no-progress",
    ]
    assert main([*args, "--out", str(tmp_path / "alone")], engine=tiny) == 0
    assert main([*args, "--batch-methods", "--out", str(tmp_path / "batched")], engine=tiny) == 0
    assert _stable(tmp_path / "batched") == _stable(tmp_path / "alone")
    assert len(_stable(tmp_path / "alone")) == 4 * 5
    assert json.loads((tmp_path / "batched" / "run.json").read_text())["batch_methods"] is True
    # the flag changes timings, not answers: a run started one way resumes the other
    assert main([*args, "--out", str(tmp_path / "alone")], engine=tiny) == 0


def test_cli_end_to_end_writes_tables_and_plots(tmp_path, tiny):
    out = tmp_path / "run"
    argv = [
        "--datasets",
        "nq,musique,kv",
        "--num-docs",
        "4",
        "--num-docs",
        "musique=5",
        "--gold-positions",
        "first,last",
        "--num-questions",
        "1",
        "--methods",
        "full,snapkv,pyramidkv,streaming,h2o,random",
        "--budgets",
        "25%,64",
        "--max-new-tokens",
        "3",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv, engine=tiny) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == (2 + 1 + 2) * 11
    assert {r["method"] for r in rows} >= {"full", "snapkv@25%", "pyramidkv@64", "random@64"}
    for r in rows:
        if r["method"] == "full":
            assert r["hit_rate"] == 1.0 and r["identical_to_full"] == 1.0
        else:
            assert 0.0 <= r["hit_rate"] <= 1.0 and r["kept_tokens"] <= r["prompt_tokens"]
    cell_budgets = {(r["dataset"], r["gold_position"], r["budget"]) for r in rows if r["method"] == "snapkv@25%"}
    assert len(cell_budgets) == 5  # one integer budget per cell
    assert (out / "command.txt").read_text().startswith("python -m evals --datasets nq,musique,kv")
    summary = (out / "summary.md").read_text()
    assert "| nq | full |" in summary and "F1 - full F1 (paired)" in summary
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("dataset,num_docs,gold_position,method,n")
    for name in ("answer_f1_vs_n", "citation_f1_vs_n", "accuracy_vs_position", "hit_rate_vs_n", "fidelity_vs_bytes"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "snapkv@150%"], "percentage"),
        (["--methods", "magic@25%"], "KIND"),
        (["--datasets", "squad"], "unknown"),
        (["--gold-positions", "centre"], "unknown"),
        (["--num-docs", "musique=x"], "integers"),
    ],
)
def test_bad_options_are_clear_errors(argv, message, tiny, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path)], engine=tiny)


def test_model_folder_and_device_from_the_command_line(tmp_path, tiny):
    """`--model PATH --device cpu` loads the saved model and gives the rows the in-memory engine gives."""
    folder = tmp_path / "model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    argv = [
        "--datasets",
        "kv",
        "--num-docs",
        "5",
        "--gold-positions",
        "first,last",
        "--num-questions",
        "1",
        "--methods",
        "full,snapkv@48",
        "--max-new-tokens",
        "4",
        "--no-progress",
    ]
    assert main([*argv, "--out", str(tmp_path / "engine")], engine=tiny) == 0
    assert main([*argv, "--model", str(folder), "--device", "cpu", "--out", str(tmp_path / "folder")]) == 0
    settings = json.loads((tmp_path / "folder" / "run.json").read_text())
    assert settings["model"] == str(folder) and settings["device"] == "cpu"
    stable = [_stable(tmp_path / name) for name in ("engine", "folder")]
    assert len(stable[0]) == 4 and stable[0] == stable[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no/such-model-here", "--device", "cpu"], "--model/--device/--dtype: model: could not load"),
        (["--device", "cuda:99"], "--model/--device/--dtype: device: 'cuda:99'"),
        (["--dtype", "float13"], "--model/--device/--dtype: dtype: unknown"),
    ],
)
def test_unusable_model_device_or_dtype_is_one_clear_line(argv, message, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the local cache only
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        main([*argv, "--datasets", "kv", "--num-docs", "5", "--num-questions", "1", "--out", str(tmp_path)])
