"""Durable handoff: the output is a Parquet dataset directory, committed all at once.

Builder tasks write their shards (`raycap.output.shards`) into a staging directory next to the
output (`.NAME.staging`, on the same file system so the final rename cannot cross one).
The driver only commits (`StagedOutput.commit`): it checks every reported shard is in
the staging directory with its reported size, writes the manifest (`raycap.output.manifest`)
durably (`raycap.output.durable`), renames the staging directory to the output path and fsyncs
the parent. Until that rename nothing is visible at the output path, and nothing may be
retired: only a committed output is. A run that dies leaves at most its staging
directory, which the next run removes and never commits. An exclusive lock on
`.NAME.lock` (opened as capture files are: a link or FIFO there is refused) keeps two
runs from writing one output: a run takes it once (`output_lock`,
not re-entrant) and hands the `OutputLock` it holds to the steps that need it
(`StagedOutput`, retirement).

A committed output reads as one table, given as the directory, with pyarrow, pandas,
DuckDB, Ray Data and Hugging Face `datasets`: the shards are the only visible files
(`data/part-*.parquet`) and the metadata files are hidden, which those readers skip.
polars refuses a directory holding anything but Parquet, so it reads `out/data` or
`out/**/*.parquet`. `read_manifest` and `shard_paths` (from `raycap.output.manifest`, also
importable from here) give the shards in manifest order.

An output is refused before anything is created (`check_placement`) when it is named
like a capture file (`*.tokens.*`), lies inside a capture directory, or lies inside
another committed output. An ancestor counts as a committed output when its manifest is a
regular file that begins as raycap's do (`raycap.output.manifest.looks_committed`: one small
read, opened as every manifest is); a link, FIFO, device or any other file there means
no committed output, never a wait or a large read. A fault of the output's file system while writing (disk full,
I/O error, read-only) raises `OutputWriteError` naming the path (`raycap.output.faults`):
a fault of the machine, never a rollout's masked row, so the run fails and nothing is
committed or retired.

The manifest records the inputs that produced the rows (`Inputs`: capture directories,
rollout ids, builder, model, delivery) and their fingerprint. A rerun with the same
inputs reuses the output instead of rebuilding, because rollouts retired by the first run
can no longer be rebuilt, and then finishes the retirement, which is safe to repeat. An
existing output with other inputs, none, or of the previous single-file format is refused
unless overwriting was asked for. Overwriting never deletes it: it is moved aside,
durably, to `NAME.superseded-<UTC time>`, or `NAME.retired-superseded-<UTC time>` when
captures were already retired from it (its `.retire.json` marker says so), because its
rows may be the only copy of those trajectories.

An output is parsed once (`raycap.output.location.parse_location`) and every function here
takes that `Location` (or a plain path, which is a local one). On an object store
(`s3://`) the same steps hold without a rename: builder tasks write into a staging
attempt outside the output's visible paths, the commit point is a conditional write of
the manifest, and the listed objects are then rolled forward into place
(`raycap.output.objectstore`, whose docstring states the protocol and its guarantees). There is
no lock file there (`output_lock` holds nothing): the commit point decides between two
writers. Reuse, overwrite (moving aside by copy, then delete), set-aside and the retire
marker keep their meaning.

This module does not import Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raycap.capture.directory import CaptureDir, capture_dir_holding
from raycap.capture.files import lock_or_raise
from raycap.output import objectstore
from raycap.output.durable import fsync_dir, rename_durably, write_json_durably
from raycap.output.faults import OutputError, OutputWriteError, write_fault
from raycap.output.location import Location, as_location
from raycap.output.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    Manifest,
    committed_location,
    has_manifest,
    looks_committed,
    read_manifest,
    utc_now,
    was_retired_from,
)
from raycap.output.manifest import shard_paths as shard_paths  # public here too, as the README imports it
from raycap.output.recordparts import RECORDS_DIR, RecordsManifest
from raycap.output.shards import DATA_DIR, ShardInfo, write_shard
from raycap.output.stats import ShardStats, percentiles
from raycap.rows.batch import DELIVERIES, schema_of


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


# --- paths --------------------------------------------------------------------------------


def staging_path(output: str | os.PathLike) -> Path:
    """Where a run writes before its commit: a hidden sibling of the output."""
    output = Path(output)
    return output.with_name(f".{output.name}.staging")


def lock_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


def summary_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(f"{output.name}.summary.json")


def rejected_path(output: str | os.PathLike) -> Path:
    """Where an output that failed the mask check is kept for inspection."""
    output = Path(output)
    return output.with_name(output.name + ".rejected")


def where(output: Any) -> Path | Location:
    """How an output is named to people and kept in results: its path when local, else
    its Location (whose text is its URI)."""
    location = as_location(output)
    return location.path if location.local else location


def write_summary(output: Any, summary: dict[str, Any]) -> None:
    """Write `<output>.summary.json` beside the output: durably (temp file, fsync,
    rename) when local, one PUT on an object store."""
    location = as_location(output)
    if location.local:
        write_json_durably(summary_path(location.path), summary)
    else:
        objectstore.write_json(objectstore.summary_location(location), summary)


def finish_commit(output: Any, manifest: Manifest) -> None:
    """Make sure a committed output's objects are in place before anything reads or
    retires them: on an object store, finish its roll-forward (`raycap.output.objectstore`);
    a local commit is whole at its rename."""
    location = as_location(output)
    if not location.local:
        objectstore.roll_forward(location, manifest)


# --- the lock ----------------------------------------------------------------------------------

@dataclass
class OutputLock:
    """The output lock a run holds: handed to the steps of the run that need it held
    (`StagedOutput`, retirement), which then do not take it again."""

    output: Path | Location
    held: bool = True


@contextmanager
def output_lock(output: str | os.PathLike | Location) -> Iterator[OutputLock]:
    """Hold the output's exclusive lock (non-blocking, not re-entrant: a second
    acquisition fails with OutputError, in this process as in another, so one run takes
    it once and passes the `OutputLock` it yields to whatever needs it held).

    Creates the output's parent directory if needed, so a path that cannot be written
    fails here, before any work. An output on an object store has no lock file: the
    yielded lock holds nothing, and the commit point decides between two writers."""
    location = as_location(output)
    if not location.local:
        remote = OutputLock(location)
        try:
            yield remote
        finally:
            remote.held = False
        return
    output = location.path
    path = lock_path(output)

    def refuse(kind: str) -> OutputError:
        return OutputError(
            f"the lock file {path} of output {output} is {kind}; raycap never opens it through a link or waits on "
            "it: remove it, and rerun"
        )

    def busy() -> OutputError:
        return OutputError(f"another run is writing {output} (it holds {path}); wait for it or choose another output")

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd = lock_or_raise(path, os.O_WRONLY | os.O_CREAT, refuse, busy)
    except OSError as exc:
        raise OutputError(
            f"cannot write output {output}: {exc.strerror or exc} ({exc.filename or output.parent}); "
            "choose a writable output directory"
        ) from None
    held = OutputLock(output)
    try:
        yield held
    finally:
        held.held = False
        os.close(fd)  # the lock file stays: removing it would race a waiting run


def checked_lock(output: str | os.PathLike, lock: OutputLock) -> None:
    """Refuse (ValueError) a lock that is not held on `output`: a caller's mistake."""
    if not lock.held or as_location(lock.output).fs_path != as_location(output).fs_path:
        raise ValueError(f"the lock passed for {output} is not held on it (it is for {lock.output}, held={lock.held})")


