"""A stream over directories that node actors serve: the `raycap.stream.dirs` implementation.

`NodeDirectories` is what a stream (`raycap.runs.stream`) works through when its directories
live on other nodes (`NODE:/path`, or plain paths that placement puts elsewhere). This
process talks to the stream's hub alone (`raycap.cluster.streaming.driver_hub`), and never opens,
lists or stats a capture file: the hub places the directories and the node actors do
their file work (`raycap.cluster.nodes.node_stream`).

- Discovery is one long-lived call at a time on the hub's inbox (`_listen`); what it
  brings is queued in one go, and the next call is made at once (what several nodes
  push together arrives in one call: the hub coalesces them).
- A build is one call: each node builds its share (a small one in its actor, no task),
  and the rows come back with it for a taker of tables (its take is then no round trip);
  for a taker of refs only the rows' metadata comes back, as one table, and the rows
  stay beside the nodes, kept by the hub. A few builds are out at once
  (`raycap.stream.buildahead`).
- A take's rows are cut out of their batches by the hub (`assemble`); rows lost with
  their node before they were taken are not delivered (`raycap.stream.steps.PiecesLost`).
- A commit's markers and drops are one call each; what a lost node could not do comes
  back as its reason, and the commit reports it (`raycap.stream.stepcommit`).
- A current commit marker naming a step is checked here, where the steps are written and
  read (`_check`), and its node finishes or undoes that commit.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Iterable

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.directory import CaptureDir
from raycap.cluster.nodes.actor import _unwrapped
from raycap.cluster.nodes.node_stream import Check
from raycap.cluster.plumbing.connect import connect_here
from raycap.cluster.plumbing.failures import cause_text
from raycap.cluster.plumbing.placement import locate
from raycap.cluster.streaming.driver_hub import StreamHub
from raycap.rows.options import RebuildOptions
from raycap.stream.steps import Built, PiecesLost, SnapshotPart, batch_slices, split_by_rollout, step_holds

logger = logging.getLogger(__name__)

EVENTS_WAIT_S = 10.0
BUILD_PER_NODE = 64
# Builds out at once (raycap.stream.buildahead): a rollout that becomes ready while a build is
# out starts its own at once rather than wait a round trip for it.
BUILDS_IN_FLIGHT = 4


def place(dirs: tuple[CaptureDir, ...], *, address: str | None) -> tuple[list[tuple[CaptureDir, str]], tuple[str, ...] | None]:
    """Join Ray and place plain paths as a rebuild does; also their paths when every one
    is served from this process's node (then this process reads them)."""
    connect_here(address, caller="Stream")
    placed = locate(dirs)
    here = ray.get_runtime_context().get_node_id()
    if len(placed) == len(dirs) and all(node == here for _, node in placed):
        return placed, tuple(d.path for d, _ in placed)
    return placed, None



