"""The primitives of the output commit protocol (`raycap.output.protocol`): the values its
steps pass (`Inputs`, `OutputLock`, `OutputCheck`, `Committed`) and the interface a place
of outputs implements (`Backend`): a local file system (`raycap.output.local.writes`) or
an object store (`raycap.output.objectstore.writes`).

This module does not import Ray.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, ContextManager, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from raycap.output.location import Location
from raycap.output.manifestformat import Manifest


@dataclass(frozen=True)
class Inputs:
    """What a rebuild reads. Two runs with equal inputs produce the same rows, because
    freezing is idempotent; rollout_ids None means every rollout the directories list."""

    capture_dirs: tuple[str, ...]
    rollout_ids: tuple[str, ...] | None
    builder: str
    model: str
    delivery: str = "rollout"
    # A finalized results file (`raycap.finalize_rollouts`): the sha256 of its records as
    # read, and the fields carried by name; None for a rebuild.
    results: str | None = None
    record_fields: tuple[str, ...] = ()

    def _canonical(self) -> dict[str, Any]:
        canonical: dict[str, Any] = {
            "capture_dirs": list(self.capture_dirs),
            "rollout_ids": None if self.rollout_ids is None else list(self.rollout_ids),
            "builder": self.builder,
            "model": self.model,
        }
        if self.delivery != "rollout":  # rollout-delivery fingerprints stay as they were
            canonical["delivery"] = self.delivery
        if self.results is not None:  # and so do a rebuild's
            canonical["results_sha256"] = self.results
            canonical["record_fields"] = list(self.record_fields)
        return canonical

    def fingerprint(self) -> str:
        text = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        """The inputs as recorded for people reading the manifest: ids are counted, not listed."""
        described = self._canonical()
        described["rollout_ids"] = "all listed" if self.rollout_ids is None else f"{len(self.rollout_ids)} given"
        return described


@dataclass
class OutputLock:
    """The output lock a run holds: handed to the steps of the run that need it held
    (`StagedOutput`, retirement), which then do not take it again."""

    output: Location
    held: bool = True


@dataclass(frozen=True)
class OutputCheck:
    """What `check_output` decided: whether the output is reused, and the manifest it
    read doing so (None when it read none), so that the run does not read it again."""

    reuse: bool
    manifest: Manifest | None = None


@dataclass(frozen=True)
class Committed:
    """What a commit made: the output, its manifest, and where a replaced output went."""

    path: Path | Location
    manifest: Manifest
    superseded: Path | Location | None = None


class Backend:
    """The primitives of the protocol that differ between a local output and an object
    store's. Each takes the output's Location (or its staging, as `new_staging` made it,
    or a committed part, as `shards` gave it).

    Writers stage parts, make the commit point and move parts into place; readers read
    the committed manifest (`manifest`), list the committed parts (`shards`,
    `visible_parquet`), open or read one (`open_part`, `read_table`, `read_part`), and
    hand them on with their file system (`for_workers`, `for_tasks`/`from_tasks`)."""

    # Whether a fault at the commit point may hide a commit that landed: the staging is
    # then kept, since the output's manifest may name it.
    fault_may_have_committed = False
    # Whether builder tasks on other nodes need the staging on a file system they share.
    staging_needs_shared_fs = False
    # Whether a fork of this process can write into the staging: an object store's client
    # keeps native threads and descriptors that a fork has not.
    staging_written_by_forks = False

    # --- where the output is, and writing it: open, stage, commit point, finish ---

    def where(self, location: Location) -> Path | Location:
        """How the output is named to people and kept in results."""
        raise NotImplementedError

    def resolved(self, location: Location) -> Location:
        """The output named by its absolute place (a local path made absolute)."""
        raise NotImplementedError

    def empty(self, location: Location) -> bool:
        """Whether nothing is at the output (an empty folder counts as nothing)."""
        raise NotImplementedError

    def has_manifest(self, location: Location) -> bool:
        """Whether a commit's manifest is there (locally: a readable one); a store
        that cannot be asked is an OutputError, never "nothing committed"."""
        raise NotImplementedError

    def lock(self, location: Location) -> ContextManager[OutputLock]:
        raise NotImplementedError

    def check_placement(self, location: Location, dirs: Sequence[Any], elsewhere: Sequence[tuple[str, str]]) -> None:
        raise NotImplementedError

    def check_output(self, location: Location, inputs: Inputs, overwrite: bool) -> OutputCheck:
        raise NotImplementedError

    def new_staging(self, location: Location) -> Any:
        raise NotImplementedError

    def for_tasks(self, staging: Any) -> str | Location:
        """The staging as builder tasks receive it."""
        raise NotImplementedError

    def open_staging(self, staging: Any) -> None:
        raise NotImplementedError

    def abort_staging(self, staging: Any) -> None:
        raise NotImplementedError

    def staged_as(self, staging: Any) -> str | None:
        """What the manifest records of the staging it was committed from."""
        return None

    def check_staged(self, staging: Any, reported: dict[str, tuple[str, int]], keep_records: bool) -> None:
        """Every reported part (name -> (what, size)) is in the staging with its size;
        anything else there is removed."""
        raise NotImplementedError

    def stage_manifest(self, staging: Any, manifest: Manifest) -> None:
        """Put the manifest in the staging ahead of the commit point, where it goes there."""

    def occupied(self, location: Location) -> bool:
        """Whether something is at the output (an empty folder is as good as nothing)."""
        raise NotImplementedError

    def commit_point(self, staging: Any, location: Location, manifest: Manifest) -> None:
        raise NotImplementedError

    def finish(self, location: Location, manifest: Manifest, during: Callable[[], None] | None = None) -> None:
        """Put every committed part in place; safe to repeat."""
        raise NotImplementedError

    def named(self, location: Location) -> Path | str:
        """The output as a job config keeps it: a local path, a store's URI."""
        raise NotImplementedError

    def real(self, location: Location) -> Location:
        """The output named with its links resolved (a local path's real path)."""
        raise NotImplementedError

    # --- reading what was committed ---

    def manifest(self, location: Location) -> Manifest:
        """The committed output's manifest (`raycap.output.manifest.read_manifest`)."""
        raise NotImplementedError

    def committed_as(self, location: Location) -> str:
        """Where a commit records it put the output (`Manifest.committed_as`)."""
        raise NotImplementedError

    def committed_manifest(self, location: Location, manifest: Manifest | None) -> Manifest:
        """The manifest, when the output is where its commit put it
        (`raycap.output.manifest.committed_manifest`)."""
        raise NotImplementedError

    def shards(self, location: Location, manifest: Manifest | None = None) -> list[Any]:
        """The committed shards, in order, each checked in place (`raycap.output.manifest.shard_paths`)."""
        raise NotImplementedError

    def open_part(self, part: Any) -> BinaryIO:
        """A committed shard (as `shards` gives it) open for reading, never through a
        link or waiting on a FIFO (`raycap.output.manifest.open_shard`)."""
        raise NotImplementedError

    def read_table(self, part: Any, columns: Iterable[str] | None = None) -> pa.Table:
        """A committed shard's rows (only `columns`, when given), read through `open_part`."""
        with self.open_part(part) as handle:
            # One file: ParquetFile reads it as read_table would, without the dataset
            # layer, whose import loads pandas (half a second of a retirement).
            return pq.ParquetFile(handle).read(columns=None if columns is None else list(columns))

    def visible_parquet(self, location: Location) -> list[Any] | None:
        """The Parquet files a generic reader of the output reads, when no manifest is
        there (None when one is: `shards` are the output's); OutputError (one line)
        when nothing is there to read."""
        raise NotImplementedError

    def read_part(self, location: Location, part: Any) -> bytes:
        """A committed records part's bytes, checked against its manifest entry
        (`raycap.output.manifest.read_records_part`)."""
        raise NotImplementedError

    def stream_staged_part(self, staging: Any, part: Any, write: Callable[[Any], Any]) -> None:
        """A records part a task wrote into the staging (`for_tasks`), before the commit,
        passed to `write` and checked against `part` as `stream_part` passes a committed one."""
        raise NotImplementedError

    def stream_part(self, location: Location, part: Any, write: Callable[[Any], Any]) -> None:
        """A committed records part's bytes passed to `write` (in chunks, each good until
        `write` returns) and checked against its manifest entry once all were passed:
        use none of them unless this returns. This default reads the part whole."""
        write(self.read_part(location, part))

    def for_workers(self, location: Location, shards: Sequence[Any]) -> tuple[list[str], Any]:
        """The committed shards as other processes open them (Ray Data's workers): their
        paths, and the file system that must go with them (None: the local one)."""
        raise NotImplementedError

    def from_tasks(self, part: Any, here: Callable[[str], str]) -> Any:
        """A committed part as a task received it (`for_tasks`), as the task's node opens
        it: `here` maps a local path to where this node sees it."""
        raise NotImplementedError

    # --- the retire marker, moving an output aside, and the files beside it ---

    def was_retired_from(self, location: Location) -> bool:
        """Whether retirement ever started on the output (its marker is written first)."""
        raise NotImplementedError

    def read_marker(self, location: Location) -> bytes:
        """The retire marker's bytes (FileNotFoundError when there is none)."""
        raise NotImplementedError

    def write_marker(self, location: Location, record: dict[str, Any]) -> None:
        """Write the retire marker whole (locally: durably)."""
        raise NotImplementedError

    def retired_outputs(self, location: Location) -> list[Any]:
        """The output and its set-aside siblings that captures were retired from."""
        raise NotImplementedError

    def supersede(self, location: Location) -> Path | Location:
        raise NotImplementedError

    def set_aside(self, location: Location) -> Path | Location:
        raise NotImplementedError

    def write_summary(self, location: Location, summary: dict[str, Any]) -> None:
        raise NotImplementedError

    def part(self, output: Path | Location, name: str) -> Path | Location:
        """The committed part `name` (relative to the output)."""
        raise NotImplementedError

    def present(self, part: Path | Location) -> bool:
        """Whether anything is at `part` (a fault: True, never said to be missing)."""
        raise NotImplementedError

    def local_home(self, location: Location) -> Path:
        """The local path that files about the output (a picture of it) are named after
        and written beside: a local output's own; for a store's, its name in the working
        directory (nothing is written to a store but through the protocol)."""
        raise NotImplementedError

    def spool_path(self, location: Location) -> Path:
        """A local file for records read before the output is written."""
        raise NotImplementedError

    def holds(self, location: Location, path: Path) -> bool:
        """Whether the local `path` lies inside the output."""
        raise NotImplementedError

    def run_file(self, location: Location, path: Path) -> str | None:
        """Which local file that a run on the output writes beside it (its summary, lock,
        staging, results spool, a copy moved aside) the kernel would take `path` for,
        as a phrase ("the output's summary"), or None."""
        raise NotImplementedError