# --- deciding between reuse and rewrite -------------------------------------------------------


def check_placement(output: str | os.PathLike | Location, capture_dirs: Sequence[str | CaptureDir] = (), *,
                    elsewhere: Sequence[tuple[str, str]] = ()) -> None:
    """Refuse (OutputError) an output placed where it would corrupt something else:
    named like a capture file (a store would list it as a rollout), inside or holding
    one of `capture_dirs` (paths or `CaptureDir`s, `NODE:/path` too) or `elsewhere`
    ((label, path) served on other nodes), compared as `capturedir.capture_dir_holding`
    does, or inside another committed output (whose readers would take it for shards of
    their own). Checked before anything is created. On an object store: its name, a
    writable store whose bucket is there, and no committed output at a prefix above it
    (`raycap.output.objectstore.check_placement`)."""
    location = as_location(output)
    if not location.local:
        objectstore.check_placement(location)
        return
    output = location.path
    if ".tokens." in output.name:
        raise OutputError(
            f"output {output} is named like a capture file (*.tokens.*), which a capture store would take for a "
            "rollout; choose another output name"
        )
    dirs = [*((d.label, d.path) if isinstance(d, CaptureDir) else (os.fspath(d),) * 2 for d in capture_dirs), *elsewhere]
    # None inside the output either: replacing or setting it aside would take it along.
    inside = capture_dir_holding(output, dirs)
    holds = next((label for label, path in dirs if capture_dir_holding(path, [("", str(output))]) is not None), None)
    if inside or holds:
        where = f"is inside capture directory {inside}" if inside else f"holds capture directory {holds}"
        raise OutputError(f"output {output} {where}; choose an output outside every capture directory")
    for ancestor in Path(os.path.realpath(output)).parents:
        # One small read per ancestor, never a parse: any directory above (/tmp) may hold
        # a `.manifest.json` that is not raycap's, or is a FIFO, or huge.
        if looks_committed(ancestor):
            raise OutputError(
                f"output {output} is inside the committed output {ancestor}, whose readers would take it for their "
                "own rows; choose an output outside it"
            )



