"""The command line: document collection, path validation, and a real answer."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from snapkv_rag.cli import in_flag_words, main
from snapkv_rag.request.files import collect_documents


def test_documents_from_jsonl_json_text_files_and_folders(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"title": "A", "text": "alpha"}\n"beta"\n\n')
    (tmp_path / "b.json").write_text(json.dumps([{"text": "gamma", "id": "g"}]))
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "2.md").write_text("delta")
    (folder / "1.txt").write_text("epsilon")
    (folder / "skip.bin").write_bytes(b"\0")
    collected = collect_documents([str(tmp_path / "a.jsonl"), str(tmp_path / "b.json"), str(folder)])
    docs = collected.documents
    assert [d.text for d in docs] == ["alpha", "beta", "gamma", "epsilon", "delta"]
    assert docs[0].title == "A" and docs[2].id == "g" and docs[3].title == "1"
    assert [p.name for p in collected.skipped] == ["skip.bin"]  # reported, not dropped in silence


@pytest.mark.parametrize(
    "setup,words",
    [
        (lambda p: str(p / "missing.jsonl"), "does not exist"),
        (lambda p: (p / "x.pdf").write_bytes(b"%PDF") and str(p / "x.pdf"), "is not one of"),
        (
            lambda p: (p / "bad.jsonl").write_text('"a"\n\n{oops\n') and str(p / "bad.jsonl"),
            "bad.jsonl, line 3: not valid JSON",
        ),
        (
            lambda p: (p / "bad.json").write_text('[\n"a",\n]') and str(p / "bad.json"),
            "bad.json, line 3: not valid JSON",
        ),
        (lambda p: (p / "obj.json").write_text('{"text": "x"}') and str(p / "obj.json"), "JSON list"),
        (lambda p: (p / "num.jsonl").write_text('"a"\n3\n') and str(p / "num.jsonl"), "num.jsonl, line 2: neither"),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no"),
        (lambda p: (p / "latin.txt").write_bytes("caf\xe9".encode("latin-1")) and str(p / "latin.txt"), "UTF-8"),
    ],
)
def test_bad_paths_give_one_line_and_status_2(tmp_path, capsys, setup, words):
    path = setup(tmp_path)
    assert main(["ask", "question?", "--docs", path]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """The installed entry point, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "snapkv_rag.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--budget", "-5"], "--budget: must be an integer larger than --window 32, got -5"),
        (["--budget", "16"], "--budget: must be an integer larger than --window 32, got 16"),
        (["--window", "0"], "--window: must be a positive integer, got 0"),
        (["--kernel", "4"], "--kernel: must be a positive odd integer, got 4"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--budget", "150%"], "argument --budget: 150%: a share of the prompt must be in (0%, 100%]"),
        (
            ["--budget", "half"],
            "argument --budget: half: expected a number of tokens (512) or a share of the prompt (50%)",
        ),
    ],
)
def test_cli_errors_speak_in_flags(tmp_path, flags, words):
    (tmp_path / "a.txt").write_text("alpha")
    out = _cli("ask", "q?", "--docs", str(tmp_path / "a.txt"), *flags)
    assert out.returncode == 2 and out.stderr.strip().endswith(words), out.stderr
    assert "max_capacity_prompt" not in out.stderr and "window_size" not in out.stderr


