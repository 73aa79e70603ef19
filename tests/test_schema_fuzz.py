"""Schema fuzzing: schemathesis (the ``st`` command operators run) over the server's own
``/openapi.json``, against a live server on 127.0.0.1 and the tiny random-weight model: every route
and method, with the API key and without it, bounded in examples and time. Every check but
``positive_data_acceptance`` (a body the schema allows can still be a 400 the schema cannot state:
a prompt over the context window, a method setting out of range, tools that name each other):
no 5xx, every status and content type declared, every body matching its declared schema, every
schema-invalid body refused with a 4xx, and no route reachable without the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_testing import running_server
from snapkv_testing import tiny_llama

from snapkv_rag import SnapKVLLM

pytest.importorskip("schemathesis", reason="the test extra's schemathesis is not installed")

KEY = "fuzz-key"
CHECKS = "all"
EXCLUDED = "positive_data_acceptance"


def st_command() -> list[str]:
    script = Path(sys.executable).with_name("st")
    return [str(script)] if script.exists() else [shutil.which("st") or "st"]


@pytest.fixture(scope="module")
def fuzzed_server(tokenizer):
    model = tiny_llama(len(tokenizer), max_position_embeddings=112)
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=4)
    with running_server(llm, api_key=KEY, max_documents=4, max_body_bytes=64_000) as (url, app):
        yield url, app
    llm.close()


def fuzz(url: str, schema: Path, report: Path, *options: str, timeout: float = 600) -> dict:
    command = [
        *st_command(),
        "run",
        str(schema),
        "--url",
        url,
        "--checks",
        CHECKS,
        "--exclude-checks",
        EXCLUDED,
        "--seed",
        "48",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--max-response-time",
        "30",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        *options,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=report.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    return json.loads(report.read_text())


def test_the_schema_needs_the_key_like_every_route_but_health(fuzzed_server):
    url, _ = fuzzed_server
    assert httpx.get(url + "/openapi.json").status_code == 401
    schema = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert set(schema["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    assert schema["security"] == [{"bearer": []}] and schema["paths"]["/health"]["get"]["security"] == []


@pytest.mark.heavy  # about 70 s of fuzzing on 2 cores
def test_schemathesis_finds_nothing_with_and_without_the_key(fuzzed_server, tmp_path):
    """Both runs pass every check; the keyed one reaches every operation and gets answers (2xx) and
    refusals (4xx) on both generation routes; the one without the key gets 401 everywhere but
    /health (schemathesis's ignored_auth check)."""
    url, app = fuzzed_server
    schema = tmp_path / "openapi.json"
    schema.write_text(httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).text)
    keyed = fuzz(url, schema, tmp_path / "keyed.json", "-H", f"Authorization: Bearer {KEY}", "--max-examples", "15")
    anonymous = fuzz(url, schema, tmp_path / "anonymous.json", "--max-examples", "5")
    for name, report in (("with the key", keyed), ("without it", anonymous)):
        cases = report["test_cases"]
        print(
            f"schemathesis {name}: {cases['generated']} cases in {report['running_time']:.0f} s, "
            f"{cases['with_failures']} with failures, {len(report['errors'])} errors"
        )
        assert cases["with_failures"] == 0 and report["failures"] == [] and report["errors"] == []
        assert report["operations"]["tested"] == 5
    rates = keyed["valid_rates"]
    for route in ("POST /v1/chat/completions", "POST /v1/completions"):
        seen = [phase for phase in rates[route].values()]
        assert sum(p["accepted"] for p in seen) > 10 and sum(p["rejected"] for p in seen) > 10, rates[route]
    assert app.state.server.in_flight == 0 and app.state.server.streams == 0  # nothing left holding a place
