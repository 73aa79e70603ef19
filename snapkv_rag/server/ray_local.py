"""A Ray cluster that this project starts by itself listens on loopback only.

``snapkv-rag serve --replicas K`` without ``--ray-address`` and ``python -m evals --ray`` without a
cluster start a one-machine Ray cluster. Left to itself, Ray binds its control ports (GCS, raylet,
every worker's gRPC server, the dashboard and runtime-env agents, the metrics exporters) on all
interfaces or on the machine's network address, and reaching them is enough to run code as this
user. Nothing on another machine needs them here, so :func:`start` puts them on 127.0.0.1, and
:func:`beyond_loopback` measures what still listens elsewhere, for one warning line that names it.

Ray takes the node's address to be its loopback address in its one-machine mode (the default on
macOS and Windows, chosen with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); its processes then bind
to 127.0.0.1. (``ray.init(_node_ip_address="127.0.0.1")`` does not do it: Ray replaces a loopback
node address by the network one.) Joining a cluster (``--ray-address``, ``--ray auto``) changes nothing: that cluster is
its operator's to secure. Ray and psutil are imported only when these functions are called.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Collection, Iterable, Iterator
from typing import Any

SINGLE_MACHINE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"  # set to "token" by a ray.init that turned token authentication on
OBJECT_STORE_BYTES = 256 * 2**20  # Ray's default is 30% of the RAM in shared memory; our objects are small


@contextlib.contextmanager
def _single_machine_mode() -> Iterator[None]:
    """Ray's one-machine mode for the duration of ``ray.init``: its child processes inherit the
    variable when they start, this process reads Ray's constant (read from the variable when Ray
    was first imported, so set here too). Both are restored, so that a later ``ray.init(address=...)``
    joining a real cluster in this process finds the network address again."""
    from ray._private import ray_constants

    variable = os.environ.get(SINGLE_MACHINE_VARIABLE)
    constant = ray_constants.__dict__.get("ENABLE_RAY_CLUSTER")
    os.environ[SINGLE_MACHINE_VARIABLE] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if variable is None:
            os.environ.pop(SINGLE_MACHINE_VARIABLE, None)
        else:
            os.environ[SINGLE_MACHINE_VARIABLE] = variable
        if constant is None:  # a Ray without the constant
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = constant


def start(*, include_dashboard: bool = False, object_store_memory: int = OBJECT_STORE_BYTES, **options: Any) -> None:
    """``ray.init`` of a new one-machine cluster whose processes listen on 127.0.0.1 only, with
    the dashboard off unless asked for and a small object store. ``options`` go to ``ray.init``
    (``num_cpus``, ``runtime_env``, ``log_to_driver``, ``logging_level``...)."""
    import ray

    with _single_machine_mode():
        ray.init(
            address="local",
            include_dashboard=include_dashboard,
            dashboard_host="127.0.0.1",
            object_store_memory=object_store_memory,
            **options,
        )


def is_loopback(ip: str) -> bool:
    """Whether a socket bound to ``ip`` is reachable from this machine only (``::ffff:127.0.0.1``,
    an IPv4 loopback address in an IPv6 socket, included)."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _name(process: Any) -> str:
    """A process's name for people: Ray names its workers and agents (``ray::ServeReplica:...``);
    a Python process of its own (the dashboard, the autoscaler's monitor) is named by its script."""
    name = process.name()
    if name.startswith("python"):
        scripts = [os.path.basename(part) for part in process.cmdline() if part.endswith(".py")]
        return scripts[0] if scripts else name
    return name


def listening(processes: Iterable[Any]) -> list[tuple[str, str, int]]:
    """``(process name, address, port)`` of every socket that ``processes`` (psutil processes)
    accept connections or datagrams on; processes that are gone or not ours to inspect are left out."""
    import psutil

    found = []
    for process in processes:
        try:
            name = _name(process)
            sockets = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for s in sockets:
            if s.status == psutil.CONN_LISTEN or (s.type == 2 and not s.raddr):  # 2: SOCK_DGRAM
                found.append((name, s.laddr.ip, s.laddr.port))
    return sorted(set(found))


def beyond_loopback(meant: Collection[int] = ()) -> list[str]:
    """The names of this process and of its descendants (a self-started cluster's processes are)
    that listen on an address other than loopback, on a port not in ``meant`` (ports asked to be
    public, e.g. Ray Serve's HTTP port on ``--host``): measured, so that the warning names what
    this Ray version really exposes. Call it once the cluster's components are up."""
    import psutil

    me = psutil.Process()
    return sorted(
        {
            name
            for name, ip, port in listening([me, *me.children(recursive=True)])
            if not is_loopback(ip) and port not in meant
        }
    )


def exposure_warning(meant: Collection[int] = ()) -> str | None:
    """One line naming the Ray components that listen beyond loopback (``meant``: as in
    :func:`beyond_loopback`) and whether Ray's token authentication guards them (on by default for
    a cluster that ``ray.init`` starts in the Ray versions this project takes, off with
    ``RAY_AUTH_MODE=disabled``); ``None`` when nothing does."""
    names = beyond_loopback(meant)
    if not names:
        return None
    mode = os.environ.get(AUTH_MODE_VARIABLE, "disabled").lower()
    guard = (
        "Ray's token authentication is off: whoever reaches them can run code here"
        if mode == "disabled"
        else f"they require Ray's authentication, {AUTH_MODE_VARIABLE}={mode}"
    )
    return (
        f"Ray components listening beyond loopback (this Ray version binds them to all interfaces; {guard}): "
        f"{', '.join(names)}"
    )
