"""What a committed output says: its manifest (inputs, schema, shards, totals) and its retire marker.

The commit (`raycap.output.commit.StagedOutput.commit`) writes `.manifest.json`: the inputs and
their fingerprint, the row schema, the ordered shards with their stats, the totals.
`read_manifest` and `shard_paths` give the shards in manifest order, which is
authoritative. The metadata files are hidden (`.manifest.json`, `.retire.json`), so the
readers of the directory as one table (pyarrow, pandas, DuckDB, Ray Data, Hugging Face
`datasets`) skip them. An output written before this layout (shards at the top,
`_manifest.json`, `_retire.json`) is still read: the manifest's shard names are paths
relative to the output.

A manifest is untrusted input, read as capture files are: `read_metadata` is the one
read of an output's metadata files (the manifest and the retire marker), each opened
without following a link or waiting on a FIFO, a regular file only, size-bounded
(`MAX_MANIFEST_BYTES`, `MAX_MARKER_BYTES`). Parsing refuses a shard name that is not a
plain name inside the output (`raycap.output.shards.shard_name_problem`) and a shard listed
twice, so no reader and no retirement follows a manifest out of its output.
`shard_paths` also refuses a shard that is missing or not a regular file, or a `data`
directory that is a link; `open_shard` opens one without following a link or waiting
on a FIFO even if the entry was swapped since.

The manifest also records where the commit put the output (`committed_as`: the real
path of its parent, and its name). Retirement accepts only an output found there
(`committed_manifest`): a staging directory, a `.rejected` or superseded copy, or a
dataset copied or renamed elsewhere carries the same manifest but is refused.

Retirement writes the `.retire.json` marker before it drops anything (`mark_retiring`),
so `was_retired_from` tells which outputs hold rows that may be the only copy of their
trajectories.

Every function here takes the output as a path or a `raycap.output.location.Location`. On an
object store (`raycap.output.objectstore`) the same files are objects: a manifest is read
size-bounded, `committed_as` is the output's URI, the manifest names the staging attempt
its objects were committed from (`staged_as`), and `shard_paths` gives each shard's
Location after checking (one listing) that every listed shard is in place with its
size: while a commit's roll-forward is unfinished it refuses, so no reader reads a
partial set.

This module does not import Ray.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from raycap.capture.files import kind_of, open_regular
from raycap.capture.untrusted import UnsafeFileError, bounded, bounded_repr, loads_untrusted, read_small_file
from raycap.output.durable import write_json_durably
from raycap.output.faults import OutputError, store_fault
from raycap.output.location import Location, as_location
from raycap.output.recordparts import RecordsManifest
from raycap.output.shards import DATA_DIR, ShardInfo, shard_name_problem
from raycap.output.stats import Percentiles, ShardStats

# The metadata files are hidden (a leading dot): Hugging Face `datasets` reads every
# visible file of a directory as Parquet.
MANIFEST_NAME = ".manifest.json"
RETIRE_MARKER_NAME = ".retire.json"
# Where outputs written before the `data/` layout keep them; still read, never written
# to a new output.
LEGACY_MANIFEST_NAME = "_manifest.json"
LEGACY_RETIRE_MARKER_NAME = "_retire.json"
MANIFEST_FORMAT = "raycap.dataset"
MANIFEST_FORMAT_VERSION = 1
# The version of the row schemas (`raycap.rows.arrow`): bump it when a column changes meaning,
# so a reader can tell which rows it holds. 2: the record columns (`RECORD_COLUMNS`:
# reward, task_index, ...) follow the build's; an output of version 1 has none of them,
# and every reader takes it as it is (a missing record column reads as absent).
SCHEMA_VERSION = 2
# The most raycap reads of a manifest (a few hundred bytes per shard: a million shards)
# and of a retire marker: anything larger is not one raycap wrote.
MAX_MANIFEST_BYTES = 256 << 20
MAX_MARKER_BYTES = 1 << 20


def _entry_exists(path: Path) -> bool:
    """Whether there is an entry at `path`, of any kind (lstat: a link is not followed)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def manifest_file(output: str | os.PathLike) -> Path:
    """The manifest file of `output`: the hidden one, or that of an output written
    before it was hidden."""
    output = Path(output)
    current = output / MANIFEST_NAME
    legacy = output / LEGACY_MANIFEST_NAME
    return legacy if not _entry_exists(current) and _entry_exists(legacy) else current


