"""A stream's hold on one node's capture directories: the node side of a stream over `NODE:/path`.

The stream's hub (`raycap.cluster.streaming.driver_hub`) subscribes each node's actor.
While subscribed, the actor, on its node, for that stream:

- holds the directories' stream locks, watches them and judges rollouts by a local
  stream's rules (`raycap.stream.readiness`, `raycap.stream.watch`);
- pushes to the hub, in the order it judged them: what became ready, current commit
  markers naming a step, what is held back, the recoveries it finished;
- answers the stream's calls: `submit` (keep records, freeze, judge), `build` (a small
  build in the actor, IN_ACTOR_BYTES, a larger one in builder tasks on this node:
  `raycap.cluster.nodes.node_build`), `mark`, `drop` and `settle`. The stream's process
  never opens a capture or record file.

The subscription ends when the stream unsubscribes or its hub dies (the hub is an actor
of the stream's process): a killed trainer's locks are let go within moments, while a
second stream is refused for as long as the first lives. A rollout pushed as ready is
remembered until it is built, marked, dropped or found not ready, so it is never pushed
twice.

The contract in full: docs/internals.md ("A stream's node side").
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from raycap.capture.markers import CommitMarker
from raycap.capture.store import TokenCaptureStore
from raycap.cluster.plumbing.placement import local_path
from raycap.errors import UnknownSubscription  # noqa: F401 - raised here, declared with the others
from raycap.stream.readiness import (
    CHECK_STEP,
    COMMITTED,
    DAMAGED,
    READY,
    DirectoryBusy,
    drop_parts,
    frozen_live,
    judge,
    lock_directory,
    settle,
)
from raycap.stream.records import keep_records, kept_records
from raycap.stream.steps import SnapshotPart
from raycap.stream.watch import Watch

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 5.0
IO_THREADS = 8
# A build of at most this many capture bytes runs in the node actor itself: it costs
# less than a builder task's scheduling and a CPU slot, which a stream's take(1) would
# wait for on every rollout. Larger builds go to builder tasks, over the node's CPUs.
IN_ACTOR_BYTES = 8 << 20


@dataclass(frozen=True)
class Check:
    """A current commit marker that names a step: the stream's process reads the step and
    answers with `NodeStreams.settle` whether it holds this snapshot part."""

    rollout_id: str
    label: str
    snapshot_id: str
    version: int
    output: str
    masked: bool


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Subscription:
    """One stream's hold on this node's directories `dirs` ((label, path) pairs)."""

    def __init__(self, key: str, hub: Any, dirs: list[tuple[str, str]], watch: bool, node: str) -> None:
        self.key, self.hub, self.node = key, hub, node
        self.dirs = dirs
        self.paths = {label: local_path(path) for label, path in dirs}
        self.stores = {label: TokenCaptureStore(self.paths[label], create=False) for label, _ in dirs}
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._offered: dict[str, str] = {}  # rollout -> the snapshot pushed as ready
        self._asked: dict[str, str] = {}  # rollout -> the snapshot whose step check was pushed
        self._held: set[str] = set()
        self.watch = Watch(list(self.paths.values()), "raycap-node-watch") if watch else None
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-node-stream")
        self.ended = False

    def lock(self) -> None:
        try:
            for label, _ in self.dirs:
                self._fds.append(lock_directory(self.paths[label], label))
        except BaseException:
            self.release()
            raise

    def start(self) -> None:
        """Push what is ready now, then (watching) what becomes ready."""
        self.rescan()
        if self.watch is not None:
            self.watch.start(self.judge_and_push, self.rescan)

    def release(self) -> None:
        self.ended = True
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._pool.shutdown(wait=False)

    # -- discovery ----------------------------------------------------------------------

    def rescan(self) -> None:
        with self._lock:
            known = set(self._offered)
        self.judge_and_push(frozen_live(self.stores, known))

    def judge_and_push(self, ids: list[str]) -> None:
        events = []
        for rid in ids:
            if self.ended:
                return
            events.extend(self.events_of(rid))
        self.push(events)

    def push(self, events: list[tuple]) -> None:
        if events and not self.ended:
            self.hub.push.remote(self.key, self.node, events)  # a dead hub ends the subscription

    def events_of(self, rid: str) -> list[tuple]:
        """Judge `rid` and say what the stream must hear of it."""
        judged = judge(self.stores, rid)
        snapshot = judged.parts[0].snapshot_id if judged.parts else ""
        with self._lock:
            if judged.status == READY:
                if self._offered.get(rid) == snapshot:
                    return []
                self._offered[rid] = snapshot
                return [("ready", rid)]
            self._offered.pop(rid, None)
            if judged.status == CHECK_STEP:
                if self._asked.get(rid) == snapshot:
                    return []
                self._asked[rid] = snapshot
                part, marker = judged.parts[0], judged.marker
                assert marker is not None and marker.output is not None
                return [("check", Check(rid, part.label, part.snapshot_id, part.version, marker.output, marker.masked))]
            if judged.status == DAMAGED:
                if rid in self._held:
                    return []
                self._held.add(rid)
                return [("held", rid, judged.reason, True)]
        if judged.status == COMMITTED:
            settled = settle(self.stores, rid, judged, True)
            if settled.recovered == "finished":
                return [("count", "recovered_finished", 1)]
        return []

    def forget(self, rid: str) -> None:
        with self._lock:
            self._offered.pop(rid, None)
            self._asked.pop(rid, None)

    # -- the stream's calls -------------------------------------------------------------

    def submit(self, ids: list[str], records: dict[str, Any] | None = None) -> list[tuple[bool, Any]]:
        """For each (valid) id: whether a directory here holds it, and then None (its
        record kept, frozen and ready), a Check (its commit must be checked first), or
        why it is not ready."""
        held = {label: store.held(ids) for label, store in self.stores.items()}
        failed = keep_records(self.stores, held, {rid: kept for rid, kept in (records or {}).items() if rid in ids})
        for label, store in self.stores.items():
            mine = [rid for rid in ids if rid in held[label] and rid not in failed]
            for rid, frozen in zip(mine, store.freeze_many(mine, read=False)):
                if isinstance(frozen, str):
                    failed.setdefault(rid, frozen)
        out: list[tuple[bool, Any]] = []
        events: list[tuple] = []
        for rid in ids:
            if not any(rid in held[label] for label in self.stores):
                out.append((False, None))
            elif rid in failed:
                out.append((True, failed[rid]))
            else:
                judged = judge(self.stores, rid)
                if judged.status == READY:
                    with self._lock:
                        self._offered[rid] = judged.parts[0].snapshot_id
                    out.append((True, None))
                elif judged.status == CHECK_STEP:
                    part, marker = judged.parts[0], judged.marker
                    assert marker is not None and marker.output is not None
                    out.append((True, Check(rid, part.label, part.snapshot_id, part.version, marker.output, marker.masked)))
                elif judged.status == COMMITTED:
                    settled = settle(self.stores, rid, judged, True)
                    if settled.recovered == "finished":
                        events.append(("count", "recovered_finished", 1))
                    out.append((True, settled.status))
                else:
                    if judged.status == DAMAGED:
                        events.append(("held", rid, judged.reason, True))
                    out.append((True, judged.reason))
        self.push(events)
        return out

    def still_ready(self, ids: list[str]) -> tuple[list[str], list[str], dict[str, Any]]:
        """The ids that are still ready here, the others (forgotten, and those held back
        because their record file is damaged: said once each), and the records kept for
        the ready ones."""
        ready, gone = [], []
        for rid in ids:
            judged = judge(self.stores, rid)
            if judged.status == READY:
                ready.append(rid)
            else:
                gone.append(rid)
            self.forget(rid)
        records, damaged = kept_records(self.stores, ready)
        events: list[tuple] = []
        for rid, why in damaged.items():
            with self._lock:
                first = rid not in self._held
                self._held.add(rid)
            if first:
                events += [("held", rid, why, False), ("count", "damaged_records", 1)]
        self.push(events)
        return [rid for rid in ready if rid not in damaged], gone + list(damaged), records

    def capture_bytes(self, ids: list[str]) -> int:
        """The capture bytes of `ids` here, counted up to just past IN_ACTOR_BYTES."""
        total = 0
        for store in self.stores.values():
            total += sum(store.held(ids).values())
            if total > IN_ACTOR_BYTES:
                break
        return total

    def mark(self, items: list[tuple[str, SnapshotPart, CommitMarker]]) -> list[bool | str]:
        """Write each marker durably (True; False when the rollout is no longer that
        snapshot; the error's text when it failed). The fsyncs overlap on a few threads."""
        def one(item: tuple[str, SnapshotPart, CommitMarker]) -> bool | str:
            rid, part, marker = item
            self.forget(rid)
            try:
                return self.stores[part.label].write_commit(rid, marker)
            except Exception as exc:  # noqa: BLE001 - reported per rollout: not committed
                return _text(exc)

        return list(self._pool.map(one, items))

    def drop(self, items: list[tuple[str, list[SnapshotPart]]]) -> list[bool | str]:
        """Drop each rollout's exact parts, as `mark` writes markers."""
        def one(item: tuple[str, list[SnapshotPart]]) -> bool | str:
            rid, parts = item
            self.forget(rid)
            try:
                return drop_parts(self.stores, rid, parts)
            except Exception as exc:  # noqa: BLE001 - reported per rollout: not retired
                return _text(exc)

        return list(self._pool.map(one, items))

    def settle(self, items: list[tuple[Check, bool]]) -> list[str]:
        """The stream read the steps: finish or undo each checked commit, if the marker is
        still the one checked; each rollout's status after it."""
        out, events = [], []
        for check, committed in items:
            judged = judge(self.stores, check.rollout_id)
            with self._lock:
                self._asked.pop(check.rollout_id, None)
            if judged.status != CHECK_STEP or judged.snapshot != (check.snapshot_id, check.version):
                events.extend(self.events_of(check.rollout_id))
                out.append(judged.reason or judged.status)
                continue
            settled = settle(self.stores, check.rollout_id, judged, committed)
            if settled.recovered:
                events.append(("count", "recovered_" + settled.recovered, 1))
            if settled.status == READY:
                with self._lock:
                    self._offered[check.rollout_id] = check.snapshot_id
            out.append(settled.status)
        self.push(events)
        return out


class NodeStreams:
    """The subscriptions of one node actor (see the module docstring). `io(fn)` runs
    blocking file work on the actor's thread pool."""

    def __init__(self, io: Callable[..., Any]) -> None:
        self._io = io
        self.subs: dict[str, Subscription] = {}
        self._ended: dict[str, asyncio.Event] = {}

    def sub(self, key: str) -> Subscription:
        found = self.subs.get(key)
        if found is None:
            raise UnknownSubscription(f"no stream subscription {key} on this node (it ended, or the actor restarted)")
        return found

    async def subscribe(self, key: str, hub: Any, dirs: list[tuple[str, str]], watch: bool, node: str) -> None:
        """Hold `dirs` for the stream whose hub is `hub`; DirectoryBusy (one line) when a
        live stream holds one of them."""
        wanted = {local_path(path) for _, path in dirs}
        for other in list(self.subs.values()):
            if wanted & set(other.paths.values()):
                try:
                    await asyncio.wait_for(other.hub.ping.remote(), PING_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - its stream is gone (or hangs): it lets go
                    self.end(other.key)
                    continue
                label = next(label for label, path in other.paths.items() if path in wanted)
                raise DirectoryBusy(
                    f"another stream consumes {label} (a live stream holds it through this node's raycap actor); two "
                    "consumers would deliver the same rollouts twice: close the other stream first"
                )
        sub = Subscription(key, hub, dirs, watch, node)
        await self._io(sub.lock)
        self.subs[key] = sub
        self._ended[key] = asyncio.Event()
        asyncio.ensure_future(self._outlive(key, hub))
        try:
            await self._io(sub.start)
        except BaseException:
            self.end(key)
            raise

    async def _outlive(self, key: str, hub: Any) -> None:
        """End the subscription when its hub dies (the `closed` call only ever fails)."""
        try:
            await hub.closed.remote()
        except Exception:  # noqa: BLE001 - any failure means the hub is gone
            pass
        self.end(key)

    async def session(self, key: str) -> bool:
        """Returns when the subscription ends (False at once when there is none here: the
        hub then subscribes again)."""
        ended = self._ended.get(key)
        if ended is None:
            return False
        await ended.wait()
        return True

    def end(self, key: str) -> None:
        sub = self.subs.pop(key, None)
        if sub is not None:
            sub.release()
        ended = self._ended.pop(key, None)
        if ended is not None:
            ended.set()

    async def build(self, key: str, ids: list[str], options: Any, schema: Any, *, node: str, cpus: int,
                    sources: Callable[[list[tuple[str, str]]], list[Any]],
                    fetch: bool = False) -> tuple[list[tuple], list[str], dict]:
        """Build the ids still ready here: per batch its ids, metadata, bytes per rollout
        and rows ref (with `fetch`, the rows themselves, and no metadata); the ids found
        not ready (or held back); and the records kept for the ids built. A small build
        runs here (IN_ACTOR_BYTES), a larger one in builder tasks on this node."""
        import ray

        from raycap.cluster.nodes.node_build import build_and_describe, describe_build
        from raycap.rows.batch import IpcTable

        sub = self.sub(key)
        ready, gone, records = await self._io(sub.still_ready, ids)
        if not ready:
            return [], gone, {}
        if await self._io(sub.capture_bytes, ready) <= IN_ACTOR_BYTES:
            (meta, sizes), rows = await self._io(
                build_and_describe, 0, ready, sources(sub.dirs), options, schema, options.version_key,
            )
            if fetch:
                return [(ready, None, sizes, rows)], gone, records
            return [(ready, meta, sizes, ray.put(rows))], gone, records
        batches = describe_build(sources(sub.dirs), ready, options, node=node, cpus=cpus, schema=schema)
        metas = await asyncio.gather(*(meta for _, meta, _ in batches))
        if fetch:
            tables = await asyncio.gather(*(rows for _, _, rows in batches))
            return [(batch_ids, None, sizes, IpcTable(table))
                    for (batch_ids, _, _), (_, sizes), table in zip(batches, metas, tables)], gone, records
        built = [(batch_ids, meta, sizes, rows) for (batch_ids, _, rows), (meta, sizes) in zip(batches, metas)]
        return built, gone, records


def call_on(streams: NodeStreams, key: str, method: str, *args: Any) -> Any:
    """Run a subscription's blocking `method` (its file work) on the actor's pool."""
    sub = streams.sub(key)
    return streams._io(lambda: getattr(sub, method)(*args))

