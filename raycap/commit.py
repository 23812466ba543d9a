"""The commit protocol of an output, one for every writer, over two backends.

Every writer of an output (a rebuild, a finalize, a stream's step) and retirement walk
the same steps, whatever the output's place:

1. **open**: hold the output's lock (`Backend.lock`), check its placement
   (`Backend.check_placement`) and what is there (`Backend.check_output`: reused,
   refused, or free to write);
2. **stage**: builder tasks write parts into the staging (`StagedOutput.staging`,
   handed to tasks as `StagedOutput.for_tasks`);
3. **commit point**: the reported parts are checked in the staging
   (`Backend.check_staged`), the manifest is made, an output that appeared meanwhile
   is refused or moved aside (`Backend.occupied`, `Backend.supersede`), and the
   output becomes visible all at once (`Backend.commit_point`);
4. **finish**: every listed part is put in place (`Backend.finish`);
5. **verify**: every committed part (shard, records part) is there with its size and
   sha256 (`verify`), before anything is dropped;
6. **retire** (`raycap.retire`), then the summary beside the output
   (`Backend.write_json_beside`).

A local output (`raycap.localstore`) and an object store's (`raycap.objectstore`) are
the two implementations of the primitives (`Backend`); callers take the backend of the
output's `raycap.location.Location` (`backend_of`) and never branch on which it is.
The output is parsed once, at the public entry (`raycap.location.parse_location`).

This module does not import Ray.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from raycap.batch import DELIVERIES, schema_of
from raycap.location import Location, as_location
from raycap.manifest import SCHEMA_VERSION, Manifest, committed_location, open_shard, utc_now
from raycap.outputerrors import OutputError, OutputWriteError
from raycap.recordparts import RecordsManifest
from raycap.shards import ShardInfo, write_shard
from raycap.shardstats import ShardStats, percentiles


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

    output: Path | Location
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
    store's. Each takes the output's Location (or its staging, as `new_staging` made it)."""

    # Whether a fault at the commit point may hide a commit that landed: the staging is
    # then kept, since the output's manifest may name it.
    fault_may_have_committed = False
    # Whether builder tasks on other nodes need the staging on a file system they share.
    staging_needs_shared_fs = False

    def where(self, location: Location) -> Path | Location:
        """How the output is named to people and kept in results."""
        raise NotImplementedError

    def resolved(self, location: Location) -> Path | Location:
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

    def manifest(self, location: Location) -> Manifest:
        """The committed output's manifest (`raycap.manifest.read_manifest`)."""
        raise NotImplementedError

    def shards(self, location: Location, manifest: Manifest | None = None) -> list[Any]:
        """The committed shards, in order, each checked in place (`raycap.manifest.shard_paths`)."""
        raise NotImplementedError

    def read_part(self, location: Location, part: Any) -> bytes:
        """A committed records part's bytes, checked against its manifest entry
        (`raycap.recordparts.read_records_part`)."""
        raise NotImplementedError

    def for_workers(self, location: Location, shards: Sequence[Any]) -> tuple[list[str], Any]:
        """The committed shards as other processes open them (Ray Data's workers): their
        paths, and the file system that must go with them (None: the local one)."""
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

    def spool_path(self, location: Location) -> Path:
        """A local file for records read before the output is written."""
        raise NotImplementedError

    def holds(self, location: Location, path: Path) -> bool:
        """Whether the local `path` lies inside the output."""
        raise NotImplementedError


def backend_of(location: Location) -> Backend:
    """The backend of an output's place: the local one for a path, the object store's
    for a URI (by its scheme, one lookup)."""
    from raycap.localstore import LOCAL
    from raycap.objectstore import STORE

    return {"": LOCAL}.get(location.scheme, STORE)


# --- verify: nothing is retired before every committed part is whole ------------------------------

_CHUNK = 8 << 20