def has_manifest(output: str | os.PathLike) -> bool:
    """Whether `output` holds an entry named like a manifest (of any kind: whether it is
    a readable one is `read_manifest`'s to say)."""
    return _entry_exists(manifest_file(output))


def _retire_marker(output: str | os.PathLike) -> Path:
    """The retirement marker of `output`; an earlier raycap's when it wrote one there."""
    output = Path(output)
    legacy = output / LEGACY_RETIRE_MARKER_NAME
    return legacy if _entry_exists(legacy) else output / RETIRE_MARKER_NAME


def read_metadata(path: Path, *, limit: int, what: str, head: bool = False) -> bytes:
    """The bytes of one of an output's metadata files: the one way they are read.

    Opened as capture files are (`raycap.capture.untrusted.read_small_file`): never through a
    link, never waiting on a FIFO, a regular file of at most `limit` bytes, else
    UnsafeFileError naming it (with `head`: its first `limit` bytes, whatever its size).
    FileNotFoundError when it is missing."""
    return read_small_file(path, limit=limit, what=what, head=head)


# How much of a manifest says whether it is raycap's: its "format" key comes first (or,
# in an earlier raycap's sorted keys, after a few short ones).
_MANIFEST_HEAD_BYTES = 4096


def looks_committed(output: str | os.PathLike) -> bool:
    """Whether `output` holds a regular manifest file that begins as raycap's do: a
    cheap test (one small read, no parse) for directories raycap does not own, such as
    the ancestors `raycap.output.commit.check_placement` looks at. A link, FIFO or device there,
    or any other file, means no."""
    try:
        head = read_metadata(manifest_file(output), limit=_MANIFEST_HEAD_BYTES, what="manifest", head=True)
    except (OSError, ValueError):
        return False
    return f'"format": "{MANIFEST_FORMAT}"'.encode() in head


def utc_now() -> str:
    """The time a manifest or the retire marker records: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- the manifest -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A committed output's `.manifest.json`: where its rows are and what they say.

    Shards are in rollout order. Their stats come without delivered fractions (see
    `raycap.output.summary`); `delivered_fraction` holds the whole output's percentiles."""

    path: Path | Location
    schema: str  # "rollout" or "chains"
    schema_version: int
    fingerprint: str
    inputs: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    totals: ShardStats
    delivered_fraction: Percentiles | None
    committed_at: str
    # Where the commit put the output (its real parent, and its name). Retirement is
    # allowed only there: a copy, a staging directory or a set-aside output carries the
    # same manifest but is not the committed dataset.
    committed_as: str | None = None
    # An output of `raycap.finalize_rollouts`: its finalized records (`.records/` parts)
    # and their counts; None for rows alone.
    records: RecordsManifest | None = None
    # On an object store: the staging attempt the listed objects were committed from,
    # which a roll-forward copies them from (`raycap.output.objectstore`); None locally.
    staged_as: str | None = None

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    @property
    def arrow_bytes(self) -> int:
        return sum(s.arrow_bytes for s in self.shards)

    @property
    def retirable(self) -> int:
        return sum(s.retirable for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        d = self.delivered_fraction
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "schema": self.schema,
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "inputs": self.inputs,
            "committed_at": self.committed_at,
            "committed_as": self.committed_as,
            "rows": self.rows,
            "rollouts": self.totals.rollouts,
            "file_bytes": self.file_bytes,
            "arrow_bytes": self.arrow_bytes,
            "retirable": self.retirable,
            "totals": self.totals.to_json(),
            "delivered_fraction": None if d is None else {"p10": d.p10, "p50": d.p50, "p90": d.p90},
            "shards": [s.to_json() for s in self.shards],
            **({} if self.records is None else {"records": self.records.to_json()}),
            **({} if self.staged_as is None else {"staged_as": self.staged_as}),
        }

    @classmethod
    def from_json(cls, path: Path | Location, raw: dict[str, Any]) -> "Manifest":
        """The manifest of the output `path` from its JSON. Shard names are checked
        here, where every reader's manifest is parsed: OutputError (one line) for a name
        that is not a plain name inside the output, or a shard listed twice."""
        if not isinstance(raw, dict):
            raise ValueError("it is not a JSON object")
        if raw.get("format") != MANIFEST_FORMAT or raw.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest of version {MANIFEST_FORMAT_VERSION}")
        if not isinstance(raw["shards"], list):
            raise ValueError("its shards are not a list")
        shards = tuple(ShardInfo.from_json(s) for s in raw["shards"])
        _check_shard_names(path, (s.name for s in shards))
        d = raw["delivered_fraction"]
        return cls(
            path=path,
            schema=raw["schema"],
            schema_version=raw["schema_version"],
            fingerprint=raw["fingerprint"],
            inputs=raw["inputs"],
            shards=shards,
            totals=ShardStats.from_json(raw["totals"]),
            delivered_fraction=None if d is None else Percentiles(d["p10"], d["p50"], d["p90"]),
            committed_at=raw["committed_at"],
            committed_as=raw.get("committed_as"),
            records=None if raw.get("records") is None else RecordsManifest.from_json(path, raw["records"]),  # type: ignore[arg-type]
            staged_as=_staged_as(raw.get("staged_as")),
        )


