"""``snapkv-rag serve``: its own flags, the checks on who may connect, and running uvicorn.

Importing this module imports neither the web framework nor torch (``snapkv-rag --help`` stays fast).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal

from .protocol import ServerSettings

KEY_VARIABLE = "SNAPKV_RAG_API_KEY"
log = logging.getLogger("snapkv_rag.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options, in groups that ``--help`` shows under their titles."""
    parser.add_argument("--no-snapkv", dest="full", action="store_true", help="the same as --full")
    _listening(parser.add_argument_group("listening and access"))
    _limits(parser.add_argument_group("limits"))
    _caches(parser.add_argument_group("caches"))
    _replicas(parser.add_argument_group("replicas"))


def _listening(group) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="(default 8000)")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: --model, or the embedded model's name)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${KEY_VARIABLE} if set)",
    )
    group.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host without an API key")
    group.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; default: none)",
    )


def _limits(group) -> None:
    group.add_argument(
        "--max-batch", type=int, default=16, help="requests decoded together (default 16; 1 = one at a time)"
    )
    group.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429 (default 64)"
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413 (default 4 MiB)"
    )
    group.add_argument(
        "--max-documents", type=int, default=64, help="more documents in one request get 400 (default 64)"
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="a longer prompt (documents and tools included) gets 400 (default: the model's context window)",
    )
    group.add_argument(
        "--max-streams",
        type=int,
        default=64,
        help="more streamed responses open at once get 429 (default 64)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/Ctrl-C, seconds to let in-flight requests finish before they are cancelled (default 30)",
    )


def _caches(group) -> None:
    group.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="bound of the document prefix cache: the prefill of instruction + documents is kept "
        "and reused by the next question over them (default 1 GiB; 0 disables)",
    )
    group.add_argument(
        "--doc-store-bytes",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="bound of the store of compressed document sets: a request with a query-agnostic "
        "method (keynorm, kvzip) over documents seen before prefills only its question "
        "(default 1 GiB; 0 disables)",
    )
    group.add_argument(
        "--doc-store-dir",
        default=None,
        metavar="DIR",
        help="keep the compressed document sets in DIR too, one file per set, written atomically: a "
        "restarted server answers from them (default: none, memory only)",
    )
    group.add_argument(
        "--doc-store-disk-bytes",
        type=int,
        default=4 << 30,
        metavar="BYTES",
        help="bound of --doc-store-dir: the least recently used files go beyond it, and a set larger "
        "than it is not written (default 4 GiB)",
    )


def _replicas(group) -> None:
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="K",
        help="run K engines as Ray Serve replicas "
        "behind the same routes, one GPU each where there are GPUs (needs the ray extra; default: one "
        "engine in this process, no Ray)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: the Ray cluster to join, as it is: who "
        "can reach its ports is its operator's trust boundary (default: $RAY_ADDRESS, else start one "
        "here with Ray's ports on 127.0.0.1)",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check(args) -> str | None:
    """The server flags, checked before the model loads; returns the API key (flag or variable)."""
    for flag, value, least in (
        ("--port", args.port, 0),
        ("--max-batch", args.max_batch, 1),
        ("--max-queue", args.max_queue, 0),
        ("--max-body-bytes", args.max_body_bytes, 1),
        ("--max-documents", args.max_documents, 1),
        ("--prefix-cache-bytes", args.prefix_cache_bytes, 0),
        ("--doc-store-bytes", args.doc_store_bytes, 0),
        ("--max-streams", args.max_streams, 0),
        ("--doc-store-disk-bytes", args.doc_store_disk_bytes, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} {value}: must be at least {least}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens}: must be at least 1")
    if args.port > 65535:
        raise ValueError(f"--port {args.port}: must be at most 65535")
    key = args.api_key or os.environ.get(KEY_VARIABLE) or None
    if not is_loopback(args.host) and key is None and not args.allow_remote:
        raise ValueError(
            f"--host {args.host}: listening beyond this machine without an API key; give --api-key "
            f"(or ${KEY_VARIABLE}), or --allow-remote to serve without one"
        )
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: must be at least 1")
    if args.ray_address and args.replicas is None:
        raise ValueError("--ray-address: only with --replicas")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0")
    return key


def settings(args, key: str | None, default_name: str, compression, base_compression) -> ServerSettings:
    """The server's settings from its flags; the model id is ``default_name`` unless named by flags."""
    return ServerSettings(
        model_name=args.served_model_name or args.model or default_name,
        api_key=key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_documents=args.max_documents,
        max_prompt_tokens=args.max_prompt_tokens,
        max_streams=args.max_streams,
        cors_origins=tuple(args.cors_origin),
        compression=compression,
        base_compression=base_compression,
    )


def run(llm, server_settings: ServerSettings, args) -> int:
    """Serve until SIGTERM or Ctrl-C: then stop accepting, let in-flight requests finish for up to
    ``--shutdown-timeout`` seconds, cancel the rest, and return 0."""
    import uvicorn

    from .app import create_app

    app = create_app(llm, server_settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's handler for SIGTERM and SIGINT
            app.state.shutdown(args.shutdown_timeout)
            super().handle_exit(sig, frame)

    level = "warning" if args.quiet else "info" if args.verbose else "warning"
    # uvicorn's own timeout is the backstop for a request that has not produced a token by then
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=level,
        access_log=args.verbose,
        timeout_graceful_shutdown=args.shutdown_timeout + 10,
        lifespan="on",
    )
    server = Server(config)
    log.warning(
        "serving %r on http://%s:%d/v1 (max batch %d, queue %d%s)",
        server_settings.model_name,
        args.host,
        args.port,
        server_settings.max_batch,
        server_settings.max_queue,
        ", API key required" if server_settings.api_key else "",
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again to the handler
    # it found: a quiet one here, so that a requested stop exits with status 0
    stops = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in stops.items():
            signal.signal(sig, handler)
    log.warning("stopped")
    return 0 if server.started else 1
