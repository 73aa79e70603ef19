"""``--replicas``: two CPU engines as Ray Serve replicas behind the same OpenAI routes, on one
local Ray cluster for the module (Ray's start-up is slow). Concurrent requests reach both replicas
(each response names its replica) and get one engine's answers; the app's key, limits and errors
hold behind Ray's proxy; a killed replica is replaced, and the one request it had in flight gets a
500 from Ray's proxy, which the ``openai`` client retries: no request is lost. A replica killed
mid-stream breaks its own streams where the client sees it (Ray's proxy closes the connection
before the chunked body's end: ``httpx.RemoteProtocolError``, which the ``openai`` client raises),
never a clean end without ``[DONE]`` nor a hang; the other replica's streams finish."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_testing import free_port, sse_events

serve = pytest.importorskip("ray.serve", reason="the ray extra (ray[serve]) is not installed")
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.heavy  # Ray's start-up and a replica's replacement: minutes
KEY = {"Authorization": "Bearer secret"}
QUESTIONS = [f"Which river is number {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tiny_model, tokenizer):
    from snapkv_rag.server import ray_local
    from snapkv_rag.server.protocol import ServerSettings
    from snapkv_rag.server.replicas import application

    ray_local.start(num_cpus=4, log_to_driver=False)  # as serve --replicas starts it: Ray's ports on loopback
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"model": tiny_model, "tokenizer": tokenizer, "max_new_tokens": 12}
        serve.run(
            application(engine, ServerSettings("tiny", api_key="secret", max_body_bytes=4000), 2),
            name="snapkv-rag",
            route_prefix="/",
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(url: str, question: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        headers=KEY,
        timeout=120,
        json={"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 6},
    )


def replica_names() -> set[str]:
    return {
        a["name"].rsplit("#", 1)[1]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::snapkv-rag")
    }


def running() -> int:
    return serve.status().applications["snapkv-rag"].deployments["snapkv-rag"].replica_states.get("RUNNING", 0)


def test_concurrent_requests_reach_both_replicas_with_one_engines_answers(cluster, tiny_engine):
    """Ray's router picks the less busy of two replicas by the queue lengths it last saw: on a slow
    machine one wave of 8 can all land on one replica, so waves go on (at most 4) until both have
    answered; every answer of every wave is checked."""
    expected = [tiny_engine.chat([{"role": "user", "content": q}], max_new_tokens=6).text for q in QUESTIONS]
    seen: set[str] = set()
    for _ in range(4):
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda q: ask(cluster, q), QUESTIONS))
        assert [r.status_code for r in replies] == [200] * 8
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected
        seen |= {r.headers["x-snapkv-replica"] for r in replies}
        if len(seen) == 2:
            break
    assert seen == replica_names() and len(replica_names()) == 2


def test_key_limits_and_errors_hold_behind_the_proxy(cluster):
    assert httpx.get(cluster + "/health").status_code == 200
    assert httpx.get(cluster + "/v1/models").status_code == 401
    assert httpx.post(cluster + "/v1/chat/completions", headers=KEY, content="x" * 5000).status_code == 413
    bad = httpx.post(cluster + "/v1/chat/completions", headers=KEY, json={"model": "tiny", "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    metrics = httpx.get(cluster + "/metrics", headers=KEY)
    assert "snapkv_rag_requests_total" in metrics.text and metrics.headers["x-snapkv-replica"] in replica_names()


def test_a_killed_replica_is_replaced_and_the_openai_client_loses_no_request(cluster):
    statuses: list[int] = []
    client = openai.OpenAI(
        base_url=cluster + "/v1",
        api_key="secret",
        max_retries=2,
        http_client=httpx.Client(
            timeout=120, event_hooks={"response": [lambda response: statuses.append(response.status_code)]}
        ),
    )
    stop, answers, failures = threading.Event(), [], []

    def keep_asking(k: int) -> None:
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(
                    model="tiny", max_tokens=12, messages=[{"role": "user", "content": QUESTIONS[k]}]
                )
                answers.append(reply.choices[0].message.content)
            except openai.OpenAIError as error:
                failures.append(error)

    before = replica_names()
    threads = [threading.Thread(target=keep_asking, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::snapkv-rag#snapkv-rag#{victim}", namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (len(replica_names() - before) == 1 and running() == 2):
        time.sleep(1)
    time.sleep(2)
    stop.set()
    for thread in threads:
        thread.join(120)
    assert failures == [] and len(answers) > 8
    assert set(statuses) <= {200, 500}  # a 500 only for a request the killed replica held: retried
    new = replica_names() - before
    assert len(new) == 1 and victim not in replica_names()
    seen: set[str] = set()
    for _ in range(4):  # the router may send a whole wave to one replica (see the test above): waves until both answer
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda q: ask(cluster, q), QUESTIONS))
        assert all(r.status_code == 200 for r in replies)
        seen |= {r.headers["x-snapkv-replica"] for r in replies}
        if new <= seen:
            break
    assert new <= seen  # the replacement serves


def open_stream(url: str, k: int, outcome: dict) -> None:
    """One long stream (EOS ignored): its replica, its events as they come, and how it ended:
    ``done`` ([DONE] read), ``error`` (an error event or a broken stream), or ``ended`` (closed
    cleanly without [DONE]: a truncated success, which must never happen)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", headers=KEY, json=body, timeout=60) as reply:
            outcome["replica"] = reply.headers.get("x-snapkv-replica")
            for event in sse_events(reply):
                outcome.setdefault("events", []).append(event)
                if event == "[DONE]":
                    outcome["end"] = "done"
                elif "error" in event:
                    outcome["end"] = "error"
            outcome.setdefault("end", "ended")
    except httpx.TransportError as error:  # the stream broken off: the client sees it as an error
        outcome["end"], outcome["error"] = "error", repr(error)


