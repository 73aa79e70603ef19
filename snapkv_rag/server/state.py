"""The per-app state the routes share, one :class:`ServerState` on ``app.state.server``: how many
requests are in flight, whether new ones are still admitted, when the ones still running after a
shutdown's grace period are cancelled, and the app's metrics. One object per app (not module
globals), so that several apps (tests, Ray Serve replicas) in one process keep apart."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .metrics import Metrics


@dataclass
class ServerState:
    """What every request of one app reads or changes; ``shutdown`` is what a server's signal
    handler calls (``app.state.shutdown``)."""

    metrics: Metrics
    in_flight: int = 0
    """Requests admitted and not yet released (at most ``max_batch + max_queue``)."""
    streams: int = 0
    """Of those, the streamed ones (at most ``max_streams``)."""
    accepting: bool = True
    cancel_at: float | None = None
    """``time.monotonic()`` after which running requests are cancelled (``None``: not shutting down)."""

    def shutdown(self, grace_s: float) -> None:
        """Stop admitting; requests still running ``grace_s`` seconds from now are cancelled at
        their next token (a stream ends with an error event, a plain request gets 503)."""
        self.accepting = False
        self.cancel_at = time.monotonic() + grace_s

    def cancelled(self) -> bool:
        """Whether the grace period of a shutdown is over."""
        return self.cancel_at is not None and time.monotonic() >= self.cancel_at

    def __getitem__(self, name: str):
        """Reads by name, as from the dict this state once was (``app.state.status["in_flight"]``)."""
        return getattr(self, name)


class Ticket:
    """One admitted request's place among those in flight. The answer releases it as soon as the
    engine is done with the request, before the last bytes go out, so that a client that reads
    its answer and asks again finds the place free; releasing twice is harmless."""

    def __init__(self, server: ServerState):
        self.server, self.released, self.stream = server, False, False
        self.arrived = time.perf_counter()  # the start of the request's latency and time to first token
        server.in_flight += 1
        server.metrics.in_flight.set(server.in_flight)

    def streamed(self) -> None:
        """Counts this request among the open streams (released with it)."""
        if not self.stream:
            self.stream = True
            self.server.streams += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.server.streams -= self.stream
            self.server.in_flight -= 1
            self.server.metrics.in_flight.set(self.server.in_flight)
