"""Connecting to Ray: to a cluster by address, to RAY_ADDRESS's, or an embedded instance.

- A cluster that does not answer fails within `timeout_s` (CONNECT_TIMEOUT_S by default)
  with a one-line ConnectionError naming the address; "auto" is resolved as Ray does.
- Before `ray.init`, the address is asked, under that deadline, what only Ray answers: a
  GCS's cluster id (host:port) or a Ray client server's ping (ray://host:port). A silent
  port, another service (a gRPC server that is not Ray's) and a refused auth token
  (InvalidAuthToken) are caught there, leaving no half-initialised Ray in this process.
- An embedded Ray belongs to the thread that starts it (its processes get a parent-death
  signal that fires when that thread exits): `connect_here` refuses to start one off the
  main thread.
- `lone_node_here` asks a cluster's GCS, without joining, whether its one alive node is
  this machine: a command with nothing to do there is refused without joining and leaving.
- `leave` is the way out for a process about to exit: an embedded Ray is stopped without
  the autoscaler monitor's second of grace or the exit hook's half-second pause.
- What a process keeps between calls is only good for the Ray it was found on:
  `ray_session` names that Ray, and `SessionCache` drops its values once this process is
  connected to another cluster or connected again.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from typing import NamedTuple

import ray

from raycap.cluster.plumbing.console import quiet_embedded_start

EMBEDDED_OBJECT_STORE_BYTES = 1 << 30
# How long joining a cluster may take before it is refused (`timeout_s` changes it).
CONNECT_TIMEOUT_S = 30.0
# How long `leave` waits for the killed autoscaler monitor to be reaped.
MONITOR_REAP_TIMEOUT_S = 5.0
# How long `lone_node_here` waits for the GCS's answer before the caller joins as usual.
LONE_NODE_TIMEOUT_S = 2.0


def _resolve_auto() -> str:
    """Where address="auto" points: RAY_ADDRESS, else the cluster last started here."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    try:
        with open(current) as handle:
            return handle.read().strip()
    except OSError:
        raise ConnectionError(
            "address 'auto' found no running Ray cluster (RAY_ADDRESS is unset and no cluster was "
            "started on this machine); start one with `ray start --head`, or run embedded"
        ) from None


class _Target(NamedTuple):
    """A cluster address as Ray reads it: "auto" resolved, its scheme ("ray" for a
    client, "" for a GCS), host:port and its two parts."""

    text: str
    scheme: str
    hostport: str
    host: str
    port: str

    @property
    def parsed(self) -> bool:
        """Whether it names a host and a port number."""
        return bool(self.host) and self.port.isdigit()