class NodeDirectories:
    """The per-directory work of a stream whose directories node actors serve (see the
    module docstring and `raycap.stream.dirs`)."""

    judges_here = False
    # Rows name these directories by label; this process never resolves them.
    real_dirs = False

    def __init__(self, dirs: tuple[CaptureDir, ...], placed: list[tuple[CaptureDir, str]] | None, *,
                 options: RebuildOptions, watch: bool, schema: pa.Schema, address: str | None) -> None:
        """The stream's hub places `dirs` (unless `placed` already) and subscribes their
        nodes: a directory that cannot be served, or that another stream holds, raises
        here. This process talks to the hub alone."""
        connect_here(address, caller="Stream")
        self.options, self.schema = options, schema
        here = ray.get_runtime_context().get_node_id()
        # On this process's node, and owned by it: the hub lives exactly as long as the
        # stream's process can use it, and a lost node elsewhere never takes it along.
        self.hub = StreamHub.options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(uuid.uuid4().hex, list(dirs), placed, watch)
        self._node_of: dict[str, str] = {}  # the node of each rollout this stream was offered
        self._lock = threading.Lock()
        self._hooks: Any = None
        self._closed = False
        self._thread: threading.Thread | None = None
        try:
            self._paths = [tuple(p) for p in self._call(self.hub.open.remote())]
        except BaseException:
            ray.kill(self.hub)
            raise
        self.labels = tuple(label for label, _ in self._paths)
        self.build_batch = BUILD_PER_NODE * max(1, len(self.labels))
        self.builds_in_flight = BUILDS_IN_FLIGHT

    def _call(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            raise _unwrapped(exc) from None

    # -- discovery ----------------------------------------------------------------------------

    def start(self, hooks: Any) -> None:
        self._hooks = hooks
        self._thread = threading.Thread(target=self._listen, name="raycap-stream-events", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        """The stream's end of the inbox: one long-lived call at a time."""
        while not self._closed:
            try:
                events = ray.get(self.hub.events.remote(EVENTS_WAIT_S))
            except Exception as exc:  # noqa: BLE001 - the hub died: nothing more arrives
                if not self._closed:
                    logger.error("the stream's hub is gone (%s): close this stream and open a new one", cause_text(exc))
                return
            try:
                self._handle(events)
            except Exception as exc:  # noqa: BLE001 - one bad event must not end discovery
                logger.warning("handling what the nodes pushed failed (%s)", exc)

    def _handle(self, events: list[tuple]) -> int:
        """Act on what the nodes pushed, (node, event) in their order; how many rollouts
        it queued."""
        hooks = self._hooks
        checks: list[tuple[str, Check]] = []
        ready = []
        with self._lock:
            for node, event in events:
                if event[0] == "ready":
                    self._node_of[event[1]] = node
                    ready.append(event[1])
        queued = hooks.queue(ready) if ready else []
        for node, event in events:
            kind = event[0]
            if kind == "check":
                checks.append((node, event[1]))
            elif kind == "held":
                _, rid, why, damaged = event
                if hooks.hold_back(rid, why) and damaged:
                    hooks.count("damaged_markers", 1)
            elif kind == "count":
                hooks.count(event[1], event[2])
            elif kind == "lost":
                with self._lock:
                    ids = [rid for rid, n in self._node_of.items() if n == node]
                hooks.forget(ids)
            # "back": the rollouts of the node serving it again are pushed by it.
        if checks:
            # A commit its node undid (its step never held it) is ready again.
            reopened = [check.rollout_id for (node, check), status in zip(checks, self._check([c for _, c in checks]))
                        if status == "ready"]
            with self._lock:
                self._node_of.update((check.rollout_id, node) for node, check in checks)
            queued += hooks.queue(reopened)
        if queued:
            hooks.count("discovered", len(queued))
        return len(queued)

    def _check(self, checks: list[Check]) -> list[str]:
        """Read the steps that current markers name, and have their nodes finish or undo
        those commits; each rollout's status after it ("held": the stream holds it, and
        its own commit is what the marker records, so it is left to that commit)."""
        from raycap.output.faults import OutputError

        outputs: dict[str, Any] = {}
        answers: list[tuple[Check, bool]] = []
        status: dict[int, str] = {}
        for check in checks:
            if check.rollout_id in self._hooks.known:
                status[id(check)] = "held"
                continue
            try:
                held = step_holds(outputs, check.output, check.rollout_id, check.label, check.snapshot_id,
                                  check.version, real_dirs=False)
            except OutputError as exc:
                self._hooks.hold_back(check.rollout_id, f"its commit marker names the step {check.output}, whose {exc}")
                status[id(check)] = f"its step {check.output} cannot be read"
                continue
            answers.append((check, held))
        if answers:
            status.update(zip([id(c) for c, _ in answers], self._call(self.hub.settle.remote(answers))))
        return [status[id(check)] for check in checks]

    # -- readiness by submit -----------------------------------------------------------------

    def submit(self, ids: list[str], records: dict[str, Any] | None = None) -> dict[str, str | None]:
        answers = self._call(self.hub.submit.remote(ids, records or {}))
        out: dict[str, str | None] = {}
        checks = []
        for rid, (node, status) in zip(ids, answers):
            if node is not None:
                with self._lock:
                    self._node_of[rid] = node
            if isinstance(status, Check):
                checks.append(status)
                out[rid] = None
            else:
                out[rid] = status
        if checks:
            for check, status in zip(checks, self._check(checks)):
                if status not in ("ready", "held"):
                    out[check.rollout_id] = status
        return out

    # -- building ----------------------------------------------------------------------------

    def build(self, ids: list[str], refs: bool) -> tuple[list[Built], list[str]]:
        # A taker of tables gets the rows with the build: its take(1) is then no round
        # trip at all, as on local paths. Refs keep the rows beside their nodes.
        return self._build(ids, self.options, self.schema, fetch=not refs)

    def _build(self, ids: list[str], options: RebuildOptions, schema: pa.Schema,
               fetch: bool = False) -> tuple[list[Built], list[str]]:
        """Each node builds its share of `ids` (with `options`, rows in `schema`): one
        `Built` per rollout in their order, with the record its node keeps for it, and
        the ids found not ready there (or held back) or whose node is not known. With
        `fetch`, each `Built` holds its rows (brought here); else only their metadata,
        the rows staying beside their nodes, kept by the hub."""
        by_node: dict[str, list[str]] = {}
        unknown = []
        with self._lock:
            for rid in ids:
                node = self._node_of.get(rid)
                if node is None:
                    unknown.append(rid)
                else:
                    by_node.setdefault(node, []).append(rid)
        batches, meta, sizes, gone, failed, records = self._call(self.hub.build.remote(by_node, options, schema, fetch))
        if failed:
            self.hub.discard.remote([key for key, _ in batches], [n for _, n in batches])
            raise RuntimeError("; ".join(f"node {node[:12]}..: {why}" for node, why in failed.items()))
        pieces: dict[str, Built] = {}
        if fetch:
            for rid, piece in split_by_rollout(meta) if meta is not None else ():
                pieces[rid] = Built(rid, piece, piece.get_total_buffer_size(), record=records.get(rid))
            self._forget(gone)
            return [pieces[rid] for rid in ids if rid in pieces], [*gone, *unknown]
        split = iter(zip(split_by_rollout(meta), sizes)) if meta is not None else iter(())
        for key, count in batches:
            offset = 0
            for _ in range(count):
                (rid, piece), nbytes = next(split)
                pieces[rid] = Built(rid, piece, nbytes, key, offset, records.get(rid))
                offset += piece.num_rows
        self._forget(gone)
        return [pieces[rid] for rid in ids if rid in pieces], [*gone, *unknown]

    def discard(self, pieces: list[Built]) -> None:
        """Let go of built rows that will not be taken (they are built again)."""
        kept = [p for p in pieces if p.ref is not None]
        if kept:
            _, keys = batch_slices(kept)
            self.hub.discard.remote(keys, [sum(1 for p in kept if p.ref == key) for key in keys])

    def assemble(self, pieces: list[Built], oldest: int | None, values: list | None = None) -> Any:
        """The ref of the rows of `pieces`, cut out of their batches by the hub, with the
        record columns of `values` (one per piece), stale masks applied; PiecesLost for
        those lost with their node."""
        return self._rows(pieces, oldest, put=True, values=values)

    def fetch(self, pieces: list[Built]) -> pa.Table:
        """The rows of `pieces` in this process, in order (those built with their rows
        are here already; the others are cut out of their batches by the hub)."""
        if not pieces:
            return self.schema.empty_table()
        remote = [p for p in pieces if p.ref is not None]
        if not remote:
            return pa.concat_tables([p.table for p in pieces])
        if len(remote) == len(pieces):
            return self._rows(pieces, None, put=False)
        rows = self._rows(remote, None, put=False)
        at, offset = {}, 0
        for piece in remote:
            at[piece.rollout_id] = rows.slice(offset, piece.rows)
            offset += piece.rows
        return pa.concat_tables([p.table if p.ref is None else at[p.rollout_id] for p in pieces])

    def single_rows(self, ids: list[str]) -> pa.Table:
        """The single-response rows of `ids`, built again by their nodes and brought
        here: what a record taken in chain delivery is finalized from (the snapshots are
        frozen: the same ones are read)."""
        from raycap.rows.batch import schema_of

        options = self.options.but(delivery="rollout")
        schema = schema_of("rollout", options.version_key)
        pieces, _ = self._build(ids, options, schema)
        if not pieces:
            return schema.empty_table()
        return self._rows(pieces, None, put=False, schema=schema)

    def _rows(self, pieces: list[Built], oldest: int | None, *, put: bool, values: list | None = None,
              schema: pa.Schema | None = None) -> Any:
        slices, keys = batch_slices(pieces)
        counts = [sum(1 for p in pieces if p.ref == key) for key in keys]
        rows, lost = self._call(self.hub.assemble.remote(
            slices, keys, oldest, schema or self.schema, self.options.version_key, counts, put, values,
        ))
        if lost:
            raise PiecesLost([p.rollout_id for p in pieces if p.ref in set(lost)])
        return rows

    # -- committing --------------------------------------------------------------------------

    def mark(self, items: list[tuple[str, SnapshotPart, Any]]) -> list[bool | str]:
        return self._call(self.hub.mark.remote(items)) if items else []

    def drop(self, items: list[tuple[str, list[SnapshotPart]]]) -> list[bool | str]:
        return self._call(self.hub.drop.remote(items)) if items else []

    def settled(self, ids: list[str]) -> None:
        self._forget(ids)

    def _forget(self, ids: Iterable[str]) -> None:
        with self._lock:
            for rid in ids:
                self._node_of.pop(rid, None)

    def check_output(self, out: Any) -> None:
        from raycap.output.commit import check_placement

        check_placement(out, (), elsewhere=self._paths)

    def close(self) -> None:
        self._closed = True
        try:
            ray.get(self.hub.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the hub is killed below either way
            pass
        if self._thread is not None:
            self._thread.join(timeout=EVENTS_WAIT_S + 5)
        ray.kill(self.hub)

