"""Where a stream's directories are served, and what a stream over local paths builds with.

`open_directories` chooses: plain paths are served here (`raycap.stream.dirs.LocalDirectories`)
when no Ray cluster is joined or asked for (or `executor="local"`); otherwise they are
placed as a rebuild places them (`raycap.cluster.streaming.driver_dirs.place`), and served here only
when every one is on this process's node. A `NODE:/path` is always served by its node's
actor (`raycap.cluster.streaming.driver_dirs.NodeDirectories`).

`StreamBuilds` builds for `LocalDirectories`: each build goes through the one dispatch
(`raycap.runs.dispatch`), so a stream whose builds run here never imports Ray; the Ray
session (a `Rebuilder` keeping no spare files) is made on the first build that runs there.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import pyarrow as pa

from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.capture.directory import local_paths
from raycap.rows.batch import schema_of
from raycap.rows.executor import ExecutorChoice, Request, ray_running
from raycap.rows.options import RebuildOptions, checked_rollout_ids
from raycap.runs.dispatch import choose, executor_for, parsed_dirs
from raycap.stream.dirs import LocalDirectories


class StreamBuilds:
    """The builds of a stream over local paths (see the module docstring)."""

    def __init__(self, paths: Sequence[str], options: RebuildOptions, address: str | None) -> None:
        self.dirs = parsed_dirs(list(paths))
        self.options = options
        self.address = address
        self.last_executor: ExecutorChoice | None = None
        self._rebuilder: Any = None

    def _on_ray(self) -> Any:
        if self._rebuilder is None:
            from raycap.runs.rebuilder import Rebuilder

            options = self.options
            self._rebuilder = Rebuilder(
                self.dirs, builder=options.builder, model=options.model, delivery=options.delivery,
                executor=options.executor, address=self.address, version_key=options.version_key,
                spares=False,  # a stream builds rollouts frozen already: no file for a spare to be
            )
        return self._rebuilder

    def decide(self, rollout_ids: Sequence[str], options: RebuildOptions) -> ExecutorChoice:
        """Which executor a build of these ids runs on, and why."""
        return choose(Request(self.dirs, checked_rollout_ids(rollout_ids), options, "rows", self.address), self._on_ray)

    def rebuild(self, rollout_ids: Sequence[str], *, delivery: str | None = None) -> pa.Table:
        """The rows of `rollout_ids` as one table (in `delivery`, else the stream's)."""
        options = self.options.but(delivery=delivery, skip_retired=False)
        ids = checked_rollout_ids(rollout_ids)
        runner, choice = executor_for(Request(self.dirs, ids, options, "rows", self.address), on_ray=self._on_ray)
        self.last_executor = choice
        tables = list(runner.run(ids, options, choice=choice))
        return pa.concat_tables(tables) if tables else schema_of(options.delivery, options.version_key).empty_table()

    def rebuild_refs(self, rollout_ids: Sequence[str]) -> list[Any]:
        """The ObjectRefs of the batches' Arrow tables, in row order (always on Ray)."""
        rebuilder = self._on_ray()
        refs = rebuilder.rebuild_refs(rollout_ids)
        self.last_executor = rebuilder.last_executor
        return refs

    def settle(self, timeout: float | None = None) -> None:
        """Wait for what the Ray session does in the background after a build, if any."""
        if self._rebuilder is not None:
            self._rebuilder.settle(timeout)


def open_directories(
    capture_dirs: Sequence[Any], *, options: RebuildOptions, address: str | None, watch: bool, schema: pa.Schema,
) -> Any:
    """The stream's directories (`LocalDirectories` or `NodeDirectories`) for these directory specs (see the module docstring).
    Raises before anything is locked when a directory cannot be served."""
    dirs = parse_capture_dirs(capture_dirs)
    plain = all(d.node is None for d in dirs)
    cluster = bool(address or os.environ.get("RAY_ADDRESS")) or ray_running()

    def builds(paths: list[str]) -> StreamBuilds:
        return StreamBuilds(paths, options, address)

    if plain and (options.executor == "local" or not cluster):
        local = local_paths(dirs)
        if not local.readable:
            raise ValueError(
                f"{local.why_not}, and no Ray cluster is joined to look for it on: give NODE:/path, or join the "
                "cluster that holds it (address=, or RAY_ADDRESS)"
            )
        return LocalDirectories(local.paths, options=options, watch=watch, schema=schema, builds=builds)
    if options.executor == "local":
        named = next(d.label for d in dirs if d.node is not None)
        raise ValueError(
            f"executor local builds in this process, but capture directory {named} is served by its node; "
            "use executor auto or ray"
        )
    from raycap.cluster.streaming.driver_dirs import NodeDirectories, place

    placed = None
    if plain:
        # Plain paths are placed here, as a rebuild places them: this process may be
        # the one that holds them.
        placed, here = place(dirs, address=address)
        if here is not None:
            return LocalDirectories(here, options=options, watch=watch, schema=schema, builds=builds)
    # A NODE:/path is never looked at from this process: the stream's hub places it.
    return NodeDirectories(dirs, placed, options=options, watch=watch, schema=schema, address=address)
