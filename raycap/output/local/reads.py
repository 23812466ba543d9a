"""A local output's readers: the read primitives of `raycap.output.local.writes.LocalBackend`.

A manifest is untrusted input, read as capture files are: `read_metadata` is the one
read of an output's metadata files (the manifest and the retire marker), each opened
without following a link or waiting on a FIFO, a regular file only, size-bounded
(`MAX_MANIFEST_BYTES`, `MAX_MARKER_BYTES`). `local_shards` refuses a shard that is
missing or not a regular file, or a `data` directory that is a link; `open_local_shard`
opens one without following a link or waiting on a FIFO even if the entry was swapped
since, and `read_local_part` opens a records part the same way. An output written before
the hidden layout (shards at the top, `_manifest.json`, `_retire.json`) is still read.

Every function here takes the output's local path; the protocol's callers reach them
through the backend (`raycap.output.protocol.backend_of`), never by name.

This module does not import Ray.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable

from raycap.capture.files import kind_of, open_regular
from raycap.capture.untrusted import UnsafeFileError, bounded, loads_untrusted, read_small_file
from raycap.output.durable import write_json_durably
from raycap.output.faults import OutputError
from raycap.output.manifestformat import (
    LEGACY_MANIFEST_NAME,
    LEGACY_RETIRE_MARKER_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    RETIRE_MARKER_NAME,
    Manifest,
)
from raycap.output.recordparts import RECORDS_DIR, RecordsPart
from raycap.output.shards import DATA_DIR
from raycap.output.unbuffered import read_chunks

logger = logging.getLogger(__name__)

# How much of a manifest says whether it is raycap's: its "format" key comes first (or,
# in an earlier raycap's sorted keys, after a few short ones).
_MANIFEST_HEAD_BYTES = 4096


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
    a readable one is `read_local_manifest`'s to say)."""
    return _entry_exists(manifest_file(output))


def retire_marker(output: str | os.PathLike) -> Path:
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


def read_local_manifest(output: str | os.PathLike) -> Manifest:
    """`raycap.output.manifest.read_manifest` of a local output."""
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


def is_committed(output: str | os.PathLike) -> bool:
    """Whether the local `output` is a committed raycap dataset with a readable manifest."""
    try:
        read_local_manifest(output)
    except OutputError:
        return False
    return True


def committed_as(output: Path) -> str:
    """The place a commit records: the real path of the output's parent, and its name."""
    return os.path.join(os.path.realpath(output.parent), output.name)


def local_committed_manifest(output: Path, manifest: Manifest | None) -> Manifest:
    """`raycap.output.manifest.committed_manifest` of a local output."""
    if not output.is_dir():
        raise OutputError(f"{output} is not a committed raycap output (not a directory); retire only from the output a rebuild committed")
    if manifest is None:
        manifest = read_local_manifest(output)
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


# --- the committed parts ------------------------------------------------------------------------


def local_shards(output: Path, manifest: Manifest | None) -> list[Path]:
    """`raycap.output.manifest.shard_paths` of a local output."""
    if manifest is None:
        manifest = read_local_manifest(output)
    paths = [output / shard.name for shard in manifest.shards]
    if any(shard.name.startswith(DATA_DIR + "/") for shard in manifest.shards):
        _check_entry(output / DATA_DIR, stat.S_ISDIR, "a directory")
    for path in paths:
        _check_entry(path, stat.S_ISREG, "a regular file")
    return paths


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


def open_local_shard(path: Path) -> BinaryIO:
    """`raycap.output.manifest.open_shard` of a local shard: its directory (`data`)
    opened without following a link, the shard by name inside it with
    O_NOFOLLOW|O_NONBLOCK and checked by fstat to be a regular file."""
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


def _not_part_text(path: Path, kind: str) -> str:
    return (
        f"{path} is {kind}; raycap reads an output's records only as regular files inside it, never through a "
        "link: replace it with the file (or folder) itself, or finalize the output again"
    )


