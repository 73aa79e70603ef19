"""--ray on a local Ray with 2 CPU actors: the table equals the single-process one on the same
prompts, a killed actor process loses and doubles no row, a rerun resumes; Ray is imported only
when --ray is given."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from evals.__main__ import main
from evals.tests.tiny import tiny_engine

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--datasets",
    "kv,needle,lines",
    "--num-docs",
    "kv=5,8",
    "--num-docs",
    "needle=200",
    "--num-docs",
    "lines=6",
    "--gold-positions",
    "every",
    "--depths",
    "0,100",
    "--num-questions",
    "2",
    "--methods",
    "full,snapkv@64,streaming@50%",
    "--max-new-tokens",
    "4",
    "--no-progress",
]
TIMING = {"prefill_s", "decode_ms_per_token", "selection_ms"}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def _table(out: Path) -> list[dict]:
    with (out / "summary.csv").open() as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


@pytest.fixture
def bounded():
    """Fail, rather than hang the suite, if the Ray run takes over 10 minutes (2 minutes on 2 busy cores)."""

    def stop(signum, frame):
        raise TimeoutError("the Ray test ran over 600 s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(600)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.heavy
def test_ray_run_equals_single_process_through_an_actor_kill_and_a_resume(tmp_path, tiny, monkeypatch, capsys, bounded):
    pytest.importorskip("ray")
    from evals import distributed

    single, ray_out = tmp_path / "single", tmp_path / "ray"
    assert main([*ARGS, "--out", str(single)], engine=tiny) == 0
    reference = _rows(single)
    assert len(reference) == (2 * (5 + 8) + 2 * 2 + 2 * 2) * 3  # the needles sized by the actors' token counts
    # a run killed after 4 prompts (and a torn line): the Ray run resumes it
    ray_out.mkdir()
    lines = (single / "rows.jsonl").read_text().splitlines(keepends=True)
    (ray_out / "rows.jsonl").write_text("".join(lines[:12]) + lines[12][:30])
    (ray_out / "run.json").write_text((single / "run.json").read_text())

    killed: dict[str, int] = {}
    run = distributed.RayPool.run

    def run_and_kill_an_actor(self, *args, **kwargs):
        def on_result(k: int) -> None:
            if k == 3 and not killed:  # mid-run: prompts are queued on both actors
                killed["pid"] = self.infos[0]["pid"]
                os.kill(killed["pid"], signal.SIGKILL)

        path = run(self, *args, on_result=on_result, **kwargs)
        killed["after"] = self.pids()[0]
        return path

    monkeypatch.setattr(distributed.RayPool, "run", run_and_kill_an_actor)
    assert main([*ARGS, "--ray", "--ray-workers", "2", "--out", str(ray_out)], make_engine=tiny_engine) == 0
    assert killed["pid"] != killed["after"]  # the actor's process died and Ray restarted it
    assert "died running" in capsys.readouterr().err  # its prompts went out again

    rows = _rows(ray_out)
    keys = [(r["example_id"], r["method"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(reference)  # none lost, none doubled
    assert [(r["example_id"], r["method"]) for r in reference] == keys  # written in the single run's order
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert [strip(r) for r in rows] == [strip(r) for r in reference]
    assert _table(ray_out) == _table(single)


def test_ray_is_imported_only_with_the_ray_option(tmp_path):
    code = (
        "import sys; from evals.__main__ import main; from evals.tests.tiny import tiny_engine; "
        f"main(['--datasets', 'kv', '--num-docs', '3', '--gold-positions', 'first', '--num-questions', '1', "
        f"'--methods', 'full', '--max-new-tokens', '1', '--no-progress', '--out', {str(tmp_path)!r}], "
        "engine=tiny_engine()); print('ray imported:', 'ray' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ray imported: False" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ray-workers", "2"], "only with --ray"),
        (["--ray", "--ray-workers", "0"], "must be >= 1"),
        (["--ray", "--measure-sharing", "2"], "not with --ray"),
    ],
)
def test_bad_ray_options_are_clear(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path)])


def test_ray_auto_without_a_cluster_says_so_in_one_line(tmp_path):
    """No cluster to join (an empty Ray temp folder hides any cluster this machine runs): one line
    naming the problem and both ways out, no traceback, a failing exit status."""
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "evals", *ARGS, "--ray", "auto", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "RAY_TMPDIR": str(tmp_path / "ray"), "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("--ray auto: found no Ray cluster"), done.stderr[-2000:]
    assert "bare --ray to start Ray here" in last and "ray start --head" in last
