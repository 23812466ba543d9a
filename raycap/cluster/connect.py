"""Connecting to Ray: to a cluster by address, to RAY_ADDRESS's, or an embedded instance.

A cluster that does not answer fails fast with a one-line ConnectionError naming the
address, instead of `ray.init` waiting forever; address "auto" is resolved the way Ray
resolves it, so the error can name what it found.

An embedded Ray belongs to the thread that starts it: on Linux its processes (GCS,
raylet) are started with a parent-death signal, which fires when the starting *thread*
exits, not the process. `connect_here` is the form for code that may run off the main
thread: it connects in the calling thread, and refuses to start an embedded Ray outside
the main thread rather than leave a Ray that dies with a pool thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import ray

from raycap.cluster.console import quiet_embedded_start

EMBEDDED_OBJECT_STORE_BYTES = 1 << 30
REACH_TIMEOUT_S = 10.0


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


def _check_reachable(address: str) -> None:
    """Fail fast when nothing listens at the cluster's address: ray.init would wait forever."""
    target = _resolve_auto() if address == "auto" else address
    if "://" in target:
        return  # a Ray client or dashboard address: reached by its own protocol
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # let Ray report an address it cannot parse
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        stale = " (the address 'auto' found is stale)" if address == "auto" else ""
        raise ConnectionError(
            f"no Ray cluster answers at {target}{stale}: {exc}; start the cluster, or fix the address"
        ) from None


def connect(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Connect to Ray once: to `address` ("auto" under `ray job submit`), to the cluster
    named by RAY_ADDRESS, or else start an embedded local instance."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        _check_reachable(address or os.environ["RAY_ADDRESS"])
        # A job's driver must not pass resources to init: the cluster already has them.
        ray.init(address=address or None, logging_level=logging.WARNING)
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


def connect_here(address: str | None = None, *, caller: str = "this call") -> None:
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
            "raycap.cluster.connect.connect()) from the main thread first, or pass address= to join a running cluster"
        )
    connect(address)