def read_local_part(output: str | os.PathLike, part: RecordsPart) -> bytes:
    """`raycap.output.manifest.read_records_part` of a local output: the `.records`
    folder opened without following a link, the part by name inside it as a regular
    file (never a link, never waiting on a FIFO), checked against its manifest entry."""
    path, fd = _open_part(output, part)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(part.file_bytes + 1)
    if len(data) != part.file_bytes or hashlib.sha256(data).hexdigest() != part.sha256:
        raise _not_listed(path, len(data), part)
    return data


def stream_local_part(output: str | os.PathLike, part: RecordsPart, write: Callable[[memoryview], Any]) -> None:
    """A records part of a local output, opened as `read_local_part` opens it, passed to
    `write` a chunk at a time as it is read around the page cache
    (`raycap.output.unbuffered.read_chunks`: a chunk is good until `write` returns), and
    checked against its manifest entry at the end: OutputError then when it is not the
    part listed, so what `write` was given must not be used before this returns."""
    path, fd = _open_part(output, part)
    digest, size = hashlib.sha256(), 0
    try:
        for chunk in read_chunks(fd, part.file_bytes + 1):
            digest.update(chunk)
            size += len(chunk)
            write(chunk)
    finally:
        os.close(fd)
    if size != part.file_bytes or digest.hexdigest() != part.sha256:
        raise _not_listed(path, size, part)


def _open_part(output: str | os.PathLike, part: RecordsPart) -> tuple[Path, int]:
    """A records part's path and a descriptor of it, opened as `read_local_part` says."""
    folder = Path(output) / RECORDS_DIR
    path = Path(output) / part.name
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise OutputError(f"{folder} is missing from its output; restore it, or finalize the output again") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutputError(_not_part_text(folder, "not a folder")) from None
        raise
    try:
        try:
            fd = open_regular(path.name, os.O_RDONLY, lambda kind: OutputError(_not_part_text(path, kind)), dir_fd=dir_fd)
        except FileNotFoundError:
            raise OutputError(f"{path} is missing from its output; restore it, or finalize the output again") from None
    finally:
        os.close(dir_fd)
    return path, fd


def _not_listed(path: Path, size: int, part: RecordsPart) -> OutputError:
    return OutputError(
        f"{path} is not the records part its manifest lists ({size} bytes, or other bytes, where the "
        f"manifest says {part.file_bytes}); restore it, or finalize the output again"
    )


def visible_parquet(output: Path) -> list[Path] | None:
    """The Parquet files a generic reader of `output` reads, when it holds no manifest:
    the file itself, or the visible `.parquet` files under the directory (a name that
    starts with "_" or "." is skipped, as every reader skips it; links and FIFOs are
    left out). None when a manifest entry is there: its shards are the output's.
    OutputError (one line) when nothing is there or nothing Parquet is."""
    try:
        mode = os.stat(output).st_mode
    except FileNotFoundError:
        raise OutputError(f"{output} does not exist; give the output directory a rebuild wrote") from None
    except OSError as exc:
        raise OutputError(f"cannot read {output}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(mode):
        return [output]  # one file: opened as a shard is, so a FIFO or device is refused, not waited on
    if has_manifest(output):
        return None
    files = []
    for base, dirs, names in os.walk(output):  # links to directories are not followed
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        for name in sorted(names):
            path = Path(base) / name
            if name.startswith(("_", ".")) or not name.endswith(".parquet"):
                continue
            if stat.S_ISREG(os.lstat(path).st_mode):
                files.append(path)
            else:
                logger.warning("%s is not a regular file (a link, a FIFO, ...); left out", path)
    files.sort(key=str)
    if not files:
        raise OutputError(f"{output} holds no Parquet shards; is it a raycap output (or still being written)?")
    return files


# --- the retire marker, and the outputs captures were retired from -------------------------------


def was_retired_from(output: Path) -> bool:
    """Whether retirement ever started on the local `output` (its marker is written first)."""
    return retire_marker(output).exists()


def local_retired_outputs(output: Path) -> list[Path]:
    """`raycap.output.manifest.retired_outputs` of a local output."""
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


def read_marker(output: Path) -> bytes:
    return read_metadata(retire_marker(output), limit=MAX_MARKER_BYTES, what="retire marker")


def write_marker(output: Path, record: dict[str, Any]) -> None:
    write_json_durably(retire_marker(output), record)
