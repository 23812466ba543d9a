"""An object store's output, read: the read primitives of `raycap.output.objectstore.writes.StoreBackend`.

The same files as a local output's are objects here: a manifest is read size-bounded,
`committed_as` is the output's URI, and `store_shards` gives each shard's Location after
checking (one listing) that every listed shard is in place with its size: while a
commit's roll-forward is unfinished it refuses, so no reader reads a partial set. A
records part is checked against its manifest entry (size, sha256) as a local one is.
No link or FIFO exists on a store: its file system opens every object.

Every function here takes the output's Location; the protocol's callers reach them
through the backend (`raycap.output.protocol.backend_of`), never by name.

This module does not import Ray.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, BinaryIO

from raycap.capture.untrusted import bounded, loads_untrusted
from raycap.output.faults import OutputError, store_fault
from raycap.output.location import Location, check_writable
from raycap.output.manifestformat import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    RETIRE_MARKER_NAME,
    Manifest,
)
from raycap.output.objectstore import client
from raycap.output.objectstore.client import check_reachable
from raycap.output.recordparts import RecordsPart


def read_store_manifest(output: Location) -> Manifest:
    """`raycap.output.manifest.read_manifest` of an object store's output."""
    try:
        raw = loads_untrusted(client.read_bytes(output.child(MANIFEST_NAME), MAX_MANIFEST_BYTES, what="manifest"), "its text", allow_nan=True)
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


def store_committed_manifest(output: Location, manifest: Manifest | None) -> Manifest:
    """`raycap.output.manifest.committed_manifest` of an object store's output."""
    if manifest is None:
        manifest = read_store_manifest(output)
    if manifest.committed_as != output.uri:
        raise OutputError(
            f"{output} is not a committed output: its manifest was committed as {manifest.committed_as}, so this "
            "is a set-aside (.rejected/superseded) or copied dataset; nothing was retired: retire only from the "
            "committed output, or rebuild to this place"
        )
    return manifest


def store_shards(output: Location, manifest: Manifest | None) -> list[Location]:
    """`raycap.output.manifest.shard_paths` of an object store's output."""
    if manifest is None:
        manifest = read_store_manifest(output)
    try:
        present = client.files(output)
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


def open_store_shard(shard: Location) -> BinaryIO:
    """`raycap.output.manifest.open_shard` of a shard on a store: opened by its file system."""
    try:
        return client.filesystem(shard).open_input_file(shard.fs_path)
    except FileNotFoundError:
        raise OutputError(f"{shard} is missing from its committed output; restore it, or rebuild the output") from None


def read_store_part(output: Location, part: RecordsPart) -> bytes:
    """`raycap.output.manifest.read_records_part` of an object store's output."""
    target = output.child(part.name)
    try:
        info = client.info(target)
        if info.size is None:
            raise FileNotFoundError(target.uri)
        if info.size != part.file_bytes:
            raise OutputError(
                f"{target} is not in place in its output ({info.size} bytes where its manifest says "
                f"{part.file_bytes}): its commit's copy into place is unfinished, or it changed; rerun the run that "
                "wrote it (a rerun finishes the copy), or finalize the output again"
            )
        data = client.read_bytes(target, part.file_bytes, what="records part")
    except FileNotFoundError:
        raise OutputError(f"{target} is missing from its output; rerun the run that wrote it, or finalize again") from None
    except OSError as exc:
        raise OutputError(f"cannot read {target}: {exc}; check the store and read again") from None
    if hashlib.sha256(data).hexdigest() != part.sha256:
        raise OutputError(f"{target} is not the records part its manifest lists (other bytes); restore it, or finalize the output again")
    return data


def visible_parquet(output: Location) -> list[Location] | None:
    """The Parquet objects a generic reader of `output` reads, when it holds no manifest:
    the visible ones under it (a name starting with "." or "_" anywhere in its path is
    skipped, as every reader skips it). None when its manifest is there: its shards are
    the output's. OutputError (one line) when the store cannot list it or nothing
    Parquet is there."""
    try:
        files = client.files(output)
    except OSError as exc:
        raise OutputError(f"cannot list {output}: {exc}; check the store (AWS_ENDPOINT_URL, credentials)") from None
    if MANIFEST_NAME in files:
        return None
    names = sorted(
        name for name in files
        if name.endswith(".parquet") and not any(part.startswith(("_", ".")) for part in name.split("/"))
    )
    if not names:
        raise OutputError(f"{output} holds no Parquet objects; is it a raycap output (or still being written)?")
    return [output.child(name) for name in names]


