"""The server's Prometheus metrics (``GET /metrics``), one registry per app."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


class Metrics:
    """Queue depth and running batch (read from the engine when scraped), token counters and the
    latency histograms. ``load()`` returns ``(queued, running)``."""

    def __init__(
        self,
        load: Callable[[], tuple[int, int]],
        prefix: Callable[[], Any] | None = None,
        documents: Callable[[], Any] | None = None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        # the engine's prefix cache (a PrefixStats) and document store (a DocStoreStats), read when scraped
        for stats, name, what in (
            (prefix, "prefix_cache", "the prefix cache"),
            (documents, "doc_store", "the document store"),
        ):
            if stats is None:
                continue
            for field, text in (
                ("hits", f"Prompts whose documents came from {what}"),
                ("misses", f"Prompts whose documents were not in {what} (then put there)"),
                ("tokens_saved", f"Prompt tokens taken from {what}, not prefilled"),
                ("evicted", f"Entries evicted from {what} (least recently used)"),
                ("entries", f"Entries held in {what}"),
                ("bytes_used", f"Bytes held by {what}"),
                ("max_bytes", f"The bound in bytes of {what} (0: disabled)"),
            ):
                Gauge(f"snapkv_rag_{name}_{field}", text, registry=r).set_function(
                    lambda field=field, stats=stats: getattr(stats(), field)
                )
        Gauge("snapkv_rag_queue_depth", "Requests waiting for a batch slot", registry=r).set_function(lambda: load()[0])
        Gauge("snapkv_rag_running_requests", "Requests in the running decode batch", registry=r).set_function(
            lambda: load()[1]
        )
        self.in_flight = Gauge(
            "snapkv_rag_requests_in_flight", "Requests admitted by the server and not finished", registry=r
        )
        self.requests = Counter(
            "snapkv_rag_requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("snapkv_rag_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.kept_tokens = Counter(
            "snapkv_rag_kept_prompt_tokens", "Prompt tokens kept in the compressed cache (mean over layers)", registry=r
        )
        self.generation_tokens = Counter(
            "snapkv_rag_generation_tokens", "Output tokens generated (rate() gives tokens/s)", registry=r
        )
        self.latency = Histogram(
            "snapkv_rag_request_duration_seconds",
            "Request latency, arrival to last token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "snapkv_rag_time_to_first_token_seconds",
            "Arrival to the first text piece",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def finished(self, endpoint: str, result, seconds: float) -> None:
        """A request answered in full: its tokens and latency."""
        c = result.compression
        self.prompt_tokens.inc(c.prompt_tokens)
        self.kept_tokens.inc(sum(c.kept_tokens) / len(c.kept_tokens) if c.kept_tokens else c.prompt_tokens)
        self.generation_tokens.inc(result.usage.completion_tokens)
        self.latency.labels(endpoint).observe(seconds)