def _target(address: str) -> _Target:
    """`address` as `_Target` (ConnectionError from "auto" with no cluster to find)."""
    text = _resolve_auto() if address == "auto" else address
    scheme, _, hostport = text.rpartition("://")
    host, _, port = hostport.rpartition(":")
    return _Target(text, scheme, hostport, host, port)


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail within `timeout_s` unless Ray answers at the cluster's address: nothing
    listens there, something accepts the connection and never speaks gRPC, or another
    gRPC service answers (ray.init would wait for minutes, or forever)."""
    deadline = time.monotonic() + timeout_s
    parts = _target(address)
    target, scheme, hostport, host, port = parts
    if scheme and scheme != "ray":
        return  # a dashboard or another module's address: reached by its own protocol
    if not parts.parsed:
        return  # let Ray report an address it cannot parse
    stale = " (the address 'auto' found is stale)" if address == "auto" else ""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at {target}{stale}: {exc}; start the cluster, or fix the address"
        ) from None
    client = scheme == "ray"
    if client:
        expected = "Ray client server address (ray://head:10001 by default)"
    else:
        expected = "head's GCS address (host:port, 6379 by default)"
    answer = _ask_ray(hostport, client, max(0.0, deadline - time.monotonic()))
    if answer.kind == "ray":
        return
    if answer.kind == "silent":
        raise ConnectionError(
            f"the Ray cluster address {target}{stale} accepts connections but did not answer within "
            f"{timeout_s:g} s; check that it is the {expected} and that the head is healthy, or give a "
            "longer connect timeout"
        )
    if answer.status.startswith("UNAUTHENTICATED: InvalidAuthToken"):
        # Ray, refusing this process's token: ray.init would retry for some 20 s and then not say why.
        raise ConnectionError(
            f"the Ray cluster at {target}{stale} refused this process's auth token ({answer.status}); start this "
            "process with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN or "
            "RAY_AUTH_TOKEN_PATH (or RAY_AUTH_MODE=disabled for a cluster started so)"
        )
    raise ConnectionError(
        f"the address {target}{stale} answers, but not as Ray ({answer.status}); another service listens "
        f"there: give the {expected}"
    )


def lone_node_here(address: str | None, timeout_s: float = LONE_NODE_TIMEOUT_S) -> bool:
    """Whether the cluster at `address` (else RAY_ADDRESS; "auto" as Ray resolves it) is
    one alive node, on this machine (its address the one this machine has towards the
    GCS, as `ray.init` finds its node), asked of the GCS without joining: joining and
    leaving again takes 0.4 s and more, most of it waiting on Ray's disconnect. False for
    a Ray client address (its paths are another machine's) and whenever the GCS does not
    say in `timeout_s`: the caller then joins as usual, which reports what is wrong."""
    try:
        target = _target(address or os.environ.get("RAY_ADDRESS") or "")
    except ConnectionError:
        return False
    if target.scheme or not target.parsed:
        return False
    hostport = target.hostport
    import grpc  # Ray's own dependency
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.services import node_ip_address_from_perspective
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    alive = gcs_pb2.GcsNodeInfo.ALIVE
    channel = init_grpc_channel(hostport)
    try:
        request = gcs_service_pb2.GetAllNodeInfoRequest(limit=2, state_filter=alive)
        reply = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(request, timeout=timeout_s)
    except grpc.RpcError:
        return False
    finally:
        channel.close()
    nodes = [node for node in reply.node_info_list if node.state == alive]
    if len(nodes) != 1:
        return False
    try:
        return nodes[0].node_manager_address == node_ip_address_from_perspective(hostport)
    except OSError:
        return False


class _Answer(NamedTuple):
    """What the address said when asked what only Ray answers: "ray", "silent" (nothing
    in time) or "refused" (a gRPC status, in one line)."""

    kind: str
    status: str = ""


def _ask_ray(hostport: str, client: bool, timeout_s: float) -> _Answer:
    """Ask the service at `hostport`, within `timeout_s`, what only Ray answers: the
    cluster id (a GCS) or a ping (a Ray client server)."""
    import grpc  # Ray's own dependency

    # Ray's own channel: the TLS and token settings ray.init would use.
    from ray._private.grpc_utils import init_grpc_channel

    channel = init_grpc_channel(hostport)
    try:
        if client:
            from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

            request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(request, timeout=timeout_s)
        else:
            from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

            request = gcs_service_pb2.GetClusterIdRequest()
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=timeout_s)
        return _Answer("ray")
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Answer("silent")
        details = " ".join(str(exc.details() or "").split())
        return _Answer("refused", f"{exc.code().name}: {details}" if details else exc.code().name)
    finally:
        channel.close()


def ray_session() -> tuple[str, str]:
    """The Ray this process is connected to: the cluster's session name (new each time a
    cluster's head starts) and this driver's job id (new each time it connects; job ids
    start again at 1 on a new cluster, so they alone do not tell clusters apart)."""
    context = ray.get_runtime_context()
    return context.get_session_name(), context.get_job_id()


class SessionCache:
    """Values kept for the Ray session this process is connected to (`ray_session`):
    a call under another session gets an empty dict, and the old values are dropped."""

    def __init__(self) -> None:
        self._key: tuple[str, str] | None = None
        self._values: dict = {}
        self._lock = threading.Lock()

    def values(self) -> dict:
        """The values of the current session (Ray must be connected)."""
        key = ray_session()
        with self._lock:
            if key != self._key:
                self._key, self._values = key, {}
            return self._values


def connect(address: str | None = None, *, num_cpus: int | None = None, timeout_s: float | None = None) -> None:
    """Connect to Ray once: to `address` ("auto" under `ray job submit`), to the cluster
    named by RAY_ADDRESS, or else start an embedded local instance. Joining a cluster
    that does not answer within `timeout_s` (CONNECT_TIMEOUT_S when None) raises a
    one-line ConnectionError naming its address, and leaves Ray unconnected."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        wait = CONNECT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if not wait > 0:
            raise ValueError(f"the connect timeout must be a positive number of seconds, not {timeout_s!r}")
        _check_reachable(address or os.environ["RAY_ADDRESS"], wait)
        try:
            # A job's driver must not pass resources to init: the cluster already has them.
            ray.init(address=address or None, logging_level=logging.WARNING)
        except BaseException:
            ray.shutdown()  # whatever ray.init set up before it failed
            raise
        return
    # "local" starts a private instance even when a `ray start` cluster runs on this
    # machine: connecting to it must be asked for (address="auto" or RAY_ADDRESS).
    with quiet_embedded_start():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=EMBEDDED_OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )


def leave() -> None:
    """Disconnect from Ray, stopping the embedded instance this process started, if any.

    For a process whose work is done and written (a command after its summary). Ray's
    exit hook would pause 0.5 s first, then give each of its processes up to 1 s to end
    on SIGTERM: the autoscaler monitor always takes that second, and of an embedded
    instance it holds nothing (no autoscaler runs). It is killed first; the raylet and
    the GCS still end on SIGTERM as in `ray.shutdown`, the raylet taking its workers."""
    if not ray.is_initialized():
        return
    from ray._private import worker  # the node this process started, if it started one

    node = getattr(worker, "_global_node", None)
    if node is not None and node.is_head():
        for info in node.all_processes.pop("monitor", []):
            info.process.kill()
            try:
                info.process.wait(timeout=MONITOR_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel: it dies when it leaves, as Ray's own kill allows
    ray.shutdown()


def connect_here(address: str | None = None, *, caller: str = "this call", timeout_s: float | None = None) -> None:
    """`connect` in the calling thread, refusing an embedded start off the main thread.

    Joining a running cluster (an address, RAY_ADDRESS) works from any thread; starting
    an embedded instance is left to the main thread, whose life is the process's."""
    if ray.is_initialized():
        return
    embedded = not (address or os.environ.get("RAY_ADDRESS"))
    if embedded and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{caller} would start an embedded Ray in thread {threading.current_thread().name!r}, and Ray's "
            "processes die when the thread that started them ends; call ray.init() (or "
            "raycap.cluster.plumbing.connect.connect()) from the main thread first, or pass address= to join a running cluster"
        )
    connect(address, timeout_s=timeout_s)