# A staging attempt's name (`raycap.output.objectstore`): its UTC start and a random part.
_ATTEMPT = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{12}$")


def is_attempt_name(name: Any) -> bool:
    """Whether `name` is a staging attempt's name (a manifest is untrusted input)."""
    return isinstance(name, str) and _ATTEMPT.match(name) is not None


def _staged_as(value: Any) -> str | None:
    """A manifest's staging attempt, which must be an attempt's name: a roll-forward
    copies only from `.NAME.staging/<attempt>/` beside the output."""
    if value is not None and not is_attempt_name(value):
        raise ValueError(f"its staged_as {bounded_repr(value)} is not the name of a staging attempt")
    return value


def _check_shard_names(output: Path | Location, names: Iterable[Any]) -> None:
    seen: set[str] = set()
    for name in names:
        problem = shard_name_problem(name)
        if problem is None and name in seen:
            problem = "which it lists twice"
        if problem is not None:
            raise OutputError(
                f"the manifest of {output} lists shard {bounded_repr(name)}, {problem}; nothing of the output was "
                "read: a shard must be a plain name inside the output (data/NAME.parquet); restore the manifest, "
                "or rebuild the output"
            )
        seen.add(name)


def read_manifest(output: str | os.PathLike) -> Manifest:
    """The manifest of a committed output; OutputError (one line) when there is none, it
    is not a regular file of a manifest's size, or it is unreadable or lists a shard
    outside the output."""
    location = as_location(output)
    if not location.local:
        return read_remote_manifest(location)
    return read_local_manifest(output)


def read_local_manifest(output: str | os.PathLike) -> Manifest:
    """`read_manifest` of a local output."""
    output = Path(output)
    try:
        # Its stats are floats written by Python's json, which writes NaN: NaN is valid here.
        raw = loads_untrusted(read_metadata(manifest_file(output), limit=MAX_MANIFEST_BYTES, what="manifest"), "its text", allow_nan=True)
        return Manifest.from_json(output, raw)
    except FileNotFoundError:
        raise OutputError(f"{output} is not a committed raycap output (it has no {MANIFEST_NAME})") from None
    except UnsafeFileError as exc:
        raise OutputError(f"{exc}; {output} is not read as a committed output") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise OutputError(
            f"the manifest of {output} is unreadable ({type(exc).__name__}: {bounded(str(exc))}); "
            "restore it, or rebuild the output"
        ) from None


def read_remote_manifest(output: Location) -> Manifest:
    """`read_manifest` of an object store's output."""
    try:
        raw = loads_untrusted(output.child(MANIFEST_NAME).read_bytes(MAX_MANIFEST_BYTES, what="manifest"), "its text", allow_nan=True)
        return Manifest.from_json(output, raw)
    except FileNotFoundError:
        raise OutputError(f"{output} is not a committed raycap output (it has no {MANIFEST_NAME})") from None
    except OutputError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise OutputError(
            f"the manifest of {output} is unreadable ({type(exc).__name__}: {bounded(str(exc))}); "
            "restore it, or rebuild the output"
        ) from None


def committed_location(output: str | os.PathLike | Location) -> str:
    """The place a commit records: the real path of the output's parent, and its name
    (an object store's output: its URI)."""
    if isinstance(output, Location):
        if not output.local:
            return output.uri
        output = output.path
    output = Path(output)
    return os.path.join(os.path.realpath(output.parent), output.name)