def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


@dataclass(frozen=True)
class OutputCheck:
    """What `check_output` decided: whether the output is reused, and the manifest it
    read doing so (None when it read none), so that the run does not read it again."""

    reuse: bool
    manifest: Manifest | None = None


def check_output(output: str | os.PathLike | Location, inputs: Inputs, *, overwrite: bool = False) -> OutputCheck:
    """Decide before any work whether `output` is reused or written (`OutputCheck.reuse`).

    Reused when it is a committed output of the same inputs (also with overwrite: the
    same inputs are never rebuilt). Another committed output, one without a readable
    manifest or a file (the previous single-file format) is refused unless `overwrite`,
    and then moved aside at the commit. A non-empty directory that is no raycap output is
    always refused. Otherwise the parent directory is created and probed for
    writability, so a bad output fails the job before anything is built. On an object
    store see `raycap.output.objectstore.check_output` (a reused output's roll-forward is
    finished there)."""
    location = as_location(output)
    if not location.local:
        reuse, found = objectstore.check_output(location, inputs.fingerprint(), overwrite=overwrite)
        return OutputCheck(reuse, found if reuse else None)
    output = location.path
    if _is_empty_dir(output):
        pass  # as good as absent: the commit replaces it
    elif output.is_dir():
        if not has_manifest(output):
            raise OutputError(
                f"output {output} is a directory that is not a raycap output (it has no {MANIFEST_NAME}); "
                "choose another output path"
            )
        try:
            manifest: Manifest | None = read_manifest(output)
        except OutputError:
            manifest = None
        recorded = None if manifest is None else manifest.fingerprint
        if recorded == inputs.fingerprint():
            return OutputCheck(True, manifest)
        if not overwrite:
            what = "different inputs" if recorded else "an unreadable manifest"
            raise OutputError(
                f"output {output} already exists and was written from {what} (capture dirs, rollout ids or results, "
                "builder, model, delivery or record fields differ); choose another output or set overwrite: true to replace it "
                "(the old one is moved aside, not deleted)"
            )
    elif output.exists() or output.is_symlink():
        if not overwrite:
            kind = "a file (a single-file output of an earlier raycap, or not raycap's)" if output.is_file() else "not a directory"
            raise OutputError(
                f"output {output} already exists and is {kind}; choose another output or set overwrite: true "
                "to replace it (the old one is moved aside, not deleted)"
            )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(
            f"cannot write output {output}: {exc.strerror or exc} ({exc.filename or output.parent}); "
            "choose a writable output directory"
        ) from None
    return OutputCheck(False)