def _measure(handle: Any, limit: int) -> tuple[int, str]:
    """The size (read up to one byte past `limit`) and sha256 of what `handle` reads."""
    digest, size = hashlib.sha256(), 0
    while size <= limit:
        chunk = handle.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _not_whole(output: Any, where: Any, what: str, detail: str) -> OutputError:
    return OutputError(
        f"{what} {where} of the committed output {output} {detail}; nothing was retired: restore it, or move the "
        "output away and run again to rebuild it"
    )


def verify(location: Location, manifest: Manifest, shards: Sequence[Path | Location]) -> None:
    """OutputError (one line, naming the part) unless everything the commit wrote is in
    the output as its manifest lists it: every shard (`shards`, from `shard_paths`) and
    every records part, each of its size and sha256 (a shard of a manifest that predates
    digests: its size). Retirement calls it before its marker and before any drop: rows
    or records missing, truncated or altered may be the only copy of a trajectory, and
    the redundant captures it drops are those the records parts name. `location` is
    the output, parsed once by the caller."""
    backend = backend_of(location)
    output = backend.where(location)
    for info, path in zip(manifest.shards, shards):
        try:
            with open_shard(path) as handle:
                size, digest = _measure(handle, info.file_bytes)
        except (OutputError, OSError):
            raise _not_whole(output, path, "shard", "is missing" if not backend.present(path) else "cannot be read") from None
        if size != info.file_bytes or (info.sha256 is not None and digest != info.sha256):
            raise _not_whole(
                output, path, "shard",
                f"is not the one its manifest lists ({size} bytes, or other bytes, where it says {info.file_bytes})",
            )
    for part in manifest.records.parts if manifest.records is not None else ():
        where = backend.part(output, part.name)
        try:
            backend.read_part(location, part)
        except (OutputError, OSError):
            detail = "is not the one its manifest lists (its size or bytes differ)" if backend.present(where) else "is missing"
            raise _not_whole(output, where, "records part", detail) from None


# --- stage, commit point, finish ------------------------------------------------------------------


def checked_lock(output: Any, lock: OutputLock) -> None:
    """Refuse (ValueError) a lock that is not held on `output`: a caller's mistake."""
    if not lock.held or as_location(lock.output).fs_path != as_location(output).fs_path:
        raise ValueError(f"the lock passed for {output} is not held on it (it is for {lock.output}, held={lock.held})")