def committed_manifest(output: str | os.PathLike, manifest: Manifest | None = None) -> Manifest:
    """The manifest of `output` when it is a committed output at the place its commit
    put it; OutputError (one line) for anything else: no manifest, a staging directory,
    a `.rejected` or superseded copy, or a directory copied or renamed from an output.
    Only such an output may be retired from: its rows are the durable, accepted ones.
    `manifest` is the output's manifest when the caller has read it already."""
    location = as_location(output)
    if not location.local:
        if manifest is None:
            manifest = read_manifest(location)
        if manifest.committed_as != location.uri:
            raise OutputError(
                f"{location} is not a committed output: its manifest was committed as {manifest.committed_as}, so this "
                "is a set-aside (.rejected/superseded) or copied dataset; nothing was retired: retire only from the "
                "committed output, or rebuild to this place"
            )
        return manifest
    output = location.path
    if not output.is_dir():
        raise OutputError(f"{output} is not a committed raycap output (not a directory); retire only from the output a rebuild committed")
    if manifest is None:
        manifest = read_manifest(output)
    recorded = manifest.committed_as
    if recorded is None:
        raise OutputError(
            f"{output} does not record where it was committed (an earlier raycap wrote it); nothing was retired: "
            "rebuild it with overwrite: true and retire from the new output"
        )
    if os.path.realpath(output) != recorded:
        raise OutputError(
            f"{output} is not a committed output: its manifest was committed as {recorded}, so this is a staging "
            "directory, a set-aside (.rejected/superseded) or copied dataset; nothing was retired: retire only from "
            "the committed output, or rebuild to this path"
        )
    return manifest


def is_committed(output: str | os.PathLike) -> bool:
    """Whether `output` is a committed raycap dataset with a readable manifest."""
    try:
        read_manifest(output)
    except OutputError:
        return False
    return True


def shard_paths(output: str | os.PathLike | Location, manifest: Manifest | None = None) -> list[Any]:
    """The committed shards' paths, in rollout order: the manifest's names, relative to
    the output (`data/part-...` now, `part-...` in an output written before `data/`).
    `manifest` is the output's manifest when the caller has read it already.

    OutputError (one line, naming the shard) when a shard is missing or is not a
    regular file (a link, a FIFO, ...), or the `data` directory is not a directory of
    the output (a link): a reader given these paths never leaves the output or waits.

    On an object store: the shards' Locations, once every listed shard is in place with
    the size its manifest records (one listing); OutputError while a commit's
    roll-forward is unfinished, or a shard is missing or changed."""
    location = as_location(output)
    if not location.local:
        return remote_shards(location, manifest)
    return local_shards(location.path, manifest)


def local_shards(output: Path, manifest: Manifest | None) -> list[Path]:
    """`shard_paths` of a local output."""
    if manifest is None:
        manifest = read_manifest(output)
    paths = [output / shard.name for shard in manifest.shards]
    if any(shard.name.startswith(DATA_DIR + "/") for shard in manifest.shards):
        _check_entry(output / DATA_DIR, stat.S_ISDIR, "a directory")
    for path in paths:
        _check_entry(path, stat.S_ISREG, "a regular file")
    return paths


def remote_shards(output: Location, manifest: Manifest | None) -> list[Location]:
    """`shard_paths` of an object store's output."""
    if manifest is None:
        manifest = read_manifest(output)
    try:
        present = output.files()
    except OSError as exc:
        raise OutputError(f"cannot list {output} on its store: {bounded(exc, 240)}; check the store and read again") from None
    wrong = [shard for shard in manifest.shards if present.get(shard.name) != shard.file_bytes]
    if wrong:
        raise OutputError(not_in_place(output, wrong[0].name, len(wrong), len(manifest.shards)))
    return [output.child(shard.name) for shard in manifest.shards]


def not_in_place(output: Location, name: str, wrong: int, listed: int) -> str:
    """Why an object-store output's listed object cannot be read (one line)."""
    return (
        f"{output.child(name)} is not in place in its committed output ({wrong} of {listed} listed objects are "
        "missing or of another size): its commit's copy into place is unfinished, or they were changed; nothing was "
        "read. Rerun the run that wrote it (a rerun finishes the copy), or rebuild the output"
    )