# --- a move aside's record ------------------------------------------------------------------------

# The places a move puts an output (`_stamped`, `set_aside`), relative to its name.
_MOVED_SUFFIX = re.compile(r"\.(?:(?:retired-)?superseded-[0-9]{8}T[0-9]{6}Z(?:-[0-9]+)?|rejected)")


def move_target(output: Location, record: Any) -> Location:
    """The copy a move record names, when it is the move's own place: a sibling of the
    output under a name a move gives (`NAME.superseded-<time>`, `NAME.retired-superseded-
    <time>`, `NAME.rejected`), named by its whole URI. The record is read from the store,
    so it is untrusted: anything else (the output itself, another prefix, bucket or
    store) is refused (ValueError)."""
    moved_to = record.get("moved_to") if isinstance(record, dict) else None
    if not isinstance(moved_to, str):
        raise ValueError("it names no copy")
    name = moved_to.rpartition("/")[2]
    target = output.sibling(name)
    if not name.startswith(output.name) or not _MOVED_SUFFIX.fullmatch(name[len(output.name):]) or moved_to != target.uri:
        raise ValueError(f"it names {bounded(moved_to, 200)}, not a place a move of {output.name} puts its copy")
    return target


# --- what is above the output ---------------------------------------------------------------------


def check_placement(output: Location) -> None:
    """Refuse (OutputError) an output named like a capture file, or inside another
    committed output on the store (a manifest at a prefix above it); the store is asked
    first whether the bucket is there (`raycap.output.objectstore.client.check_reachable`)."""
    if ".tokens." in output.name:
        raise OutputError(
            f"output {output} is named like a capture file (*.tokens.*), which a capture store would take for a "
            "rollout; choose another output name"
        )
    check_writable(output)
    check_reachable(output)
    parts = output.key.split("/")
    try:
        for depth in range(1, len(parts)):
            ancestor = Location(
                f"{output.scheme}://{output.bucket}/{'/'.join(parts[:depth])}", output.scheme,
                f"{output.bucket}/{'/'.join(parts[:depth])}", output.storage_options,
            )
            object.__setattr__(ancestor, "_fs", client.filesystem(output))
            if client.exists(ancestor.child(MANIFEST_NAME)):
                raise OutputError(
                    f"output {output} is inside the committed output {ancestor}, whose readers would take it for "
                    "their own rows; choose an output outside it"
                )
    except OSError as exc:
        raise OutputError(f"cannot look at output {output} on its store: {bounded(exc, 240)}; check the store and rerun") from None


# --- the retire marker, and the outputs captures were retired from -------------------------------


def was_retired_from(output: Location) -> bool:
    """Whether retirement ever started on the store's `output` (its marker is written first)."""
    return client.exists(output.child(RETIRE_MARKER_NAME))


def store_retired_outputs(output: Location) -> list[Any]:
    """`raycap.output.manifest.retired_outputs` of an object store's output."""
    found = []
    try:
        names = client.entries(output.parent)
    except OSError:
        return []
    for name in names:
        if name == output.name or (name.startswith(output.name + ".") and not name.endswith(".json")):
            if was_retired_from(output.sibling(name)):
                found.append(output.sibling(name))
    return found


def read_marker(output: Location) -> bytes:
    return client.read_bytes(output.child(RETIRE_MARKER_NAME), MAX_MARKER_BYTES, what="retire marker")


def write_marker(output: Location, record: dict[str, Any]) -> None:
    """The marker is one object, written whole."""
    try:
        client.put_bytes(output.child(RETIRE_MARKER_NAME), (json.dumps(record, indent=2) + "\n").encode())
    except OSError as exc:
        raise store_fault(output, exc) from None
