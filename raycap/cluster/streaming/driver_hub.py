"""A stream's hub: the one actor a stream's process talks to when node actors serve its directories.

A stream whose directories live on other nodes (`raycap.cluster.streaming.driver_dirs`)
has one `StreamHub`, an actor of the stream's process, on its node. The node actors do
the file work (`raycap.cluster.nodes.node_stream`); the stream's process never opens a
capture file, and what it pays per step does not grow with the nodes.

- It places the directories (`open`), probing from the cluster, not the stream's process.
- Its life is the stream's lock: node actors hold their directories' stream locks for
  the hub's subscription (`closed` never returns) and let go when the hub dies.
- It is the stream's inbox: node actors `push`, the stream waits in one call (`events`).
- It sends each node its share of a call (`submit`, `build`, `mark`, `drop`, `settle`)
  and keeps the refs of the rows each node builds; `assemble` cuts a take's rows out.
- It watches the nodes (every LIVENESS_S): a lost node's untaken ready rollouts are
  forgotten until its directories are found again (every RELOCATE_S); nothing on its
  disk is lost.

The long form: docs/internals.md ("A stream's hub").
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

import pyarrow as pa
import ray

from raycap.cluster.nodes.actor import _unwrapped
from raycap.cluster.nodes.fleet import _node_actors
from raycap.cluster.nodes.node_stream import Check
from raycap.cluster.plumbing.failures import cause_text
from raycap.cluster.plumbing.placement import dead_nodes, locate
from raycap.rows.batch import IpcTable
from raycap.rows.options import RebuildOptions
from raycap.stream.steps import SnapshotPart, assemble

logger = logging.getLogger(__name__)

# What nodes push within this long of each other is answered in one call.
COALESCE_S = 0.005
RELOCATE_S = 2.0
LIVENESS_S = 1.0


def _lost_text(label: str, node: str) -> str:
    return f"the node ({node[:12]}..) serving capture directory {label} is gone"


@ray.remote(num_cpus=0)
class StreamHub:
    """A stream's hub (see the module docstring): `specs` are the stream's directories,
    placed by `open` (with `placed`, already placed by the stream's process:
    (spec, node id) pairs)."""

    def __init__(self, key: str, specs: list[Any], placed: list[tuple[Any, str]] | None, watch: bool) -> None:
        # Placement and starting actors block: they run on executor threads, never on this
        # actor's event loop, so Ray's warning about blocking calls in async actors is moot.
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self.key = key
        self.watch = watch
        self._specs, self._placed = specs, placed
        self.node_of: dict[str, str] = {}
        self.paths: dict[str, str] = {}
        self.actors: dict[str, Any] = {}
        self.lost: set[str] = set()
        self._inbox: list[tuple] = []
        self._wake = asyncio.Event()
        self._batches: dict[str, list[Any]] = {}  # batch key -> [rows ref, rollouts not yet taken, node]
        self._closed = False
        self._tasks: list[asyncio.Task] = []

    # -- life -------------------------------------------------------------------------------

    async def closed(self) -> None:
        """Never returns: node actors await it to learn that this hub (its stream) died."""
        await asyncio.Event().wait()

    async def ping(self) -> bool:
        return True

    def _labels(self, node: str) -> list[str]:
        return [label for label, n in self.node_of.items() if n == node]

    async def _subscribe(self, node: str) -> None:
        dirs = [(label, self.paths[label]) for label in self._labels(node)]
        me = ray.get_runtime_context().current_actor
        await self.actors[node].stream_subscribe.remote(self.key, me, dirs, self.watch)
        self._tasks.append(asyncio.ensure_future(self._session(node)))

    async def open(self) -> list[tuple[str, str]]:
        """Place the directories (here, never in the stream's process, which must not look
        at them), find or start their nodes' actors, and subscribe every node. Returns
        each directory's (label, path). Raises what placement raises, and RuntimeError
        (the reason, one line) when a node refuses (another stream holds a directory),
        after letting go of the others."""
        loop = asyncio.get_running_loop()
        placed = self._placed
        if placed is None:
            placed = await loop.run_in_executor(None, locate, self._specs)
        for d, node in placed:
            self.node_of[d.label] = node
            self.paths[d.label] = d.path
        nodes = list(dict.fromkeys(node for _, node in placed))
        self.actors = await loop.run_in_executor(None, _node_actors, nodes)
        results = await asyncio.gather(*(self._subscribe(node) for node in nodes), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close()
            exc = failed[0]
            cause = _unwrapped(exc) if isinstance(exc, ray.exceptions.RayTaskError) else exc
            raise RuntimeError(str(cause).splitlines()[0] if str(cause) else cause_text(exc))
        self._tasks.append(asyncio.ensure_future(self._liveness()))
        return [(d.label, d.path) for d, _ in placed]

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        await asyncio.gather(
            *(actor.stream_unsubscribe.remote(self.key) for node, actor in self.actors.items() if node not in self.lost),
            return_exceptions=True,
        )
        for task in self._tasks:
            task.cancel()

    async def _session(self, node: str) -> None:
        """Wait on the node's subscription: when its actor restarted, subscribe again;
        when it ended otherwise (its node died), the liveness check sees it."""
        while not self._closed and node not in self.lost:
            try:
                held = await self.actors[node].stream_session.remote(self.key)
            except Exception:  # noqa: BLE001 - the actor died: its node, or the actor alone
                held = False
            if self._closed or node in self.lost:
                return
            if not held:
                if await self._dead({node}):
                    await self._lose(node)
                    return
                try:
                    dirs = [(label, self.paths[label]) for label in self._labels(node)]
                    await self.actors[node].stream_subscribe.remote(
                        self.key, ray.get_runtime_context().current_actor, dirs, self.watch
                    )
                except Exception as exc:  # noqa: BLE001 - said once; checked again shortly
                    logger.warning("subscribing again to node %s failed (%s)", node[:12], cause_text(exc))
                    await asyncio.sleep(LIVENESS_S)

    async def _dead(self, nodes: set[str]) -> set[str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, dead_nodes, nodes)

    async def _liveness(self) -> None:
        while not self._closed:
            await asyncio.sleep(LIVENESS_S)
            live = set(self.actors) - self.lost
            for node in await self._dead(live):
                await self._lose(node)

    async def _lose(self, node: str) -> None:
        if node in self.lost:
            return
        self.lost.add(node)
        for key in [key for key, batch in self._batches.items() if batch[2] == node]:
            del self._batches[key]  # its rows went with it
        labels = self._labels(node)
        logger.warning("the node %s.. serving %s is gone; its ready rollouts wait for it", node[:12], ", ".join(labels))
        self._post(node, ("lost", labels))
        self._tasks.append(asyncio.ensure_future(self._relocate(node, labels)))

    async def _relocate(self, node: str, labels: list[str]) -> None:
        """Look for a lost node's directories again until they are served somewhere."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(RELOCATE_S)
            try:
                placed = await loop.run_in_executor(None, locate, labels)
                nodes = sorted({n for _, n in placed})
                if len(nodes) != 1 or len(placed) != len(labels):
                    continue
                new = nodes[0]
                actors = await loop.run_in_executor(None, _node_actors, [new])
            except Exception:  # noqa: BLE001 - not back yet
                continue
            for label in labels:
                self.node_of[label] = new
            self.actors[new] = actors[new]
            try:
                await self._subscribe(new)
            except Exception as exc:  # noqa: BLE001 - tried again
                logger.warning("serving %s again on node %s failed (%s)", ", ".join(labels), new[:12], cause_text(exc))
                continue
            self.lost.discard(new)
            logger.warning("capture directories %s are served again, by node %s..", ", ".join(labels), new[:12])
            self._post(new, ("back", labels))
            return

    # -- the inbox ----------------------------------------------------------------------------

    def _post(self, node: str, event: tuple) -> None:
        self._inbox.append((node, event))
        self._wake.set()

    async def push(self, key: str, node: str, events: list[tuple]) -> None:
        """A node actor's findings, in its order, each kept with its node."""
        if key != self.key or node in self.lost:
            return
        self._inbox.extend((node, event) for event in events)
        self._wake.set()

    async def events(self, timeout: float) -> list[tuple]:
        """What the nodes pushed since the last call, as (node, event), and the nodes
        lost and back; waiting up to `timeout` for some."""
        if not self._inbox and not self._closed:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            else:
                await asyncio.sleep(COALESCE_S)
        out, self._inbox = self._inbox, []
        return out

    # -- the stream's calls -------------------------------------------------------------------

    async def _each(self, method: str, by_node: dict[str, Any]) -> dict[str, Any]:
        """Call `method` on each node's actor with its share; each node's answer, or the
        exception (a lost node answers without being asked)."""
        nodes = [node for node in by_node if node not in self.lost]
        answers = await asyncio.gather(
            *(getattr(self.actors[node], method).remote(self.key, *by_node[node]) for node in nodes),
            return_exceptions=True,
        )
        out: dict[str, Any] = {node: ConnectionError("lost") for node in by_node if node in self.lost}
        for node, answer in zip(nodes, answers):
            if isinstance(answer, BaseException) and await self._dead({node}):
                await self._lose(node)
            out[node] = answer
        return out

    async def submit(self, ids: list[str], records: dict[str, Any]) -> list[tuple[str | None, Any]]:
        """Each id's node (None: held nowhere) and its status there (None: ready); the
        node that holds an id keeps its record (`records`) before freezing it. Every
        live node is asked, with every record: which one holds an id is known only by
        asking, and one round trip costs less than two."""
        live = [node for node in self.actors if node not in self.lost]
        answers = await self._each("stream_submit", {node: (ids, records) for node in live})
        out: list[tuple[str | None, Any]] = []
        for i, rid in enumerate(ids):
            holders, statuses, failures = [], [], []
            for node in live:
                answer = answers[node]
                if isinstance(answer, BaseException):
                    failures.append(f"{', '.join(self._labels(node))}: {cause_text(answer)}")
                    continue
                held, status = answer[i]
                if held:
                    holders.append(node)
                    statuses.append(status)
            if len(holders) > 1:
                out.append((None, f"rollout {rid} is held on several nodes ({', '.join(h[:12] for h in holders)}); a "
                                  "stream over node directories takes each rollout from one node's directories: "
                                  "build it with raycap.rebuild"))
            elif holders:
                out.append((holders[0], statuses[0]))
            else:
                lost = [label for node in self.lost for label in self._labels(node)]
                why = f"; the node(s) serving {', '.join(lost)} are lost: submit it again once they are back" if lost else ""
                why += f"; unreachable: {'; '.join(failures)}" if failures else ""
                out.append((None, f"no capture of rollout {rid} is in any of the stream's directories "
                                  f"({', '.join(self.node_of)}){why}; submit a rollout after its calls were captured"))
        return out

    async def build(self, by_node: dict[str, list[str]], options: RebuildOptions, schema: pa.Schema,
                    fetch: bool = False) -> tuple:
        """Each node builds its ids. Returns the batches ((batch key, rollouts) each, kept
        here), their metadata as one table, the bytes per rollout, the ids found not ready
        or lost, the nodes whose build failed otherwise (with why), and the records the
        nodes keep for the ids built. With `fetch` (a taker of tables), the rows
        themselves come back in place of the metadata, and nothing is kept here: the
        stream's take then hands them out with no further round trip."""
        answers = await self._each(
            "stream_build", {node: (ids, options, schema, fetch) for node, ids in by_node.items()}
        )
        batches, metas, sizes, gone, failed, records = [], [], [], [], {}, {}
        for node, answer in answers.items():
            if isinstance(answer, BaseException):
                if node in self.lost:
                    gone.extend(by_node[node])
                else:
                    failed[node] = cause_text(answer)
                continue
            built, not_ready, kept = answer
            gone.extend(not_ready)
            records.update(kept)
            for ids, meta, batch_sizes, rows in built:
                if fetch:
                    metas.append(rows)  # the rows themselves: nothing is kept here
                    sizes.extend(batch_sizes)
                    continue
                key = uuid.uuid4().hex
                self._batches[key] = [rows, len(ids), node]
                batches.append((key, len(ids)))
                metas.append(meta)
                sizes.extend(batch_sizes)
        # One table for the stream's process, however many nodes and batches built it.
        meta = IpcTable(pa.concat_tables(metas)) if metas else None
        return batches, meta, sizes, gone, failed, records

    async def assemble(self, slices: list[tuple[int, int, int]], keys: list[str], oldest: int | None,
                       schema: pa.Schema, version_key: str | None, counts: list[int], put: bool,
                       values: list | None = None) -> tuple[Any, list[str]]:
        """The taken rows (`slices` of the batches `keys`), with the record columns of
        `values` (one per slice), stale masks applied, cut out here: with `put`, the ref
        of one object holding them (beside the stream's process), else the rows
        themselves. Also the batch keys whose rows were lost with their node (then
        nothing else: the caller takes again without them)."""
        missing = [key for key in keys if key not in self._batches]
        if missing:
            return None, missing
        batches = await asyncio.gather(*(self._batches[key][0] for key in keys), return_exceptions=True)
        lost = [key for key, batch in zip(keys, batches) if isinstance(batch, BaseException)]
        if lost:
            return None, lost
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(
            None, lambda: assemble(schema, version_key, slices, oldest, *batches, values=values)
        )
        self.discard(keys, counts)
        return (ray.put(IpcTable(rows)) if put else IpcTable(rows)), []

    def discard(self, keys: list[str], counts: list[int]) -> None:
        """`counts[i]` rollouts of batch `keys[i]` are done with (taken, or forgotten): a
        batch with none left is let go."""
        for key, n in zip(keys, counts):
            batch = self._batches.get(key)
            if batch is None:
                continue
            batch[1] -= n
            if batch[1] <= 0:
                del self._batches[key]

    async def _by_label(self, method: str, items: list[tuple], label_of) -> list[Any]:
        by_node: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_node.setdefault(self.node_of[label_of(item)], []).append(i)
        answers = await self._each(method, {node: ([items[i] for i in at],) for node, at in by_node.items()})
        out: list[Any] = [None] * len(items)
        for node, at in by_node.items():
            answer = answers[node]
            for j, i in enumerate(at):
                if isinstance(answer, BaseException):
                    out[i] = _lost_text(label_of(items[i]), node) if node in self.lost else cause_text(answer)
                else:
                    out[i] = answer[j]
        return out

    async def mark(self, items: list[tuple[str, SnapshotPart, Any]]) -> list[bool | str]:
        return await self._by_label("stream_mark", items, lambda item: item[1].label)

    async def drop(self, items: list[tuple[str, list[SnapshotPart]]]) -> list[bool | str]:
        return await self._by_label("stream_drop", items, lambda item: item[1][0].label)

    async def settle(self, items: list[tuple[Check, bool]]) -> list[str]:
        return await self._by_label("stream_settle", items, lambda item: item[0].label)


