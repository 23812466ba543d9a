"""`Rebuilder`: the rebuild session users make, with the options they gave it as the
default of its calls.

It is a Ray session (`raycap.cluster.rebuild.session.Session`): placement and actors kept
between calls. Its retirement is the one path every retirement takes
(`raycap.runs.directories`).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import ray

from raycap.cluster.plumbing.connect import connect_here
from raycap.cluster.rebuild.session import Session, _concat
from raycap.output.commit import OutputLock
from raycap.output.manifest import Manifest
from raycap.rows.executor import ExecutorChoice
from raycap.rows.local import Progress
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions, checked_rollout_ids
from raycap.runs.directories import retire_on
from raycap.runs.dispatch import parsed_dirs
from raycap.runs.retirement import OnShard, RetireReport


class Rebuilder(Session):
    """A rebuild session over one list of capture directories, with default options.

    Placement (which node serves each directory), the node actors and the cluster's CPU
    count are found on first use and kept, so every later call costs in proportion to
    its rollout ids: a training step with 64 ids is one actor round trip per directory
    and one builder task, whatever the directories' history.

    Options: see `raycap.rows.options.RebuildOptions` (checked here); they are the default of
    every call, and a call may change builder, model and delivery. `last_executor` says
    which executor ran, and why.

    Over one directory on this process's node, it keeps spare files there after each
    step, which the next step's freezes rename into place instead of creating files
    (`raycap.capture.spares`). `close()` (or leaving a `with` block) removes them, and so
    does the process's exit: close it before removing the directory. With spares=False
    it keeps none (its rollouts are frozen before it builds them, say)."""

    def __init__(
        self,
        capture_dirs: Iterable[Any],
        *,
        builder: str = "prefix_merging",
        model: str = "",
        delivery: str = "rollout",
        batch_size: int | None = None,
        max_in_flight: int | None = None,
        address: str | None = None,
        executor: str = "auto",
        verbose: bool = False,
        max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
        version_key: str | None = None,
        spares: bool = True,
    ) -> None:
        self.options = RebuildOptions.of(locals())
        super().__init__(parsed_dirs(capture_dirs), address=address)
        self.keeps_spares = spares

    def __enter__(self) -> Rebuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def executor(self) -> str:
        return self.options.executor

    def choose(
        self, rollout_ids: Sequence[str] | None = None, *, skip_retired: bool = False, writes_shards: bool = False
    ) -> ExecutorChoice:
        """Which executor a call with these ids would run on, and why."""
        return self.decide(rollout_ids, self.options.but(skip_retired=skip_retired), "shards" if writes_shards else "rows")

    def _call_options(
        self, skip_retired: bool, builder: str | None, model: str | None, delivery: str | None
    ) -> RebuildOptions:
        return self.options.but(builder=builder, model=model, delivery=delivery, skip_retired=skip_retired)

    def iter_rebuild(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        shard_dir: str | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> Iterator[Any]:
        """Rebuild in bounded memory, yielding Arrow tables (or, with `shard_dir`, the
        ShardInfo of each shard written there) whose rows, concatenated, are in the order
        of `rollout_ids` (sorted ids when listing)."""
        options = self._call_options(skip_retired, builder, model, delivery)
        yield from self.run(rollout_ids, options, progress=progress, shard_dir=shard_dir)

    def rebuild(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> pa.Table:
        """The rows of `rollout_ids` (every listed rollout when None) as one Arrow table."""
        options = self._call_options(skip_retired, builder, model, delivery)
        return _concat(self.run(rollout_ids, options, progress=progress), options)

    async def rebuild_async(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        refs: bool = False,
        skip_retired: bool = False,
        progress: Callable[[Progress], None] | None = None,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> pa.Table | list[Any]:
        """`rebuild` without blocking the event loop, so a trainer can overlap the next
        step's rebuild with training. With refs=True, the ObjectRefs of the batches'
        Arrow tables (in row order) instead, built with the same options: hand them to
        training workers, and the rows never pass through this process.

        The work runs in a worker thread, but Ray is never started there: an embedded
        Ray dies with the thread that started it (see `raycap.cluster.plumbing.connect`), which
        would leave the refs unfetchable once the pool thread ends. A call that needs
        Ray connects first, in the caller's thread (blocking the event loop for that
        first connection only); off the main thread it refuses to start an embedded Ray."""
        options = self._call_options(skip_retired, builder, model, delivery)
        ids = checked_rollout_ids(rollout_ids)
        if refs:
            connect_here(self.address, caller="rebuild_async")
            return await asyncio.to_thread(Session.refs, self, ids, options)
        # Deciding may stat the captures: off the event loop, like the work.
        choice: ExecutorChoice | None = await asyncio.to_thread(self.decide, ids, options)
        if choice.executor != "local" and not ray.is_initialized():
            connect_here(self.address, caller="rebuild_async")
            choice = None  # decided again by run, with Ray up (the first call may build here alongside it)
        return await asyncio.to_thread(lambda: _concat(self.run(ids, options, progress=progress, choice=choice), options))

    def rebuild_refs(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        skip_retired: bool = False,
        builder: str | None = None,
        model: str | None = None,
        delivery: str | None = None,
    ) -> list[Any]:
        """The ObjectRefs of the batches' Arrow tables, in row order (always on Ray); see `Session.refs`."""
        return self.refs(rollout_ids, self._call_options(skip_retired, builder, model, delivery))

    def list_rollouts(self, *, skip_retired: bool = False, executor: str | None = None) -> list[str]:
        """The sorted rollout ids with capture files in any of the directories."""
        return super().list_rollouts(skip_retired=skip_retired, executor=executor or self.executor)

    def retire(
        self,
        output: str | os.PathLike,
        *,
        on_shard: OnShard | None = None,
        executor: str | None = None,
        manifest: Manifest | None = None,
        lock: OutputLock | None = None,
    ) -> RetireReport:
        """Drop the exact snapshots of the committed output's successful, unmasked rows
        (see `raycap.runs.directories.retire_dirs`)."""
        return retire_on(
            self, output, self.dirs, executor=executor or self.executor, on_shard=on_shard, manifest=manifest, lock=lock
        )