class StagedOutput:
    """One run's staging, from a fresh start to the commit (or nothing).

    Use as a context manager. Entering takes the output's lock (OutputError when another
    run holds it) unless the run already holds it and passes it as `lock`, and opens a
    fresh staging (locally: a dead run's staging directory is removed, its shards never
    committed, and a new one made; on an object store: a new attempt's prefix, created by
    its first object). Builder tasks write into `staging` (given to them as
    `for_tasks`). `commit` publishes the parts; leaving without a commit removes the
    staging.

    `schema` is the delivery of the rows, "rollout" or "chains". With `overwrite`, an
    output found at the path at commit time is moved aside (see `supersede`), else the
    commit is refused."""

    def __init__(
        self,
        output: Any,
        *,
        inputs: Inputs,
        schema: str = "rollout",
        overwrite: bool = False,
        lock: OutputLock | None = None,
    ) -> None:
        if schema not in DELIVERIES:
            raise ValueError(f"unknown schema {schema!r}; use one of: {', '.join(DELIVERIES)}")
        self.location = as_location(output)
        self.backend = backend_of(self.location)
        self.output: Any = self.backend.where(self.location)
        self.staging: Any = self.backend.new_staging(self.location)
        self.inputs = inputs
        self.schema = schema
        self.overwrite = overwrite
        if lock is not None:
            checked_lock(self.output, lock)
        self._lock = nullcontext() if lock is not None else self.backend.lock(self.location)
        self._state = "new"

    @property
    def for_tasks(self) -> str | Location:
        """The staging as builder tasks receive it: a local directory's path, a store's Location."""
        return self.backend.for_tasks(self.staging)

    def __enter__(self) -> "StagedOutput":
        self._lock.__enter__()
        try:
            self.backend.open_staging(self.staging)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        self._state = "open"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._state == "open":
                self._state = "aborted"
                try:
                    self.backend.abort_staging(self.staging)
                except OSError:
                    pass  # best effort: the next run removes it
        finally:
            self._lock.__exit__(exc_type, exc, tb)

    def commit(
        self,
        shards: Sequence[ShardInfo],
        *,
        records: RecordsManifest | None = None,
        before_rename: Callable[[], None] | None = None,
        during_roll_forward: Callable[[], None] | None = None,
    ) -> Committed:
        """Publish the shards, in this order, as the output: check them (and the
        records parts of `records`, kept in the output's `.records/` folder) in the
        staging, where anything else is removed (readers must see exactly the listed
        parts), make the manifest, run `before_rename`, move an output found there aside
        (with `overwrite`, else refuse), make the commit point (locally: the manifest
        written durably, the staging renamed into place; on a store: the manifest's
        conditional write) and finish (on a store: roll the parts forward, running
        `during_roll_forward` once the first is in place)."""
        if self._state != "open":
            raise OutputError(f"the staging of {self.output} is not open (state: {self._state})")
        shards = list(shards)
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise OutputError(f"shards listed twice in the commit of {self.output}: {sorted({n for n in names if names.count(n) > 1})}")
        for shard in shards:
            if shard.stats.delivery != self.schema:
                raise OutputError(f"shard {shard.name} holds {shard.stats.delivery} rows; this output is {self.schema}")
        parts = records.parts if records is not None else ()
        if len({p.name for p in parts}) != len(parts):
            raise OutputError(f"records parts listed twice in the commit of {self.output}")
        reported = {s.name: ("shard", s.file_bytes) for s in shards}
        reported.update({p.name: ("records part", p.file_bytes) for p in parts})
        self.backend.check_staged(self.staging, reported, records is not None)
        if not shards:
            # A dataset with no rows still has its schema, so every reader gets an empty table.
            shards = [write_shard(self.staging, 0, schema_of(self.schema).empty_table())]
        manifest = self._manifest(shards, records)
        self.backend.stage_manifest(self.staging, manifest)
        if before_rename is not None:
            before_rename()
        superseded = None
        if self.backend.occupied(self.location):
            if not self.overwrite:
                raise OutputError(
                    f"output {self.output} appeared while this run was building; nothing was committed, "
                    "rerun (or set overwrite: true to replace it)"
                )
            superseded = self.backend.supersede(self.location)
        try:
            self.backend.commit_point(self.staging, self.location, manifest)
        except OutputWriteError:
            if self.backend.fault_may_have_committed:  # the manifest may be there: the staging stays for a rerun
                self._state = "unknown"
            raise
        self._state = "committed"  # the staging's parts are the output's now: never removed before they are in place
        self.backend.finish(self.location, manifest, during_roll_forward)
        return Committed(self.output, manifest, superseded)

    def _manifest(self, shards: Sequence[ShardInfo], records: RecordsManifest | None) -> Manifest:
        totals = ShardStats.merge((s.stats for s in shards), self.schema)
        return Manifest(
            path=self.output,
            schema=self.schema,
            schema_version=SCHEMA_VERSION,
            fingerprint=self.inputs.fingerprint(),
            inputs=self.inputs.describe(),
            shards=tuple(replace(s, stats=replace(s.stats, delivered_fractions=totals.delivered_fractions[:0])) for s in shards),
            totals=replace(totals, delivered_fractions=totals.delivered_fractions[:0]),
            delivered_fraction=percentiles(totals.delivered_fractions),
            committed_at=utc_now(),
            committed_as=committed_location(self.output),
            records=records,
            staged_as=self.backend.staged_as(self.staging),
        )