def test_engine_messages_are_put_in_flag_words():
    assert (
        in_flag_words("device: 'cuda:9' was asked, use device='cpu'")
        == "--device: 'cuda:9' was asked, use --device cpu"
    )
    assert in_flag_words("max_new_tokens: must be a positive integer") == "--max-new-tokens: must be a positive integer"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_asked_where_there_is_none(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    out = _cli("ask", "q?", "--docs", str(tmp_path / "a.txt"), "--device", "cuda")
    assert out.returncode == 2 and "--device cuda: no CUDA device is available here; use --device cpu" in out.stderr


def test_overridden_and_skipped_input_is_said_and_quiet_silences_it(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha")
    (folder / "photo.png").write_bytes(b"\x89PNG")
    args = ["ask", "q?", "--docs", str(folder), "--full", "--budget", "128", "--max-new-tokens", "0"]
    out = _cli(*args)  # fails on --max-new-tokens only after the notes, before loading any model
    assert "note: --docs: skipped 1 file(s) that are not .jsonl, .json, .txt, .md: photo.png" in out.stderr
    assert "note: --full keeps the whole cache: --budget 128 ignored" in out.stderr
    quiet = _cli(*args, "--quiet")
    assert "note" not in quiet.stderr and "--max-new-tokens 0" in quiet.stderr


def test_help_is_fast_because_nothing_heavy_is_imported():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, snapkv_rag, snapkv_rag.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
    helped = _cli("--help")
    assert helped.returncode == 0 and "``" not in helped.stdout and "--verbose" in _cli("ask", "--help").stdout


def test_budget_as_a_share_reaches_the_engine(tmp_path, tiny_model, tokenizer):
    tiny_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "a.txt").write_text(" ".join(f"The river number {i} lies north." for i in range(80)))
    out = _cli(
        "ask",
        "Which river?",
        "--docs",
        str(tmp_path / "a.txt"),
        "--model",
        str(tmp_path / "model"),
        "--budget",
        "25%",
        "--device",
        "cpu",
        "--json",
        "--max-new-tokens",
        "2",
    )
    assert out.returncode == 0, out.stderr
    compression = json.loads(out.stdout)["compression"]
    assert compression["kept_tokens"][0] == -(-compression["prompt_tokens"] // 4) > 128


def test_budget_beyond_the_context_window_is_refused(tmp_path, tiny_model, tokenizer):
    tiny_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "a.txt").write_text("alpha")
    out = _cli(
        "ask",
        "q?",
        "--docs",
        str(tmp_path / "a.txt"),
        "--model",
        str(tmp_path / "model"),
        "--budget",
        "10000000000",
        "--device",
        "cpu",
    )
    assert out.returncode == 2
    assert "--budget 10000000000: larger than the model's context window (8192 tokens)" in out.stderr
    assert "Loading weights" not in out.stderr  # transformers' bars are off in the CLI


@pytest.mark.model
def test_ask_answers_with_citations_and_figures(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        '{"title": "Mount Fuji", "text": "Mount Fuji is the highest mountain in Japan."}\n'
        '{"title": "Lake Biwa", "text": "Lake Biwa is the largest lake in Japan."}\n'
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapkv_rag.cli",
            "ask",
            "What is the highest mountain in Japan?",
            "--docs",
            str(tmp_path / "docs.jsonl"),
            "--json",
            "--max-new-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "fuji" in result["text"].lower()
    assert result["usage"]["prompt_tokens"] > 20 and result["compression"]["method"] == "lookahead"  # the default
    assert result["compression"]["ratio"] == 1.0  # under the default's floor: kept whole


@pytest.mark.parametrize(
    "flags,words",
    [
        (
            ["--docs", "1"],
            "--docs 1: the demo bundles 30 passages per question (the gold one and 29 others); give 2 to 30",
        ),
        (["--docs", "31"], "--docs 31: the demo bundles 30 passages per question"),
        (["--question", "no such thing"], "--question 'no such thing': matches none of the bundled questions"),
        (["--questions", "0"], "--questions 0: must be at least 1"),
        (["--budget", "16"], "--budget: must be an integer larger than --window 32, got 16"),
        (["--method", "kvzip", "--kernel", "4"], "--kernel: must be a positive odd integer, got 4"),
    ],
)
def test_demo_usage_errors_name_the_flag_before_any_model_loads(capsys, flags, words):
    assert main(["demo", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Loading" not in err


def test_demo_question_and_questions_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["demo", "--question", "president", "--questions", "2"])
    assert stopped.value.code == 2
    assert "argument --questions: not allowed with argument --question" in capsys.readouterr().err


def test_demo_prompts_are_the_evals_nq_prompts():
    """The bundled passages rebuild, for every --docs N, the prompt the evals build for that NQ
    question at N documents, gold in the middle; and every passage names its source data set."""
    pytest.importorskip("rank_bm25")
    from evals.datasets import nq_examples
    from snapkv_rag.cli import demo_documents, demo_records

    records = demo_records()
    assert 1 <= len(records) <= 5
    sizes = (2, 5, 20, 30)
    examples = {(e.question_id, e.num_docs): e for e in nq_examples(300, sizes, ["middle"], 0)}  # the script's sample
    for record in records:
        assert len(record["distractors"]) == 29
        assert {d["source"] for d in [record["gold"], *record["distractors"]]} <= {
            "nq-open",
            "musique",
            "hotpotqa",
            "2wikimultihopqa",
        }
        for n in sizes:
            example = examples[(str(record["nq_open_line"] - 1), n)]
            docs, gold = demo_documents(record, n)
            assert example.question == record["question"] and (gold,) == example.gold
            assert docs == [{"title": d["title"], "text": d["text"]} for d in example.documents]


def _figures(stdout: str) -> dict[str, list[str]]:
    """The demo's table rows: name -> its cells (full cache, compressed, ratio)."""
    rows = {}
    for name in ("kept tokens per layer", "KV cache", "decode", "time to first token"):
        line = next(line for line in stdout.splitlines() if line.strip().startswith(name))
        rows[name] = [cell for cell in re.split(r"\s{2,}", line.strip()[len(name) :].strip())]
    return rows


def test_demo_on_a_tiny_model_prints_both_caches_and_their_ratios(tmp_path, tiny_model, tokenizer):
    tiny_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--device", "cpu", "--docs", "6", "--max-new-tokens", "3"]
    out = _cli("demo", *args, "--method", "snapkv", "--budget", "40%", "--question", "PRESIDENT")
    assert out.returncode == 0, out.stderr
    assert "Q: who is the president of usa right now" in out.stdout and "6 retrieved NQ passages" in out.stdout
    assert "  full cache " in out.stdout and "  snapkv@40% " in out.stdout and out.stdout.count("cites: ") == 2
    rows = _figures(out.stdout)
    full, kept, ratio = rows["kept tokens per layer"]
    assert int(kept.replace(",", "")) < int(full.replace(",", "")) and ratio == "0.40x"
    assert rows["KV cache"][2] == "0.40x" and rows["KV cache"][0].endswith("MiB")
    assert all(re.fullmatch(r"\d+\.\d\dx|-", rows[name][2]) for name in ("decode", "time to first token"))
    assert "Why" not in out.stdout  # the eval's numbers are said of the default only
    said = " ".join(out.stdout.split())  # the prose is wrapped
    assert 'speed gains show on a GPU and with longer prompts: docs/benchmarks.md, "Performance"' in said
    assert "plots/fidelity_vs_bytes.png" in said and "snapkv-rag eval --num-docs 20" in said


@pytest.mark.model
def test_demo_default_shows_what_compression_keeps():
    """``snapkv-rag demo`` as a user first runs it: the embedded model, 20 passages, the full cache
    against lookahead SnapKV at 50%."""
    out = _cli("demo", timeout=300)
    assert out.returncode == 0, out.stderr
    prompt = int(re.search(r"20 retrieved NQ passages, ([\d,]+) prompt tokens", out.stdout)[1].replace(",", ""))
    assert prompt > 2000
    rows = _figures(out.stdout)
    full, kept, ratio = rows["kept tokens per layer"]
    assert int(full.replace(",", "")) == prompt and int(kept.replace(",", "")) < prompt and ratio == "0.50x"
    assert rows["KV cache"][2] == "0.50x"
    answers = re.findall(r"^  (full cache|lookahead@50%) +'(.*)'", out.stdout, re.M)
    assert [name for name, _ in answers] == ["full cache", "lookahead@50%"] and all(text for _, text in answers)
    assert "Why lookahead@50%: " in out.stdout and "0.81" in out.stdout
