"""The fleet: which node serves each capture directory, and the node actors that do it.

`fleet` places the directories (`raycap.cluster.plumbing.placement`) and starts, or finds, the
actor of each of their nodes; it fails before any work when a directory cannot be placed
or served. Node actors are detached and named in one namespace (see
`raycap.cluster.nodes.actor`): a driver, or a model server's writer process, finds the actor
another one started, and the actor outlives the process that started it, so a later
call does not start it again. `first_use` says whether this driver has not built on this
Ray yet (its workers would start cold), which the executor decision needs. `gatherer` is
the actor of the driver's own node, which gathers a step built on several nodes
(`raycap.cluster.nodes.node_build`).

`RayTokenSource` is the TokenSource of one directory, constructed from keyword
arguments (the directory and an optional Ray address), so a consumer names it in a
config the way a model server names `raycap.cluster.sink.RayTokenSink`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.directory import CaptureDir
from raycap.cluster.nodes.actor import (
    ACTOR_NAMESPACE,
    ActorTokenSource,
    CaptureNodeActor,
    DirectoryHandle,
    actor_name,
    running_actor,
)
from raycap.cluster.plumbing.connect import SessionCache, connect_here
from raycap.cluster.plumbing.failures import cause_text
from raycap.cluster.plumbing.placement import locate

ACTOR_START_TIMEOUT_S = 120.0
ACTOR_MAX_RESTARTS = 8
ACTOR_START_ATTEMPTS = 3


@dataclass
class Fleet:
    """The directories to serve, in the order given, with their nodes and handles."""

    dirs: list[CaptureDir]
    nodes: list[str]
    handles: list[DirectoryHandle]

    def by_label(self) -> dict[str, DirectoryHandle]:
        return {d.label: h for d, h in zip(self.dirs, self.handles)}

    def labels_of_actor(self, name: str) -> list[str]:
        """The directories served by the actor of this name."""
        return [d.label for d, node in zip(self.dirs, self.nodes) if actor_name(node) == name]


def _start(node: str) -> Any:
    # get_if_exists returns the live actor of this node, whichever process started it,
    # and starts one when there is none (or it died for good). Detached: it is not the
    # starter's to take down when it exits, since other drivers and writers use it.
    return CaptureNodeActor.options(
        name=actor_name(node),
        namespace=ACTOR_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=ACTOR_MAX_RESTARTS,
        max_task_retries=ACTOR_MAX_RESTARTS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote()


def _node_actors(nodes: list[str]) -> dict[str, Any]:
    """A serving actor on each node, started when the node has none yet."""
    actors = {node: _start(node) for node in nodes}
    deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
    for attempt in range(ACTOR_START_ATTEMPTS):
        pings = {node: actor.node_id.remote() for node, actor in actors.items()}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=max(0.0, deadline - time.monotonic()))
        ready_set = set(ready)
        retry = []
        for node, ping in pings.items():
            if ping not in ready_set:
                for other, other_ping in pings.items():
                    if other_ping not in ready_set:
                        ray.kill(actors[other], no_restart=True)  # never leave an actor pending
                raise TimeoutError(
                    f"the raycap actor for node {node} did not start within "
                    f"{ACTOR_START_TIMEOUT_S:.0f} s; check that the node is alive and can start a worker"
                )
            try:
                ray.get(ping)
            except ray.exceptions.RayError as exc:
                dead = isinstance(exc, ray.exceptions.ActorDiedError) and not exc.actor_init_failed
                if dead and attempt + 1 < ACTOR_START_ATTEMPTS:
                    # A handle to an actor killed for good just before this call, whose
                    # name was not yet released: asking again starts a fresh actor.
                    retry.append(node)
                    continue
                raise RuntimeError(f"the raycap actor for node {node} could not start: {cause_text(exc)}") from exc
        if not retry:
            break
        time.sleep(0.2 * (attempt + 1))
        for node in retry:
            actors[node] = _start(node)
    return actors


# Per Ray session (see `raycap.cluster.plumbing.connect.SessionCache`): whether this driver's
# builder workers have been used, and the actor of the driver's node. A handle kept
# from a cluster that is gone would fail every call as "from a different cluster".
_KEPT = SessionCache()


def first_use() -> bool:
    """Whether this driver has not built on this Ray yet (its workers would start cold)."""
    return not _KEPT.values().get("warmed", False)


def prewarm() -> tuple[str, Any] | None:
    """On a driver's first use of a Ray session, start the driver node's actor while
    placement is still being worked out. Nothing waits for it here. Returns (node, actor)
    when it started the actor (None when the node had one, or this driver warmed up
    before), so that a call placement refuses can stop it again (`unwarm`)."""
    kept = _KEPT.values()
    if kept.get("warmed"):
        return None
    kept["warmed"] = True
    here = ray.get_runtime_context().get_node_id()
    running = running_actor(here) is not None
    actor = _start(here)
    return None if running else (here, actor)


def unwarm(started: tuple[str, Any]) -> None:
    """Stop the actor `prewarm` started for a call that was then refused (a directory
    that exists nowhere, say): a refused call leaves no actor behind, and the next call
    warms up again."""
    _, actor = started
    ray.kill(actor, no_restart=True)
    _KEPT.values().pop("warmed", None)


def gatherer(*, forget: bool = False) -> Any:
    """The actor of this driver's node, which gathers a step built on several nodes
    (`raycap.cluster.nodes.node_build.gather_step`): started when the node has none, then kept
    for this Ray session. `forget` drops the kept handle (the actor died), so the next
    call finds or starts it."""
    kept = _KEPT.values()
    if forget:
        kept.pop("gatherer", None)
        return None
    actor = kept.get("gatherer")
    if actor is None:
        here = ray.get_runtime_context().get_node_id()
        actor = kept["gatherer"] = _node_actors([here])[here]
    return actor


def fleet(capture_dirs: Sequence[Any]) -> Fleet:
    """Locate the directories and start (or reuse) the actor of each of their nodes.

    Raises ValueError when a directory is on no alive node (see `placement`), RuntimeError
    when an actor cannot be created or a directory cannot be opened on its node,
    TimeoutError when an actor does not start in time; no actor is left pending."""
    return _served(locate(capture_dirs))


def _served(placed: list[tuple[CaptureDir, str]]) -> Fleet:
    """Start (or find) the actors of placed directories and open each directory there."""
    dirs = [d for d, _ in placed]
    nodes = [node for _, node in placed]
    actors = _node_actors(list(dict.fromkeys(nodes)))
    handles = [DirectoryHandle(actors[node], d.path, actor_name(node)) for d, node in placed]
    for d, opened in zip(dirs, [h.open() for h in handles]):
        try:
            ray.get(opened)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(
                f"capture directory {d.label} cannot be served: {cause_text(exc)}; "
                "check that the directory exists and is readable on its node"
            ) from exc
    return Fleet(dirs, nodes, handles)


def serve_one(capture_dir: Any, *, address: str | None = None, caller: str,
              connect_timeout_s: float | None = None) -> DirectoryHandle:
    """The node actor's handle of one capture directory, joining Ray first (`address`,
    RAY_ADDRESS, or an embedded Ray when in the main thread; a cluster that does not
    answer within `connect_timeout_s` is refused, see `raycap.cluster.plumbing.connect`). The spec
    is checked before Ray is joined. A path that several nodes hold as separate
    directories is refused: one reader or writer serves one directory."""
    spec = CaptureDir.parse(capture_dir)
    connect_here(address, caller=caller, timeout_s=connect_timeout_s)
    placed = locate([spec])
    if len(placed) != 1:  # refused before any actor starts
        nodes = ", ".join(d.label for d, _ in placed)
        raise ValueError(
            f"capture directory {spec.label} is held separately by several nodes ({nodes}); {caller} "
            "serves one directory: give it as NODE:PATH"
        )
    return _served(placed).handles[0]


class RayTokenSource(ActorTokenSource):
    """The TokenSource of one capture directory (`NODE:PATH` or a plain absolute path),
    served by the actor of the node that holds it, wherever on the cluster that is.

    Constructed from keyword arguments alone, so a config can name it: `address` is the
    cluster to join (RAY_ADDRESS, or an embedded Ray, when None and this process is not
    connected yet). It joins and finds (or starts) the node actor when constructed, so a
    wrong address or directory fails there; a cluster that does not answer within
    `connect_timeout_s` seconds (default `raycap.cluster.plumbing.connect.CONNECT_TIMEOUT_S`, 30)
    fails it with a one-line ConnectionError naming the address."""

    def __init__(self, capture_dir: Any, address: str | None = None, connect_timeout_s: float | None = None) -> None:
        super().__init__(serve_one(capture_dir, address=address, caller="RayTokenSource",
                                   connect_timeout_s=connect_timeout_s))
        self.capture_dir = capture_dir

    def __repr__(self) -> str:
        return f"RayTokenSource({self.capture_dir!r})"


def token_source(capture_dir: Any, *, address: str | None = None,
                 connect_timeout_s: float | None = None) -> RayTokenSource:
    """The TokenSource of one capture directory, served by its pinned actor."""
    return RayTokenSource(capture_dir, address=address, connect_timeout_s=connect_timeout_s)
