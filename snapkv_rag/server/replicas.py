"""``snapkv-rag serve --replicas K``: K engines as Ray Serve replicas behind the same OpenAI routes.

Each replica is one :class:`~snapkv_rag.engine.SnapKVLLM` and the very app of
:func:`snapkv_rag.server.app.create_app` over it (API key, 413/400/429, streaming, cancel on
disconnect: all unchanged), built in the replica by Ray Serve's late-bound ingress. Ray Serve's
proxy takes the HTTP requests and its default router (power of two choices: of two replicas drawn
at random, the one with fewer requests in flight) picks the replica. Every response says which
replica answered in the ``x-snapkv-replica`` header.

A replica admits at most ``max_batch + max_queue`` requests (then 429, as one server does); Ray
sends it at most one more than that, so the 429 is the replica's own. ``GET /metrics`` is the
metrics of the replica that answers the scrape (named in the header): the ``snapkv_rag_*``
figures are per replica, not summed over them; Ray's own per-replica request metrics are on
Ray's metrics port.

As an application of its own: ``serve.run(application({"model": ...}, ServerSettings("name"), 2))``.
``ray[serve]`` is imported here only, when replicas are asked for.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from . import ray_local
from .protocol import ServerSettings

REPLICA_HEADER = b"x-snapkv-replica"
log = logging.getLogger("snapkv_rag.server")


class ReplicaHeader:
    """ASGI middleware: every response names the replica that made it."""

    def __init__(self, app, name: str):
        self.app, self.name = app, name.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.name)]}
            await send(message)

        return await self.app(scope, receive, named)


def application(engine_options: dict, settings: ServerSettings, replicas: int, gpus_per_replica: float = 0):
    """The Ray Serve application: ``replicas`` copies of ``SnapKVLLM(**engine_options)``, each
    with ``gpus_per_replica`` GPUs (Ray gives each its own device), behind ``create_app``."""
    from ray import serve

    from .app import create_app

    @serve.ingress()
    class Replica:
        def __init__(self, engine_options: dict, settings: ServerSettings):
            from ..engine import SnapKVLLM

            self.llm, self.settings = SnapKVLLM(**engine_options), settings
            self.name = serve.get_replica_context().replica_id.unique_id

        def __serve_build_asgi_app__(self):
            app = create_app(self.llm, self.settings)
            app.add_middleware(ReplicaHeader, name=self.name)
            return app

    deployment = serve.deployment(
        Replica,
        name="snapkv-rag",
        num_replicas=replicas,
        max_ongoing_requests=settings.max_batch + settings.max_queue + 1,
        ray_actor_options={"num_gpus": gpus_per_replica},
    )
    return deployment.bind(engine_options, settings)


def _start_ray(args) -> bool:
    """Join the cluster of ``--ray-address`` (or ``$RAY_ADDRESS``: a Ray job's), whose exposure is
    its operator's to decide, or start one on this machine with every Ray port on loopback, since
    nothing beyond this machine needs them (only Ray Serve's HTTP proxy listens on ``--host``).
    Returns whether the cluster was started here."""
    import ray

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray_local.start(logging_level=logging.WARNING)
    return True


def run(engine_options: dict, settings: ServerSettings, args) -> int:
    """Start Ray (``--ray-address``, or a local cluster on loopback), serve the replicas on
    ``--host:--port`` until SIGTERM or Ctrl-C, then shut Ray Serve and Ray down."""
    import torch

    try:
        import ray
        from ray import serve
    except ImportError as error:
        raise ValueError(
            f"--replicas: needs Ray Serve ({error}); install the ray extra: pip install 'snapkv-rag[ray]'"
        ) from None
    started = _start_ray(args)
    gpus = 1 if torch.cuda.is_available() else 0
    serve.start(http_options={"host": args.host, "port": args.port})
    quiet = {"log_level": "INFO" if args.verbose else "WARNING", "enable_access_log": args.verbose}
    serve.run(
        application(engine_options, settings, args.replicas, gpus),
        name="snapkv-rag",
        route_prefix="/",
        logging_config=quiet,
    )
    exposed = ray_local.exposure_warning(meant=[args.port]) if started else None  # the proxy is on --host
    if exposed:
        log.warning("%s", exposed)
    log.warning(
        "serving %r on http://%s:%d/v1 from %d Ray Serve replicas (%s)",
        settings.model_name,
        args.host,
        args.port,
        args.replicas,
        "one GPU each" if gpus else "CPU",
    )
    stop = threading.Event()
    stops = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.wait()
    finally:
        for sig, handler in stops.items():
            signal.signal(sig, handler)
        try:
            serve.shutdown()  # drains the replicas' requests
        finally:
            ray.shutdown()  # a cluster started here goes with it: GCS, raylet, workers, agents
    log.warning("stopped")
    return 0