def _check_entry(path: Path, is_kind: Any, kind: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise OutputError(f"{path} is missing from its committed output; restore it, or rebuild the output") from None
    if not is_kind(mode):
        raise OutputError(_not_shard_text(path, kind_of(mode) or f"not {kind}"))


def _not_shard_text(path: Path, kind: str) -> str:
    return (
        f"{path} is {kind}; raycap reads an output's shards only as regular files inside it, never through a "
        "link: replace it with the file (or directory) itself, or rebuild the output"
    )


def open_shard(path: Path | Location) -> BinaryIO:
    """A shard of `shard_paths`, open for reading: its directory (`data`) opened without
    following a link, the shard by name inside it with O_NOFOLLOW|O_NONBLOCK and checked
    by fstat to be a regular file, so an entry swapped in after `shard_paths` looked is
    refused (OutputError) too, never followed or waited on. A shard on an object store
    (a Location) is opened by its file system: no link or FIFO exists there."""
    if isinstance(path, Location):
        try:
            return path.filesystem.open_input_file(path.fs_path)
        except FileNotFoundError:
            raise OutputError(f"{path} is missing from its committed output; restore it, or rebuild the output") from None
    directory = path.parent
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if directory.name == DATA_DIR else 0)
    try:
        dir_fd = os.open(directory, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutputError(_not_shard_text(directory, "not a directory")) from None
        raise
    try:
        fd = open_regular(path.name, os.O_RDONLY, lambda kind: OutputError(_not_shard_text(path, kind)), dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return os.fdopen(fd, "rb")


def read_shard(path: Path | Location, columns: Iterable[str] | None = None) -> pa.Table:
    """A shard's rows (only `columns`, when given), read through `open_shard`."""
    with open_shard(path) as handle:
        return pq.read_table(handle, columns=None if columns is None else list(columns))


def output_rollout_ids(output: str | os.PathLike) -> set[str]:
    """The rollout ids a committed output holds, read shard by shard from its one small column."""
    ids: set[str] = set()
    for path in shard_paths(output):
        ids.update(read_shard(path, ["rollout_id"]).column("rollout_id").to_pylist())
    return ids


# --- the retire marker --------------------------------------------------------------------------


def was_retired_from(output: str | os.PathLike | Location) -> bool:
    """Whether retirement ever started on this output (its marker is written first)."""
    location = as_location(output)
    if not location.local:
        return location.child(RETIRE_MARKER_NAME).exists()
    return _retire_marker(location.path).exists()


def retired_outputs(output: str | os.PathLike) -> list[Path]:
    """The outputs of this name that captures were retired from: the output itself and
    its set-aside siblings (`NAME.rejected`, `NAME.*superseded-*`), in name order."""
    location = as_location(output)
    if not location.local:
        return remote_retired_outputs(location)
    return local_retired_outputs(location.path)


def local_retired_outputs(output: Path) -> list[Path]:
    """`retired_outputs` of a local output."""
    found = []
    try:
        siblings = sorted(output.parent.iterdir())
    except OSError:
        return []
    for path in siblings:
        if (path == output or path.name.startswith(output.name + ".")) and path.is_dir() and not path.is_symlink():
            if was_retired_from(path):
                found.append(path)
    return found


def remote_retired_outputs(output: Location) -> list[Any]:
    """`retired_outputs` of an object store's output."""
    found = []
    try:
        names = output.parent.entries()
    except OSError:
        return []
    for name in names:
        if name == output.name or (name.startswith(output.name + ".") and not name.endswith(".json")):
            if was_retired_from(output.sibling(name)):
                found.append(output.sibling(name))
    return found


def mark_retiring(output: str | os.PathLike | Location, state: str, **details: Any) -> None:
    """Record durably in a committed output that captures are being retired from it:
    called with state "started" before the first one is dropped, and again with how it
    ended. Keeps the first start time and stamps each state (`<state>_at`). On an
    object store the marker is one object, written whole."""
    location = as_location(output)
    marker: Any = _retire_marker(location.path) if location.local else location.child(RETIRE_MARKER_NAME)
    try:
        if location.local:
            record = loads_untrusted(read_metadata(marker, limit=MAX_MARKER_BYTES, what="retire marker"), allow_nan=True)
        else:
            record = loads_untrusted(marker.read_bytes(MAX_MARKER_BYTES, what="retire marker"), allow_nan=True)
    except (OSError, ValueError, RecursionError):
        record = {}  # none yet, or not one raycap wrote: the new one replaces the entry, never writes through it
    if not isinstance(record, dict):
        record = {}
    now = utc_now()
    record.setdefault("first_started_at", now)
    record.update(details, state=state)
    record[f"{state}_at"] = now
    if location.local:
        write_json_durably(marker, record)
        return
    try:
        marker.put_bytes((json.dumps(record, indent=2) + "\n").encode())
    except OSError as exc:
        raise store_fault(location, exc) from None
