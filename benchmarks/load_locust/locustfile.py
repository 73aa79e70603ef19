"""Locust users for ``run.py``: the mixed traffic of an OpenAI-compatible RAG server.

Each user draws, by weight: a chat answer, a completion, a streamed chat answer read to its end, a
stream the client cuts after a chunk or two (a disconnect), a structured answer
(``response_format: json_schema``), a question over a stored document set (``snapkv`` key-norm:
the server's compressed document store) and a hostile request (bad JSON, a body over the limit,
too many documents, a prompt over ``--max-prompt-tokens``, a wrong field type, another model, a
wrong API key). Every answered request of the first kinds asks one of the plan's prompts, whose
sequential greedy answer ``run.py`` fetched before the load: an answer that differs is a failure
named ``wrong answer``; a hostile request must get its 4xx; any 5xx is a failure named by its status.

The plan comes from ``$SNAPKV_LOCUST_PLAN`` (JSON written by ``run.py``); at the end the counts
this file keeps beyond Locust's own (statuses by kind, wrong answers with a few examples, answers
checked, completion tokens) go to ``$SNAPKV_LOCUST_COUNTS``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter

import requests
from locust import HttpUser, between, events, task

PLAN = json.loads(open(os.environ["SNAPKV_LOCUST_PLAN"]).read()) if os.environ.get("SNAPKV_LOCUST_PLAN") else {}
COUNTS = {"statuses": {}, "checked": Counter(), "wrong": [], "wrong_count": 0, "completion_tokens": 0}
HOSTILE = tuple(PLAN.get("hostile", {}))  # kind: the status it must get


def _count(kind: str, status) -> None:
    COUNTS["statuses"].setdefault(kind, Counter())[str(status)] += 1


class RagUser(HttpUser):
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.http = requests.Session()  # timed here: a stream's time is its whole answer
        self.http.headers["Authorization"] = f"Bearer {PLAN['api_key']}"
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.http.close()

    # ---------------------------------------------------------------- one request, timed and judged
    def _fire(self, name: str, started: float, length: int, failure: str | None) -> None:
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=Exception(failure) if failure else None,
            context={},
        )

    def _judge(self, kind: str, status, expected: int = 200) -> str | None:
        _count(kind, status)
        if isinstance(status, int) and status >= 500:
            return f"{status} server error"
        if status != expected and not (expected == 200 and status == 429):
            return f"status {status}, expected {expected}"
        return None

    def _check(self, kind: str, prompt: dict, text: str) -> str | None:
        COUNTS["checked"][kind] += 1
        if text == prompt["answer"]:
            return None
        COUNTS["wrong_count"] += 1
        if len(COUNTS["wrong"]) < 10:
            COUNTS["wrong"].append({"kind": kind, "got": text[:200], "expected": prompt["answer"][:200]})
        return "wrong answer"

    def _post(self, kind: str, prompt: dict) -> None:
        started, failure, length = time.perf_counter(), None, 0
        try:
            reply = self.http.post(self.host + prompt["path"], json=prompt["body"], timeout=600)
            length = len(reply.content)
            failure = self._judge(kind, reply.status_code)
            if failure is None and reply.status_code == 200:
                body = reply.json()
                COUNTS["completion_tokens"] += body["usage"]["completion_tokens"]
                choice = body["choices"][0]
                failure = self._check(
                    kind, prompt, choice["message"]["content"] if "message" in choice else choice["text"]
                )
        except (requests.RequestException, ValueError, KeyError) as error:
            _count(kind, type(error).__name__)
            failure = f"{type(error).__name__}"
        self._fire(kind, started, length, failure)

    def _stream(self, kind: str, prompt: dict, cut_after: int | None) -> None:
        started, failure, text, chunks, finished = time.perf_counter(), None, "", 0, False
        body = {**prompt["body"], "stream": True, "stream_options": {"include_usage": True}}
        try:
            with self.http.post(self.host + prompt["path"], json=body, timeout=600, stream=True) as reply:
                failure = self._judge(kind, reply.status_code)
                if failure is None and reply.status_code == 200:
                    for line in reply.iter_lines(decode_unicode=True):
                        if not line or not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            finished = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            failure = f"stream error event: {event['error'].get('code')}"
                            break
                        if event.get("usage"):
                            COUNTS["completion_tokens"] += event["usage"]["completion_tokens"]
                        for choice in event.get("choices") or []:
                            text += (choice.get("delta") or {}).get("content") or ""
                            chunks += 1
                        if cut_after is not None and chunks >= cut_after:
                            break  # the client goes away mid-answer: the connection is closed
            if failure is None and reply.status_code == 200 and cut_after is None:
                failure = self._check(kind, prompt, text) if finished else "stream ended without [DONE]"
        except (requests.RequestException, ValueError, KeyError) as error:
            _count(kind, type(error).__name__)
            failure = f"{type(error).__name__}"
        self._fire(kind, started, len(text), failure)

    # ---------------------------------------------------------------- the mix
    def _prompt(self, pool: str) -> dict:
        return self.rng.choice(PLAN[pool])

    @task(4)
    def chat(self) -> None:
        self._post("chat", self._prompt("chat"))

    @task(2)
    def completion(self) -> None:
        self._post("completion", self._prompt("completion"))

    @task(4)
    def stream(self) -> None:
        self._stream("stream", self._prompt("chat"), None)

    @task(2)
    def stream_cut(self) -> None:
        self._stream("stream_cut", self._prompt("chat"), self.rng.randint(1, 2))

    @task(2)
    def structured(self) -> None:
        self._post("structured", self._prompt("structured"))

    @task(3)
    def doc_store(self) -> None:
        self._post("doc_store", self._prompt("doc_store"))

    @task(3)
    def hostile(self) -> None:
        kind = self.rng.choice(HOSTILE)
        name, started, failure = f"hostile:{kind}", time.perf_counter(), None
        chat = PLAN["chat"][0]["body"]
        url, headers = self.host + "/v1/chat/completions", {"Content-Type": "application/json"}
        body: bytes | dict = {**chat}
        if kind == "bad_json":
            body = b'{"model": "x", "messages": ['
        elif kind == "too_large":
            body = {**chat, "documents": [{"title": "big", "text": "x" * (PLAN["max_body_bytes"] + 1000)}]}
        elif kind == "too_many_documents":
            body = {**chat, "documents": ["a document"] * (PLAN["max_documents"] + 1)}
        elif kind == "over_prompt_limit":
            body = {**chat, "documents": [{"title": "long", "text": "river " * (2 * PLAN["max_prompt_tokens"])}]}
        elif kind == "bad_type":
            body = {**chat, "max_tokens": "ten"}
        elif kind == "other_model":
            body = {**chat, "model": "gpt-4o"}
        elif kind == "bad_key":
            headers["Authorization"] = "Bearer wrong"
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = self.http.post(url, data=data, headers=headers, timeout=600)
            failure = self._judge(name, reply.status_code, PLAN["hostile"][kind])
            if failure is None and reply.json()["error"]["message"] == "":
                failure = "an error without a message"
        except (requests.RequestException, ValueError, KeyError) as error:
            _count(name, type(error).__name__)
            failure = f"{type(error).__name__}"
        self._fire(name, started, 0, failure)


@events.test_stop.add_listener
def _write_counts(environment, **kwargs) -> None:
    path = os.environ.get("SNAPKV_LOCUST_COUNTS")
    if path:
        out = {**COUNTS, "statuses": {k: dict(v) for k, v in COUNTS["statuses"].items()}}
        out["checked"] = dict(COUNTS["checked"])
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
