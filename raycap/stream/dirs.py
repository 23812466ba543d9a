"""A stream's directories: the per-directory work, behind one small interface, wherever it runs.

A stream's rules (`raycap.runs.stream`) are the same for every directory; only where the
file work runs differs, and that is all a directories class does (`LocalDirectories`
here, `NodeDirectories` for directories on other nodes):

- lock the directories for the stream (`raycap.stream.readiness.lock_directory`);
- find the ready rollouts (at start, and with `watch` continuously) and offer them to
  the stream in the order they became ready, per directory;
- keep the records `submit` gives beside their captures, and freeze what it names;
- build ready rollouts with their kept records (`build`) and hand out their rows
  (`assemble`, `fetch`, `single_rows`);
- write commit markers (`mark`), drop committed snapshots (`drop`) and let go of
  settled rollouts (`settled`); say where a step output may not go (`check_output`).

`LocalDirectories` (here): plain paths this process reads; it judges here and builds
through the builds it is given (`raycap.runs.streamdirs.StreamBuilds`), in this process
or on Ray. `raycap.cluster.streaming.driver_dirs.NodeDirectories`: directories their
nodes' actors serve, this process never opening a capture file. Which one a stream gets
is `raycap.runs.streamdirs.open_directories`' choice.

This module does not import Ray; the Ray work it asks for is imported when it runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raycap.capture.store import CommitMarker, TokenCaptureStore
from raycap.output.faults import OutputError
from raycap.output.location import Location
from raycap.rows.options import RebuildOptions
from raycap.stream.readiness import (
    CHECK_STEP,
    DAMAGED,
    NOT_READY,
    READY,
    DirectoryBusy,
    drop_parts,
    frozen_live,
    judge,
    lock_directory,
    settle,
)
from raycap.stream.records import keep_records, kept_records
from raycap.stream.steps import Built, SnapshotPart, batch_slices, conform, ray_task, split_by_rollout, step_holds
from raycap.stream.watch import Watch

logger = logging.getLogger(__name__)

# The most rollouts one build call takes: a training step's batch, so task overhead is
# paid once per step, not once per rollout.
BUILD_BATCH = 64
IO_THREADS = 8


@dataclass(frozen=True)
class Hooks:
    """What a stream's directories call on the stream.

    - `offer(rid, outputs)`: a rollout that may be ready, which the stream judges with
      the directories' `judge`; the stream's verdict: "queued", None (it holds it already)
      or why it is not ready.
    - `queue(ids)`: rollouts judged ready where they live (not `judges_here`), in their
      order; the ones the stream queued (it skips those it holds already).
    - `forget(ids)`: rollouts that are no longer deliverable from here (their node was
      lost): dropped from the queue and from what the stream holds, taken rows excepted.
    - `count(stat, n)`: add to a `raycap.runs.stream.StreamStats` counter.
    - `hold_back(rid, why)`: say once that a rollout is held back; True the first time.
    - `known`: the rollouts the stream holds (a rescan skips them)."""

    offer: Callable[[str, dict | None], str | None]
    queue: Callable[[list[str]], list[str]]
    forget: Callable[[Iterable[str]], None]
    count: Callable[[str, int], None]
    hold_back: Callable[[str, str], bool]
    known: Container[str]


class LocalDirectories:
    """The per-directory work of a stream over plain paths, in this process (see the
    module docstring)."""

    judges_here = True
    real_dirs = True  # rows name these directories by path, compared by real path
    build_batch = BUILD_BATCH
    builds_in_flight = 1  # builds in this process: one at a time (raycap.stream.buildahead)

    def __init__(self, paths: Sequence[str], *, options: RebuildOptions, watch: bool, schema: pa.Schema,
                 builds: Callable[[list[str]], Any]) -> None:
        self.paths = list(paths)
        self.labels = tuple(self.paths)
        self.stores = {path: TokenCaptureStore(path, create=False) for path in self.paths}
        self.schema, self.version_key = schema, options.version_key
        self.rebuilder: Any = None
        self.watch: Watch | None = None
        self._lock_fds: list[int] = []
        self._hooks: Hooks | None = None
        # Markers and drops of a step wait on fsyncs, not the CPU: a few threads overlap them.
        self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-stream-io")
        try:
            for path in self.paths:
                try:
                    self._lock_fds.append(lock_directory(path))
                except DirectoryBusy as exc:
                    raise RuntimeError(str(exc)) from None
            self.rebuilder = builds(self.paths)
            if watch:
                self.watch = Watch(self.paths, "raycap-stream-watch")  # before the first scan
        except BaseException:
            self.close()
            raise

    # -- discovery -------------------------------------------------------------------------

    def start(self, hooks: Hooks) -> None:
        """Offer what is ready now, then (watching) what becomes ready."""
        self._hooks = hooks
        self.rescan()
        if self.watch is not None:
            self.watch.start(self._on_rollouts, self.rescan)

    def _on_rollouts(self, ids: list[str]) -> None:
        assert self._hooks is not None
        for rid in ids:
            if self._hooks.offer(rid, None) == "queued":
                self._hooks.count("discovered", 1)

    def rescan(self) -> None:
        """One pass over each directory's names: offer the live, frozen rollouts the
        stream does not hold, oldest freeze first."""
        hooks = self._hooks
        assert hooks is not None
        outputs: dict[str, Any] = {}
        for rid in frozen_live(self.stores, hooks.known):
            if hooks.offer(rid, outputs) == "queued":
                hooks.count("discovered", 1)

    def judge(self, rid: str, outputs: dict[str, Any]) -> str:
        """"ready", or why `rid` is not; finishes or undoes a commit its marker records
        (`raycap.stream.readiness`), reading the marker's step here."""
        hooks = self._hooks
        assert hooks is not None
        judged = judge(self.stores, rid)
        if judged.status == READY:
            return READY
        if judged.status == NOT_READY:
            return judged.reason
        if judged.status == DAMAGED:
            if hooks.hold_back(rid, judged.reason):
                hooks.count("damaged_markers", 1)
            return judged.reason
        marker = judged.marker
        assert marker is not None
        committed = True
        if judged.status == CHECK_STEP:
            first = judged.parts[0]
            try:
                committed = step_holds(outputs, marker.output, rid, first.label, first.snapshot_id, first.version)
            except OutputError as exc:
                # Whether it holds the rows cannot be told: neither delivered (maybe
                # twice) nor retired (maybe lost) until someone looks.
                hooks.hold_back(rid, f"its commit marker names the step {marker.output}, whose {exc}")
                return f"its step {marker.output} cannot be read"
        settled = settle(self.stores, rid, judged, committed)
        if settled.recovered == "ready":
            hooks.count("recovered_ready", 1)
            logger.info("rollout %s: its step %s was never committed; delivering it again", rid, marker.output)
        elif settled.recovered == "finished":
            hooks.count("recovered_finished", 1)
            logger.info("rollout %s: finished the retirement of its committed snapshot", rid)
        return settled.status

    # -- readiness by submit -----------------------------------------------------------------

    def submit(self, ids: list[str], records: dict[str, Any] | None = None) -> dict[str, str | None]:
        """Keep the `records` of these (valid) ids, then freeze the ids in every
        directory holding them: None for each one frozen, else why not (no directory
        holds it, its record could not be kept, or its freeze failed)."""
        held = {path: store.held(ids) for path, store in self.stores.items()}
        refused: dict[str, str] = {}
        for rid in ids:
            if not any(rid in held[path] for path in self.paths):
                refused[rid] = (
                    f"no capture of rollout {rid} is in any of the stream's directories ({', '.join(self.paths)}); "
                    "submit a rollout after its calls were captured"
                )
        refused.update(keep_records(self.stores, held, records or {}))
        for path, store in self.stores.items():
            mine = [rid for rid in ids if rid in held[path] and rid not in refused]
            for rid, frozen in zip(mine, store.freeze_many(mine, read=False)):
                if isinstance(frozen, str):
                    refused.setdefault(rid, frozen)
        return {rid: refused.get(rid) for rid in ids}

    # -- building ----------------------------------------------------------------------------

    def build(self, ids: list[str], refs: bool) -> tuple[list[Built], list[str]]:
        """Build `ids`, one `Built` per rollout in their order, with the record kept for
        it, and the ids held back because their record file is damaged (said once each).
        Where the rebuilder builds on Ray (and its workers are up) and refs are wanted,
        the rows stay in the object store and only their metadata comes here."""
        records, damaged = kept_records(self.stores, ids)
        hooks = self._hooks
        for rid, why in damaged.items():
            if hooks is not None and hooks.hold_back(rid, why):
                hooks.count("damaged_records", 1)
        gone = list(damaged)
        ids = [rid for rid in ids if rid not in damaged]
        if not ids:
            return [], gone
        choice = self.rebuilder.decide(ids, self.rebuilder.options)
        if choice.executor != "ray" or choice.cold or not refs:
            table = conform(self.rebuilder.rebuild(ids), self.schema, self.version_key)
            return [
                Built(rid, piece, piece.get_total_buffer_size(), record=records.get(rid))
                for rid, piece in split_by_rollout(table)
            ], gone
        import ray

        batches = self.rebuilder.rebuild_refs(ids)
        describe = ray_task("describe")
        # A batch lost while it ran raises here: every id of this build is built again.
        described = ray.get([describe.remote(ref, self.schema, self.version_key) for ref in batches])
        out = []
        for ref, (meta, sizes) in zip(batches, described):
            offset = 0
            for (rid, piece), nbytes in zip(split_by_rollout(meta), sizes):
                out.append(Built(rid, piece, nbytes, ref, offset, records.get(rid)))
                offset += piece.num_rows
        return out, gone

    def single_rows(self, ids: list[str]) -> pa.Table:
        """The single-response rows of `ids`, here: what a record taken in chain
        delivery is finalized from (the snapshots are frozen: the same ones are read)."""
        return self.rebuilder.rebuild(ids, delivery="rollout")

    def assemble(self, pieces: list[Built], oldest: int | None, values: list | None = None) -> Any:
        """The ref of the rows of `pieces` (all built on Ray), cut out of their batches
        by a Ray task, with the record columns of `values` (one per piece), stale masks
        applied."""
        slices, batches = batch_slices(pieces)
        return ray_task("assemble").remote(self.schema, self.version_key, slices, oldest, *batches, values=values)

    def fetch(self, pieces: list[Built]) -> pa.Table:
        """The rows of `pieces` in this process, in order (rows built on Ray are fetched)."""
        if not pieces:
            return self.schema.empty_table()
        tables: dict[Any, pa.Table] = {}
        remote = list(dict.fromkeys(p.ref for p in pieces if p.ref is not None))
        if remote:
            import ray

            for ref, table in zip(remote, ray.get(remote)):
                tables[ref] = conform(table, self.schema, self.version_key)
        return pa.concat_tables(
            [p.table if p.ref is None else tables[p.ref].slice(p.offset, p.rows) for p in pieces]
        )

    # -- committing ----------------------------------------------------------------------------

    def mark(self, items: list[tuple[str, SnapshotPart, CommitMarker]]) -> list[bool | str]:
        """Write each (rollout, its first part, marker) durably: True, or False when the
        rollout is no longer that snapshot."""
        return list(self._io.map(lambda item: self.stores[item[1].label].write_commit(item[0], item[2]), items))

    def drop(self, items: list[tuple[str, list[SnapshotPart]]]) -> list[bool | str]:
        """Drop each rollout's exact snapshot parts: True, or False when one changed."""
        return list(self._io.map(lambda item: self.drop_one(*item), items))

    def drop_one(self, rid: str, parts: list[SnapshotPart]) -> bool:
        return drop_parts(self.stores, rid, parts)

    def settled(self, ids: list[str]) -> None:
        """These rollouts' commit is over: nothing here keeps anything of them."""

    def check_output(self, out: Location) -> None:
        """OutputError when a step output at `out` would corrupt something."""
        from raycap.output.commit import check_placement

        check_placement(out, self.paths)

    def close(self) -> None:
        """Stop watching and release the directories. Writes nothing."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []
        self._io.shutdown(wait=True)
