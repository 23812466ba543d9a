"""What a committed output says, read through the output's one protocol: its manifest, its parts, its retire marker.

- `read_manifest` and `shard_paths` give the shards in manifest order (authoritative);
  the format is `raycap.output.manifestformat`'s. Outputs of the earlier layout
  (`_manifest.json`) are still read.
- A manifest is untrusted input: opened without following a link, size-bounded, and a
  shard name that is not a plain name inside the output, or is listed twice, is refused;
  `open_shard` never follows a link.
- `committed_manifest` accepts only an output at the place its commit put it
  (`committed_as`): a staging area, a set-aside or a copied output is refused.
- `mark_retiring` writes `.retire.json` before any drop; `was_retired_from` tells which
  outputs may hold the only copy of their trajectories.
- On an object store `shard_paths` also checks that every listed shard is in place
  with its size, so no reader reads a partial roll-forward.

Every function takes a path, a URI or a `Location`, and calls the output's backend
(`raycap.output.protocol.backend_of`), never branching on where the output is. The
contract in full: docs/internals.md ("Reading a committed output"). No Ray.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Callable, Iterable

import pyarrow as pa

from raycap.capture.untrusted import loads_untrusted
from raycap.output.faults import OutputError
from raycap.output.local.reads import has_manifest as has_manifest  # a local directory's, by name
from raycap.output.local.reads import looks_committed as looks_committed
from raycap.output.local.reads import manifest_file as manifest_file
from raycap.output.local.reads import read_metadata as read_metadata
from raycap.output.location import Location, as_location
from raycap.output.manifestformat import LEGACY_MANIFEST_NAME as LEGACY_MANIFEST_NAME
from raycap.output.manifestformat import LEGACY_RETIRE_MARKER_NAME as LEGACY_RETIRE_MARKER_NAME
from raycap.output.manifestformat import MANIFEST_FORMAT as MANIFEST_FORMAT
from raycap.output.manifestformat import MANIFEST_FORMAT_VERSION as MANIFEST_FORMAT_VERSION
from raycap.output.manifestformat import MANIFEST_NAME as MANIFEST_NAME
from raycap.output.manifestformat import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from raycap.output.manifestformat import MAX_MARKER_BYTES as MAX_MARKER_BYTES
from raycap.output.manifestformat import RETIRE_MARKER_NAME as RETIRE_MARKER_NAME
from raycap.output.manifestformat import SCHEMA_VERSION as SCHEMA_VERSION
from raycap.output.manifestformat import Manifest as Manifest
from raycap.output.manifestformat import is_attempt_name as is_attempt_name
from raycap.output.manifestformat import utc_now
from raycap.output.protocol import backend_of
from raycap.output.recordparts import RecordsPart


def read_manifest(output: str | os.PathLike | Location) -> Manifest:
    """The manifest of a committed output; OutputError (one line) when there is none, it
    is not a regular file of a manifest's size, or it is unreadable or lists a shard
    outside the output."""
    location = as_location(output)
    return backend_of(location).manifest(location)


def committed_location(output: str | os.PathLike | Location) -> str:
    """The place a commit records: the real path of the output's parent, and its name
    (an object store's output: its URI)."""
    location = as_location(output)
    return backend_of(location).committed_as(location)


def committed_manifest(output: str | os.PathLike | Location, manifest: Manifest | None = None) -> Manifest:
    """The manifest of `output` when it is a committed output at the place its commit
    put it; OutputError (one line) for anything else: no manifest, a staging directory,
    a `.rejected` or superseded copy, or a directory copied or renamed from an output.
    Only such an output may be retired from: its rows are the durable, accepted ones.
    `manifest` is the output's manifest when the caller has read it already."""
    location = as_location(output)
    return backend_of(location).committed_manifest(location, manifest)


def is_committed(output: str | os.PathLike | Location) -> bool:
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
    return backend_of(location).shards(location, manifest)


def open_shard(path: str | os.PathLike | Location) -> BinaryIO:
    """A shard of `shard_paths`, open for reading: its directory (`data`) opened without
    following a link, the shard by name inside it with O_NOFOLLOW|O_NONBLOCK and checked
    by fstat to be a regular file, so an entry swapped in after `shard_paths` looked is
    refused (OutputError) too, never followed or waited on. A shard on an object store
    (a Location) is opened by its file system: no link or FIFO exists there."""
    location = as_location(path)
    backend = backend_of(location)
    return backend.open_part(backend.where(location))


def read_shard(path: str | os.PathLike | Location, columns: Iterable[str] | None = None) -> pa.Table:
    """A shard's rows (only `columns`, when given), read through `open_shard`."""
    location = as_location(path)
    backend = backend_of(location)
    return backend.read_table(backend.where(location), columns)


def read_records_part(output: str | os.PathLike | Location, part: RecordsPart) -> bytes:
    """The bytes of one records part of `output`, checked against what its manifest
    says (size, sha256): the `.records` folder opened without following a link, the
    part by name inside it as a regular file (never a link, never waiting on a FIFO).
    OutputError (one line, naming the part) otherwise. On an object store the part is
    read by its file system, checked the same way."""
    location = as_location(output)
    return backend_of(location).read_part(location, part)


def stream_records_part(output: str | os.PathLike | Location, part: RecordsPart, write: Callable[[Any], Any]) -> None:
    """`read_records_part`, its bytes passed to `write` a chunk at a time (each good until
    `write` returns) and checked at the end: use none of them unless this returns."""
    location = as_location(output)
    backend_of(location).stream_part(location, part, write)


def output_rollout_ids(output: str | os.PathLike | Location) -> set[str]:
    """The rollout ids a committed output holds, read shard by shard from its one small column."""
    location = as_location(output)
    backend = backend_of(location)
    ids: set[str] = set()
    for shard in backend.shards(location):
        ids.update(backend.read_table(shard, ["rollout_id"]).column("rollout_id").to_pylist())
    return ids


# --- the retire marker --------------------------------------------------------------------------


def was_retired_from(output: str | os.PathLike | Location) -> bool:
    """Whether retirement ever started on this output (its marker is written first)."""
    location = as_location(output)
    return backend_of(location).was_retired_from(location)


def retired_outputs(output: str | os.PathLike | Location) -> list[Any]:
    """The outputs of this name that captures were retired from: the output itself and
    its set-aside siblings (`NAME.rejected`, `NAME.*superseded-*`), in name order."""
    location = as_location(output)
    return backend_of(location).retired_outputs(location)


def mark_retiring(output: str | os.PathLike | Location, state: str, **details: Any) -> None:
    """Record durably in a committed output that captures are being retired from it:
    called with state "started" before the first one is dropped, and again with how it
    ended. Keeps the first start time and stamps each state (`<state>_at`). On an
    object store the marker is one object, written whole."""
    location = as_location(output)
    backend = backend_of(location)
    try:
        record = loads_untrusted(backend.read_marker(location), allow_nan=True)
    except (OSError, ValueError, RecursionError):
        record = {}  # none yet, or not one raycap wrote: the new one replaces the entry, never writes through it
    if not isinstance(record, dict):
        record = {}
    now = utc_now()
    record.setdefault("first_started_at", now)
    record.update(details, state=state)
    record[f"{state}_at"] = now
    backend.write_marker(location, record)
