"""The commit protocol of an output, one for every writer, over two backends.

Every writer (a rebuild, a finalize, a stream's step) and retirement walk the same steps:

1. **open**: hold the lock (`Backend.lock`), check placement and what is there
   (`Backend.check_placement`, `Backend.check_output`);
2. **stage**: tasks write parts into the staging (`StagedOutput.for_tasks`);
3. **commit point**: parts checked (`Backend.check_staged`), the manifest made, and the
   output visible all at once (`Backend.commit_point`);
4. **finish**: every listed part put in place (`Backend.finish`);
5. **verify**: every committed part there with its size and sha256 (`verify`);
6. **retire** (`raycap.output.retiring`), then the summary (`Backend.write_summary`).

The two backends (`raycap.output.local`, `raycap.output.objectstore`) implement
`Backend`; callers take the output's (`backend_of`) and never branch on which it is.
The output is parsed once, at the public entry (`raycap.output.location.parse_location`).
This module does not import Ray.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from raycap.capture.directory import CaptureDir
from raycap.output.backend import Backend as Backend
from raycap.output.backend import Committed as Committed
from raycap.output.backend import Inputs as Inputs
from raycap.output.backend import OutputCheck as OutputCheck
from raycap.output.backend import OutputLock as OutputLock
from raycap.output.faults import OutputError, OutputWriteError
from raycap.output.local.writes import LOCAL
from raycap.output.location import Location, as_location, check_writable
from raycap.output.manifestformat import SCHEMA_VERSION, Manifest, utc_now
from raycap.output.objectstore.writes import STORE
from raycap.output.recordparts import RecordsManifest
from raycap.output.shards import ShardInfo, write_shard
from raycap.output.stats import ShardStats, percentiles
from raycap.rows.batch import DELIVERIES, empty_rows

# Every backend, by the scheme of the places it serves ("" for a local path): a backend
# is its own folder (`raycap.output.local`, `raycap.output.objectstore`) and one line here.
# Any other scheme pyarrow opens is read as an object store.
BACKENDS: dict[str, Backend] = {"": LOCAL, "s3": STORE}


def backend_of(location: Location) -> Backend:
    """The backend of an output's place, by its scheme (one lookup in BACKENDS)."""
    return BACKENDS.get(location.scheme, STORE)


def open_output(location: Location, dirs: Sequence[CaptureDir]) -> Backend:
    """The protocol's first step, before the lock: the output is one raycap can commit
    to, placed where it corrupts nothing (`raycap.output.commit.check_placement`); its backend."""
    check_writable(location)
    backend = backend_of(location)
    backend.check_placement(location, dirs, ())
    return backend


# --- verify: nothing is retired before every committed part is whole ------------------------------

_CHUNK = 8 << 20


# How many parts `verify` reads and hashes at once.
VERIFY_THREADS = 4


def refuse_records_file_in(location: Location, target: Path) -> None:
    """ValueError when a records file the run writes at `target` would be inside the
    output (its readers would take it for theirs) or be a file the run writes itself."""
    backend = backend_of(location)
    if backend.holds(location, target):
        raise ValueError(
            f"records_file {target} is inside the output {backend.where(location)}, whose readers would take it for "
            "theirs; write it elsewhere"
        )
    written = backend.run_file(location, target)
    if written is not None:
        raise ValueError(
            f"records_file {target} is {written}, which this run writes itself and would overwrite the records "
            "with; write it elsewhere"
        )


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
    the output, parsed once by the caller. The parts are read and hashed on a few
    threads (both release the interpreter); the error is the first part's in the
    manifest's order, shards before records parts."""
    backend = backend_of(location)
    output = backend.where(location)

    def shard(info: ShardInfo, path: Path | Location) -> OutputError | None:
        try:
            with backend.open_part(path) as handle:
                size, digest = _measure(handle, info.file_bytes)
        except (OutputError, OSError):
            return _not_whole(output, path, "shard", "is missing" if not backend.present(path) else "cannot be read")
        if size != info.file_bytes or (info.sha256 is not None and digest != info.sha256):
            return _not_whole(
                output, path, "shard",
                f"is not the one its manifest lists ({size} bytes, or other bytes, where it says {info.file_bytes})",
            )
        return None

    def records_part(part: Any) -> OutputError | None:
        where = backend.part(output, part.name)
        try:
            backend.stream_part(location, part, _ignore)
        except (OutputError, OSError):
            detail = "is not the one its manifest lists (its size or bytes differ)" if backend.present(where) else "is missing"
            return _not_whole(output, where, "records part", detail)
        return None

    parts = manifest.records.parts if manifest.records is not None else ()
    checks = [partial(shard, info, path) for info, path in zip(manifest.shards, shards)]
    checks += [partial(records_part, part) for part in parts]
    pool = ThreadPoolExecutor(max_workers=max(1, min(VERIFY_THREADS, len(checks))), thread_name_prefix="raycap-verify")
    try:
        failures = [future.result() for future in [pool.submit(check) for check in checks]]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # interrupted: no part is read any more
    for failure in failures:
        if failure is not None:
            raise failure


# --- stage, commit point, finish ------------------------------------------------------------------


def checked_lock(location: Location, lock: OutputLock) -> None:
    """Refuse (ValueError) a lock that is not held on the output at `location`: a caller's mistake."""
    if not lock.held or lock.output.fs_path != location.fs_path:
        raise ValueError(f"the lock passed for {location} is not held on it (it is for {lock.output}, held={lock.held})")


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
            checked_lock(self.location, lock)
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
            shards = [write_shard(self.staging, 0, empty_rows(self.schema))]
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
            committed_as=self.backend.committed_as(self.location),
            records=records,
            staged_as=self.backend.staged_as(self.staging),
        )


def _ignore(chunk: Any) -> None:
    """A records part's bytes, when only their check is wanted."""