def _stamped(path: Path, suffix: str) -> Path:
    """`path` + suffix + a UTC time, made unique."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.{suffix}-{stamp}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.{suffix}-{stamp}-{n}")
    return target


def _move_aside(output: Path, target: Path) -> Path:
    """Rename an output and its summary durably."""
    rename_durably(output, target)
    summary = summary_path(output)
    if summary.exists():
        rename_durably(summary, summary_path(target))
    return target


def supersede(output: str | os.PathLike | Location) -> Path | Location:
    """Move an existing output out of the way of its replacement, durably, under a name
    that says why: `.retired-superseded-<time>` when captures were retired from it,
    else `.superseded-<time>`. Never deletes it (on an object store: copied, then
    deleted, see `raycap.output.objectstore.supersede`)."""
    location = as_location(output)
    if not location.local:
        return objectstore.supersede(location)
    output = location.path
    why = "retired-superseded" if output.is_dir() and was_retired_from(output) else "superseded"
    return _move_aside(output, _stamped(output, why))


def set_aside(output: str | os.PathLike | Location) -> Path | Location:
    """Move a committed output that failed the mask check (and its summary) to
    `<output>.rejected`, out of the consumers' way, durably.

    A `.rejected` left by an earlier run is removed when nothing was retired from it (its
    captures are all there to rebuild from) and otherwise moved aside like a superseded
    output (on an object store: `raycap.output.objectstore.set_aside`)."""
    location = as_location(output)
    if not location.local:
        return objectstore.set_aside(location)
    output = location.path
    target = rejected_path(output)
    if target.exists() or target.is_symlink():
        if target.is_dir() and not target.is_symlink() and not was_retired_from(target):
            shutil.rmtree(target)
            summary_path(target).unlink(missing_ok=True)
            fsync_dir(target.parent)
        else:
            supersede(target)
    return _move_aside(output, target)


# --- a staged run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Committed:
    """What a commit made: the output, its manifest, and where a replaced output went."""

    path: Path | Location
    manifest: Manifest
    superseded: Path | Location | None = None


class StagedOutput:
    """One run's staging directory, from a fresh start to the commit (or nothing).

    Use as a context manager. Entering takes the output's lock (OutputError when another
    run holds it) unless the run already holds it and passes it as `lock`, removes a dead run's staging directory (its shards are never
    committed: they may predate a change of the captures) and creates a fresh one, whose
    path builder tasks write into (`staging`). `commit` publishes the shards; leaving
    without a commit removes the staging directory.

    `schema` is the delivery of the rows, "rollout" or "chains". With `overwrite`, an
    output found at the path at commit time is moved aside (see `supersede`), else the
    commit is refused.

    On an object store (`output` a non-local Location, see `raycap.output.objectstore`) the
    staging is a fresh attempt's prefix (a Location), nothing is created on entering,
    leaving without a commit removes the attempt's objects, and `commit` checks them,
    makes the commit point and rolls the objects forward into place."""

    def __init__(
        self,
        output: str | os.PathLike,
        *,
        inputs: Inputs,
        schema: str = "rollout",
        overwrite: bool = False,
        lock: OutputLock | None = None,
    ) -> None:
        if schema not in DELIVERIES:
            raise ValueError(f"unknown schema {schema!r}; use one of: {', '.join(DELIVERIES)}")
        self.location = as_location(output)
        self.remote = not self.location.local
        self.output: Any = self.location if self.remote else self.location.path
        self.staging: Any = (
            objectstore.attempt_location(self.location, objectstore.new_attempt()) if self.remote
            else staging_path(self.output)
        )
        self.inputs = inputs
        self.schema = schema
        self.overwrite = overwrite
        if lock is not None:
            checked_lock(self.output, lock)
        self._lock = nullcontext() if lock is not None else output_lock(self.output)
        self._state = "new"

    def __enter__(self) -> "StagedOutput":
        self._lock.__enter__()
        if self.remote:
            self._state = "open"  # an attempt's prefix exists once its first object does
            return self
        try:
            try:
                if self.staging.exists() or self.staging.is_symlink():
                    self._remove_staging()
                self.staging.mkdir()
                (self.staging / DATA_DIR).mkdir()
                fsync_dir(self.staging)
                fsync_dir(self.staging.parent)
            except OSError as exc:
                raise write_fault(self.staging, exc) from None
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
                    if self.remote:
                        objectstore.remove_staging(self.staging)
                    else:
                        self._remove_staging()
                except OSError:
                    pass  # best effort: the next run removes it
        finally:
            self._lock.__exit__(exc_type, exc, tb)

    def _remove_staging(self) -> None:
        if self.staging.is_dir() and not self.staging.is_symlink() and was_retired_from(self.staging):
            # Not a dead run's staging (nothing is retired before the commit) but rows
            # captures were retired from, put here by hand: they may be the only copy.
            supersede(self.staging)
            return
        if self.staging.is_dir() and not self.staging.is_symlink():
            shutil.rmtree(self.staging)
        else:
            self.staging.unlink()
        fsync_dir(self.staging.parent)

    def commit(
        self,
        shards: Sequence[ShardInfo],
        *,
        records: RecordsManifest | None = None,
        before_rename: Callable[[], None] | None = None,
        during_roll_forward: Callable[[], None] | None = None,
    ) -> Committed:
        """Publish the shards, in this order, as the output: check them, write the
        manifest durably, rename the staging directory into place, fsync the parent.
        `records` lists the finalized records' parts (`raycap.output.recordparts`), checked
        like the shards and kept in the output's `.records/` folder.

        Anything else in the staging directory (temp files of killed attempts, a stray
        shard or records part) is removed first: readers of the directory must see
        exactly the listed shards. `before_rename` runs between the manifest and the rename.

        On an object store: check the attempt's objects, run `before_rename` (nothing
        is visible yet), move an existing output aside (with `overwrite`), make the
        commit point (the manifest, If-None-Match) and roll the objects forward;
        `during_roll_forward` runs once the first object is in place."""
        if self._state != "open":
            raise OutputError(f"the staging of {self.output} is not open (state: {self._state})")
        shards = list(shards)
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise OutputError(f"shards listed twice in the commit of {self.output}: {sorted({n for n in names if names.count(n) > 1})}")
        for shard in shards:
            if shard.stats.delivery != self.schema:
                raise OutputError(f"shard {shard.name} holds {shard.stats.delivery} rows; this output is {self.schema}")
            if not self.remote:  # on a store: all at once, in one listing (`_commit_remote`)
                self._check_written("shard", shard.name, shard.file_bytes)
        parts = records.parts if records is not None else ()
        if len({p.name for p in parts}) != len(parts):
            raise OutputError(f"records parts listed twice in the commit of {self.output}")
        if self.remote:
            return self._commit_remote(shards, records, before_rename, during_roll_forward)
        for part in parts:
            self._check_written("records part", part.name, part.file_bytes)
        if not shards:
            # A dataset with no rows still has its schema, so every reader gets an empty table.
            shards = [write_shard(self.staging, 0, schema_of(self.schema).empty_table())]
        listed = {self.staging / s.name for s in shards} | {self.staging / p.name for p in parts}
        kept = [self.staging / DATA_DIR] + ([self.staging / RECORDS_DIR] if records is not None else [])
        try:
            for entry in [*self.staging.iterdir(), *(e for folder in kept if folder.is_dir() for e in folder.iterdir())]:
                if entry not in listed and entry not in kept:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as exc:
            raise write_fault(self.staging, exc) from None
        manifest = self._manifest(shards, records)
        write_json_durably(self.staging / MANIFEST_NAME, manifest.to_json())
        if before_rename is not None:
            before_rename()
        superseded = None
        if _is_empty_dir(self.output):
            self.output.rmdir()
        elif self.output.exists() or self.output.is_symlink():
            if not self.overwrite:
                raise OutputError(
                    f"output {self.output} appeared while this run was building; nothing was committed, "
                    "rerun (or set overwrite: true to replace it)"
                )
            superseded = supersede(self.output)
        rename_durably(self.staging, self.output)
        self._state = "committed"
        return Committed(self.output, manifest, superseded)

    def _manifest(self, shards: Sequence[ShardInfo], records: RecordsManifest | None, staged_as: str | None = None) -> Manifest:
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
            committed_as=committed_location(self.location if self.remote else self.output),
            records=records,
            staged_as=staged_as,
        )

    def _commit_remote(
        self,
        shards: list[ShardInfo],
        records: RecordsManifest | None,
        before_commit: Callable[[], None] | None,
        during_roll_forward: Callable[[], None] | None,
    ) -> Committed:
        reported = {s.name: ("shard", s.file_bytes) for s in shards}
        reported.update({p.name: ("records part", p.file_bytes) for p in (records.parts if records else ())})
        objectstore.check_staged(self.staging, reported)
        if not shards:
            # A dataset with no rows still has its schema, so every reader gets an empty table.
            shards = [write_shard(self.staging, 0, schema_of(self.schema).empty_table())]
        manifest = self._manifest(shards, records, staged_as=self.staging.name)
        if before_commit is not None:
            before_commit()
        superseded = None
        if objectstore.holds_anything(self.location):
            if not self.overwrite:
                raise OutputError(
                    f"output {self.location} appeared while this run was building; nothing was committed, "
                    "rerun (or set overwrite: true to replace it)"
                )
            superseded = objectstore.supersede(self.location)
        try:
            objectstore.commit_point(self.location, manifest)
        except OutputWriteError:  # the manifest may be there: the attempt stays for a rerun
            self._state = "unknown"
            raise
        self._state = "committed"  # the attempt's objects are the output's now: never removed before they are copied
        objectstore.roll_forward(self.location, manifest, during_roll_forward)
        return Committed(self.location, manifest, superseded)

    def _check_written(self, what: str, name: str, file_bytes: int) -> None:
        """A file a task reported is in the staging directory with the size it reported."""
        try:
            size = (self.staging / name).stat().st_size
        except FileNotFoundError:
            raise OutputError(
                f"{what} {name} is missing from {self.staging}: the node that wrote it does not share "
                "this file system; put the output on storage every node can see"
            ) from None
        if size != file_bytes:
            raise OutputError(
                f"{what} {name} in {self.staging} has {size} bytes, its task reported {file_bytes}: "
                "another writer replaced it; rerun the job"
            )