def test_a_replica_killed_mid_stream_breaks_only_its_streams_visibly_and_is_replaced(cluster):
    """Streams on both replicas; the replica of the first one is killed once every stream has
    chunks: each of its streams ends in an error the client sees (never a clean end without
    [DONE], never a hang), the other replica's streams finish with [DONE], a replacement comes up
    and the next requests are answered."""
    deadline = time.monotonic() + 120
    for _ in range(3):  # the router may put every stream on one replica: then try again
        outcomes = [{} for _ in range(6)]
        threads = [threading.Thread(target=open_stream, args=(cluster, k, o)) for k, o in enumerate(outcomes)]
        for thread in threads:
            thread.start()
        while time.monotonic() < deadline and not all(len(o.get("events", ())) >= 3 or "end" in o for o in outcomes):
            time.sleep(0.05)
        if len({o.get("replica") for o in outcomes} - {None}) == 2:
            break
        for thread in threads:
            thread.join(90)
    replicas = {o["replica"] for o in outcomes}
    assert len(replicas) == 2, "the streams never reached both replicas"
    victim = outcomes[0]["replica"]
    before = replica_names()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::snapkv-rag#snapkv-rag#{victim}", namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(max(1, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for outcome in outcomes:
        if outcome["replica"] == victim:
            assert outcome["end"] == "error" and "[DONE]" not in outcome["events"], outcome.get("error")
        else:
            assert outcome["end"] == "done", outcome
            finish = [e for e in outcome["events"] if e != "[DONE]" and e["choices"][0]["finish_reason"]]
            assert finish[-1]["choices"][0]["finish_reason"] == "length"
    while time.monotonic() < deadline and not (len(replica_names() - before) == 1 and running() == 2):
        time.sleep(1)
    assert len(replica_names() - before) == 1 and victim not in replica_names() and running() == 2
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda q: ask(cluster, q), QUESTIONS))
    assert [r.status_code for r in replies] == [200] * 8
