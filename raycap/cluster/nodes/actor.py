"""One actor per node: the process that serves the node's capture directories, pinned there.

- One detached actor per node, named in ACTOR_NAMESPACE: every driver and writer finds
  the same one, and it outlives them. It keeps the raycap code it started with.
- A `DirectoryHandle` is a directory on its node's actor. It serves the reader
  (`ActorTokenSource`) and the writer (`raycap.cluster.sink.ActorTokenSink`).
- It keeps no state but the streams it serves (`raycap.cluster.nodes.node_stream`), so
  a restarted actor serves what the old one did, and every call is safe for Ray to retry.
- It builds a step's ids its directories hold (`raycap.cluster.nodes.node_build`).
- File work runs on IO_THREADS threads, the event loop stays free; it asks for no CPU.
  Freezes return raw bytes (or only the frozen identity): parsing runs in the caller.
- Errors keep their type: a batch call reports "<Type>: <message>" per slot, and
  `ActorTokenSource` re-raises the original exception.

The contract in full: docs/internals.md ("The node actor").
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import ray

from raycap.capture.outcomes import DropOutcome, FreezeFailed, Part, as_part
from raycap.capture.protocols import TokenCaptureSnapshot
from raycap.capture.records import TokenEntry, parse_entries
from raycap.capture.store import FrozenCapture, TokenCaptureStore, is_valid_rollout_id
from raycap.cluster.plumbing.placement import local_path
from raycap.rows.options import MAX_CAPTURE_BYTES

IO_THREADS = 8


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _new_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-io")


def _with_buffer(frozen: FrozenCapture) -> FrozenCapture:
    # As a numpy buffer the bytes travel out of band: one copy into the object store,
    # and builder tasks on the same node read them in place.
    return dataclasses.replace(frozen, data=np.frombuffer(frozen.data, dtype=np.uint8))


class CaptureNode:
    """The capture directories of one node, plus batch calls (runs as a Ray actor).

    Every call but `node_id`, `pid` and `close` names its directory first."""

    def __init__(self) -> None:
        self._stores: dict[str, TokenCaptureStore] = {}
        self._pool = _new_pool()
        self._node: tuple[str, int] | None = None
        self._peers: dict[str, Any] = {}
        self._node_streams: Any = None

    def store(self, path: str) -> TokenCaptureStore:
        store = self._stores.get(path)
        if store is None:
            here = local_path(path)
            if not os.path.isdir(here):
                raise FileNotFoundError(f"capture directory {path} does not exist on this node")
            store = self._stores[path] = TokenCaptureStore(here, create=False)
        return store

    async def _io(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def pid(self) -> int:
        return os.getpid()

    async def open(self, path: str) -> None:
        """Check that the directory exists here (FileNotFoundError otherwise)."""
        await self._io(self.store, path)

    # TokenSource -----------------------------------------------------------------------
    async def freeze(self, path: str, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze and return parsed records (protocol form; `freeze_raw` skips the parsing)."""
        return await self._io(lambda: self.store(path).freeze_now(rollout_id))

    async def freeze_raw(self, path: str, rollout_id: str) -> FrozenCapture:
        return await self._io(lambda: self.store(path).freeze_raw(rollout_id))

    async def drop(self, path: str, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._io(lambda: self.store(path).drop_now(rollout_id, snapshot_id=snapshot_id, version=version))

    async def close(self) -> None:
        """Wait for the file work already started; the actor keeps serving.

        The pool is swapped before the old one drains, so calls arriving meanwhile run
        on the new pool instead of failing, and the event loop never blocks."""
        old, self._pool = self._pool, _new_pool()
        await asyncio.get_running_loop().run_in_executor(None, old.shutdown)

    # TokenSink (see raycap.cluster.sink) ---------------------------------------------
    async def put(self, path: str, entry: TokenEntry) -> None:
        """Append one record; it is fsynced before this returns (`TokenCaptureStore.append`)."""
        await self._io(lambda: self.store(path).append(entry))

    async def mark_incomplete(self, path: str, rollout_id: str, model_call_id: str = "") -> None:
        await self._io(lambda: self.store(path).mark_incomplete_now(rollout_id, model_call_id))

    async def begin_call(self, path: str, rollout_id: str, model_call_id: str) -> None:
        await self._io(lambda: self.store(path).begin_call_now(rollout_id, model_call_id))

    # Batch calls -----------------------------------------------------------------------
    async def rollout_ids(self, path: str, *, skip_retired: bool = False) -> list[str]:
        """The listed rollout ids: one pass over the directory's names."""
        return await self._io(lambda: self.store(path).rollout_ids(skip_retired=skip_retired))

    async def held(self, path: str, rollout_ids: list[str], *, skip_retired: bool = False) -> dict[str, int]:
        """Of these ids, the ones this directory holds, with their JSONL bytes (O(ids))."""
        return await self._io(lambda: self.store(path).held(rollout_ids, skip_retired=skip_retired))

    async def freeze_batch(
        self,
        path: str,
        rollout_ids: list[str],
        *,
        read: bool = True,
        held_only: bool = False,
        max_bytes: int | None = MAX_CAPTURE_BYTES,
    ) -> list[Part]:
        """Freeze each rollout; a failure is a FreezeFailed in its slot.

        With read=False only the snapshot identity and size come back: a builder task on
        this node reads the frozen bytes itself (`TokenCaptureStore.read_frozen`), which
        spares this actor and the object store a copy of every capture. With held_only,
        an id this directory does not hold is None instead of frozen here (freezing
        would create it): a rollout's parts can be on any of several directories."""
        held: Any = None
        if held_only:
            try:
                held = await self._io(lambda: self.store(path).held([r for r in rollout_ids if is_valid_rollout_id(r)]))
            except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                return [FreezeFailed(_error_text(exc))] * len(rollout_ids)

        def freeze() -> list[Part]:
            store = self.store(path)
            wanted = [rid for rid in rollout_ids if held is None or (is_valid_rollout_id(rid) and rid in held)]
            frozen = dict(zip(wanted, store.freeze_many(wanted, read=read, max_bytes=max_bytes)))
            return [
                None if rid not in frozen else (f if isinstance(f := as_part(frozen[rid]), FreezeFailed) else _with_buffer(f))
                for rid in rollout_ids
            ]

        try:
            return await self._io(freeze)
        except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
            return [FreezeFailed(_error_text(exc))] * len(rollout_ids)

    async def read_batch(self, path: str, frozen: list[FrozenCapture]) -> list[FrozenCapture | FreezeFailed]:
        """The bytes of freezes made with read=False, for builder tasks on other nodes."""

        def one(capture: FrozenCapture) -> FrozenCapture | FreezeFailed:
            try:
                return _with_buffer(dataclasses.replace(capture, data=self.store(path).read_frozen(capture)))
            except Exception as exc:  # noqa: BLE001 - reported per rollout
                return FreezeFailed(_error_text(exc))

        return list(await asyncio.gather(*(self._io(one, capture) for capture in frozen)))

    async def drop_batch(self, path: str, snapshots: list[tuple[str, str, int]]) -> list[DropOutcome]:
        """Drop (rollout_id, snapshot_id, version) triples, each with its outcome."""

        def one(item: tuple[str, str, int]) -> DropOutcome:
            rollout_id, snapshot_id, version = item
            try:
                return DropOutcome.of(self.store(path).drop_now(rollout_id, snapshot_id=snapshot_id, version=version))
            except Exception as exc:  # noqa: BLE001 - reported per snapshot
                return DropOutcome.failed(_error_text(exc))

        return list(await asyncio.gather(*(self._io(one, item) for item in snapshots)))

    async def delete_batch(self, path: str, rollout_ids: list[str]) -> list[str | None]:
        """Delete each rollout's capture (administrative clear); None or an error text."""

        def one(rollout_id: str) -> str | None:
            try:
                self.store(path).delete(rollout_id)
                return None
            except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                return _error_text(exc)

        return list(await asyncio.gather(*(self._io(one, rid) for rid in rollout_ids)))

    async def sweep_retired(self, path: str, older_than_seconds: float) -> int:
        return await self._io(lambda: self.store(path).sweep_retired(older_than_seconds))

    # Builds on this node (see raycap.cluster.nodes.node_build) ----------------------------------
    def _here(self) -> tuple[str, int]:
        """This node's id and CPU count (read once)."""
        if self._node is None:
            node = ray.get_runtime_context().get_node_id()
            resources = next((n.get("Resources") or {} for n in ray.nodes() if n["NodeID"] == node), {})
            self._node = (node, max(1, int(resources.get("CPU", 1))))
        return self._node

    def sources(self, dirs: list[tuple[str, str]]) -> list[Any]:
        """Builder-task sources of this node's directories, given as (label, path)."""
        from raycap.cluster.plumbing.task import Source

        node, _ = self._here()
        name = actor_name(node)
        return [Source(label, path, node, DirectoryHandle(_ActorByName(name), path, name)) for label, path in dirs]

    async def build_held(self, dirs: list[tuple[str, str]], step: tuple[list[Any], Any]) -> tuple[list, Any]:
        """A step's ids built on this node: `step` is (the ids, their RebuildOptions).
        Called with num_returns=2, it answers (which of `dirs` hold each id, and its
        rows) and the rows of the held ids, in their order
        (`raycap.cluster.nodes.node_build.build_held`)."""
        from raycap.cluster.nodes.node_build import build_held

        rollout_ids, options = step

        node, cpus = self._here()
        return await build_held(
            self.sources(dirs), rollout_ids, options, node=node, cpus=cpus,
            stores=lambda: [self.store(path) for _, path in dirs], io=self._io,
        )

    async def gather_step(self, nodes: list[tuple[str, list[int], list[tuple[str, str]]]], rollout_ids: list[Any],
                          options: Any) -> tuple[Any, Any]:
        """As the driver's node's actor: a step over `nodes` (each a node id, the step's
        directory indices it serves and their (label, path)), built by their actors.
        Called with num_returns=2: a `StepAnswer`, and the rows of the ids held on one
        node, in the order of the ids (`raycap.cluster.nodes.node_build.gather_step`)."""
        from raycap.cluster.nodes.node_build import gather_step
        from raycap.cluster.plumbing.placement import LIVENESS_CHECK_S, dead_nodes

        listed = [(node, self._peer(node), dirs, spec) for node, dirs, spec in nodes]
        answer, rows = await gather_step(
            listed, rollout_ids, options, dead=lambda wanted: self._io(dead_nodes, wanted), io=self._io,
            wait_s=LIVENESS_CHECK_S,
        )
        for node in answer.lost:
            self._peers.pop(node, None)  # looked up again next time: it may have been replaced
        return answer, rows

    # A stream's hold on this node's directories (see raycap.cluster.nodes.node_stream) ---------
    def _streams(self) -> Any:
        if self._node_streams is None:
            from raycap.cluster.nodes.node_stream import NodeStreams

            self._node_streams = NodeStreams(self._io)
        return self._node_streams

    async def stream_subscribe(self, key: str, hub: Any, dirs: list[tuple[str, str]], watch: bool) -> None:
        await self._streams().subscribe(key, hub, dirs, watch, self._here()[0])

    async def stream_session(self, key: str) -> bool:
        return await self._streams().session(key)

    async def stream_unsubscribe(self, key: str) -> None:
        self._streams().end(key)

    async def stream_submit(self, key: str, rollout_ids: list[str], records: dict | None = None) -> list[tuple[bool, Any]]:
        from raycap.cluster.nodes.node_stream import call_on

        return await call_on(self._streams(), key, "submit", rollout_ids, records or {})

    async def stream_build(self, key: str, rollout_ids: list[str], options: Any, schema: Any,
                           fetch: bool = False) -> tuple[list, list, dict]:
        node, cpus = self._here()
        return await self._streams().build(key, rollout_ids, options, schema, node=node, cpus=cpus,
                                           sources=self.sources, fetch=fetch)

    async def stream_mark(self, key: str, items: list[tuple]) -> list[bool | str]:
        from raycap.cluster.nodes.node_stream import call_on

        return await call_on(self._streams(), key, "mark", items)

    async def stream_drop(self, key: str, items: list[tuple]) -> list[bool | str]:
        from raycap.cluster.nodes.node_stream import call_on

        return await call_on(self._streams(), key, "drop", items)

    async def stream_settle(self, key: str, items: list[tuple]) -> list[str]:
        from raycap.cluster.nodes.node_stream import call_on

        return await call_on(self._streams(), key, "settle", items)

    def _peer(self, node: str) -> Any:
        """The actor of another node (by its name), kept."""
        peer = self._peers.get(node)
        if peer is None:
            peer = self._peers[node] = ray.get_actor(actor_name(node), namespace=ACTOR_NAMESPACE)
        return peer


# Every driver and every writer process finds a node's actor here, by its name. The
# namespace carries the actor protocol's version: detached actors outlive the drivers
# that started them, so one started by an older raycap (unversioned "raycap") would
# otherwise be reused, serving its old code to new callers. Bump it when the actor's
# calls change incompatibly; an old actor is then left alone for `ray.kill`.
ACTOR_NAMESPACE = "raycap-v2"


def actor_name(node_id: str) -> str:
    """The actor's name: one actor per node, in ACTOR_NAMESPACE."""
    return f"raycap-node-{hashlib.sha1(node_id.encode()).hexdigest()[:16]}"


def running_actor(node_id: str) -> Any | None:
    """The handle of the node's actor when one is registered, else None."""
    try:
        return ray.get_actor(actor_name(node_id), namespace=ACTOR_NAMESPACE)
    except ValueError:
        return None


CaptureNodeActor = ray.remote(CaptureNode)


class _ActorByName:
    """A node actor's handle, looked up by its name on first use.

    Handles travel to other processes this way, never by value. A process that unpickles
    an actor handle loads the actor's class from the exports of the job that created the
    actor, and Ray deletes those once that job has ended and the actor is gone: the
    handle of a node actor killed for good would then fail to unpickle with an unrelated
    error, where the caller must see that the actor died."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._actor: Any = None

    def _resolve(self) -> Any:
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self.name, namespace=ACTOR_NAMESPACE)
            except ValueError:
                gone = ray.exceptions.ActorDiedError()
                gone.error_msg = f"the raycap node actor {self.name} is gone (killed, or died for good)"
                raise gone from None
        return self._actor

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(self._resolve(), attribute)

    def __reduce__(self) -> tuple:
        return (_ActorByName, (self.name,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ActorByName) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class DirectoryHandle:
    """One capture directory served by its node's actor: each method sends the call
    with the directory's path and returns its ObjectRef (see `CaptureNode`).

    With the actor's `name`, a handle pickles as the name and the path: wherever it is
    unpickled, the actor is looked up by name when first called (see `_ActorByName`)."""

    actor: Any
    path: str
    name: str = ""

    def __reduce__(self) -> tuple:
        if not self.name:
            return (DirectoryHandle, (self.actor, self.path))
        return (DirectoryHandle, (_ActorByName(self.name), self.path, self.name))

    def open(self) -> Any:
        return self.actor.open.remote(self.path)

    def rollout_ids(self, *, skip_retired: bool = False) -> Any:
        return self.actor.rollout_ids.remote(self.path, skip_retired=skip_retired)

    def freeze_batch(
        self,
        rollout_ids: list[str],
        *,
        read: bool = True,
        held_only: bool = False,
        max_bytes: int | None = MAX_CAPTURE_BYTES,
    ) -> Any:
        return self.actor.freeze_batch.remote(self.path, rollout_ids, read=read, held_only=held_only, max_bytes=max_bytes)

    def read_batch(self, frozen: list[FrozenCapture]) -> Any:
        return self.actor.read_batch.remote(self.path, frozen)

    def freeze_raw(self, rollout_id: str) -> Any:
        return self.actor.freeze_raw.remote(self.path, rollout_id)

    def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> Any:
        return self.actor.drop.remote(self.path, rollout_id, snapshot_id=snapshot_id, version=version)

    def drop_batch(self, snapshots: list[tuple[str, str, int]]) -> Any:
        return self.actor.drop_batch.remote(self.path, snapshots)

    def delete_batch(self, rollout_ids: list[str]) -> Any:
        return self.actor.delete_batch.remote(self.path, rollout_ids)

    def sweep_retired(self, *, older_than_seconds: float) -> Any:
        return self.actor.sweep_retired.remote(self.path, older_than_seconds)

    def put(self, entry: TokenEntry) -> Any:
        return self.actor.put.remote(self.path, entry)

    def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> Any:
        return self.actor.mark_incomplete.remote(self.path, rollout_id, model_call_id)

    def begin_call(self, rollout_id: str, model_call_id: str) -> Any:
        return self.actor.begin_call.remote(self.path, rollout_id, model_call_id)


def _unwrapped(exc: ray.exceptions.RayTaskError) -> BaseException:
    # Ray wraps what the actor raised; callers classify errors by the original type.
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class ActorTokenSource:
    """The async TokenSource protocol over one directory of a node actor.

    `freeze` fetches the raw snapshot and parses it here, off the event loop, so a record
    that fails validation raises pydantic's ValidationError in the caller exactly as a
    local freeze would. Store errors (retired, corrupt line, ...) are re-raised as the
    original exception; only a lost actor surfaces as a Ray error."""

    def __init__(self, handle: DirectoryHandle):
        self.handle = handle

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        try:
            frozen: FrozenCapture = await self.handle.freeze_raw(rollout_id)
        except ray.exceptions.RayTaskError as exc:
            raise _unwrapped(exc) from None
        entries = await asyncio.to_thread(parse_entries, frozen.data)
        return TokenCaptureSnapshot(
            rollout_id=frozen.rollout_id,
            entries=tuple(entries),
            incomplete=frozen.incomplete,
            snapshot_id=frozen.snapshot_id,
            version=frozen.version,
        )

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        try:
            return await self.handle.drop(rollout_id, snapshot_id=snapshot_id, version=version)
        except ray.exceptions.RayTaskError as exc:
            raise _unwrapped(exc) from None

    async def close(self) -> None:
        """Wait for the actor's in-flight file work; the actor itself stays up (it is shared)."""
        await self.handle.actor.close.remote()
