"""The files of a capture directory: their names, how each is opened (by descriptor, never
through a link, regular files only), and listing rollouts by name.

Capture files must be regular files. Each is opened by descriptor with O_NOFOLLOW and
O_NONBLOCK and checked with fstat before anything is read or written: a symbolic link,
FIFO, socket, device or directory raises CaptureFileError naming the rollout, the file
and its kind, so no operation writes, truncates or creates anything through a link, and
no FIFO can block one. The torn-line repair truncates through a descriptor of the
checked inode, never through a path. Listing and `held` look at names and `lstat` only.

`open_regular` is the rule itself; `raycap.capture.untrusted.read_small_file` applies it to the
other small files raycap reads by path (manifests, retire markers, job configs).

Appends are fsynced before they return, and a new file's directory entry too, so an
acknowledged record survives a crash.

This module does not import Ray.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
E = TypeVar("E", bound=BaseException)

# The files of rollout R are the string names "R" + suffix inside the directory.
JSONL = ".tokens.jsonl"
STATE = ".tokens.state.json"
LOCK = ".tokens.lock"
INTENTS = ".tokens.intents"
INCOMPLETE = ".tokens.incomplete"
RETIRED = ".tokens.retired"
# Files that make a rollout listed; the lock file or the retired marker alone does not
# (see listed_ids).
LISTED_SUFFIXES = (JSONL, STATE, INTENTS, INCOMPLETE)
NAMED_SUFFIXES = (*LISTED_SUFFIXES, RETIRED)
# raycap's own files beside a rollout's: a stream's commit marker and kept record
# (`raycap.capture.markers`, `raycap.capture.recordfile`, which take them from here).
COMMIT = ".tokens.commit"
RECORD = ".tokens.record.json"
# What a retired tombstone keeps besides its lock and marker (see retired_by_names).
TOMBSTONE_ONLY = frozenset({STATE})



def fsync_dir(directory: Path) -> None:
    """Make the entries of `directory` (a rename, a new file) survive a crash. The one
    fsync of a directory in raycap: captures and outputs alike. O_DIRECTORY: a path that
    is no longer a directory raises instead of fsyncing some other file."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# Each kind a capture file must not be, and what to say about it.
_NOT_REGULAR = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)
from raycap.errors import (
    CaptureFileError,  # noqa: F401 - raised here, declared with the others
    CaptureTooLarge,  # noqa: F401 - raised here, declared with the others
)

# Errors an open with O_NOFOLLOW|O_NONBLOCK gives for entries that are not regular files:
# ELOOP for a symbolic link, ENXIO for a socket or a FIFO with no reader, EISDIR for a
# directory opened for writing, ENODEV/EWOULDBLOCK/EACCES for some devices.
_ENTRY_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EWOULDBLOCK, errno.EACCES})


def kind_of(mode: int) -> str | None:
    return next((name for test, name in _NOT_REGULAR if test(mode)), None)


def located(rollout_id: str, path: Path, exc: E) -> E:
    """`exc`, whose text names a capture file by its name alone, after a WARNING that
    gives the rollout and the file's full path. A rollout's error text ends up in its
    finalized record, which is training data: machine paths stay out of it."""
    logger.warning("rollout %s: %s (%s)", rollout_id, exc, path)
    return exc


def not_regular(rollout_id: str, path: Path, kind: str) -> CaptureFileError:
    way_out = (
        "replace the link with the file it points to"
        if kind == "a symbolic link"
        else "move it out of the capture directory, or delete() the rollout"
    )
    return located(rollout_id, path, CaptureFileError(
        f"rollout {rollout_id!r}: capture file {path.name} is {kind} (capture files must be regular files; {way_out})"
    ))


def open_regular(path: Path | str, flags: int, refuse: Callable[[str], Exception], *, dir_fd: int | None = None) -> int:
    """Open `path` as a descriptor, refusing anything but a regular file with
    `refuse(kind)` ("a symbolic link", "a FIFO", ...).

    O_NOFOLLOW refuses a symbolic link (and with O_CREAT never creates its target);
    O_NONBLOCK makes a FIFO open without waiting for a writer; the fstat then checks the
    very inode that was opened, so swapping an entry after a check cannot fool it. A
    regular file's descriptor gets blocking I/O back before it is used. With `dir_fd`,
    `path` is a name inside that open directory."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in _ENTRY_ERRNOS:
            raise
        try:
            kind = kind_of(os.lstat(path, dir_fd=dir_fd).st_mode)
        except OSError:
            kind = None
        if kind is None:
            raise
        raise refuse(kind) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(kind_of(mode) or "an unknown kind of file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_or_raise(path: Path | str, flags: int, refuse: Callable[[str], Exception], busy: Callable[[], Exception]) -> int:
    """The one way raycap takes a lock file: opened as `open_regular` opens it (a link
    is refused, never followed to create or lock a file elsewhere; a FIFO is not waited
    on), then an exclusive flock without waiting; the descriptor holding it. Raises
    `busy()` when another open file holds the lock (flock belongs to the open file, so a
    second open in this process conflicts too: a lock is never silently shared)."""
    fd = open_regular(path, flags, refuse)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise busy() from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_capture(rollout_id: str, path: Path, flags: int) -> int:
    """Open a capture file as a descriptor, refusing anything but a regular file
    (`open_regular`) with CaptureFileError naming the rollout."""
    return open_regular(path, flags, lambda kind: not_regular(rollout_id, path, kind))


def open_existing(rollout_id: str, path: Path, flags: int = os.O_RDONLY) -> int | None:
    """`open_capture` of a file that may be missing: None when there is none."""
    try:
        return open_capture(rollout_id, path, flags)
    except FileNotFoundError:
        return None


# The most bytes asked of one read (Linux reads at most this much in one call).
_MAX_READ = 0x7FFFF000


def read_at(fd: int, size: int, offset: int = 0) -> bytes:
    """`size` bytes from `offset` (fewer at end of file; -1: to the end), read with
    `pread`: no file object, and one call for a known part of a file (an fstat first
    for -1). A short read is read on from, as a network or FUSE file system may give
    one before the end; only an empty read is the end of the file."""
    to_end = size < 0
    if to_end:
        # A byte more than the file holds now: the read after it finds the end.
        size = max(os.fstat(fd).st_size - offset, 0) + 1
    chunks = []
    while size > 0:
        chunk = os.pread(fd, min(size, _MAX_READ), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        size -= len(chunk)
        if to_end and size == 0:
            size = 1 << 16  # it grew since the fstat: read on to its end
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_whole(rollout_id: str, path: Path) -> bytes | None:
    """A small capture file's bytes (intents, state), or None when it is missing."""
    fd = open_existing(rollout_id, path)
    if fd is None:
        return None
    try:
        return read_at(fd, -1)
    finally:
        os.close(fd)


def read_bounded(rollout_id: str, path: Path, limit: int, what: str) -> bytes | None:
    """The bytes of a small capture file that raycap writes whole (a commit marker, a
    kept record), or None when it is missing. Opened as every capture file is
    (CaptureFileError for a link, FIFO, ...); one larger than `limit` bytes was not
    written by raycap and is refused (CaptureTooLarge, naming `what`) before any of it
    is read."""
    fd = open_existing(rollout_id, path)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CaptureTooLarge(f"{what} {path} of rollout {rollout_id!r} has {size} bytes, more than a {what}'s {limit}")
        return read_at(fd, limit + 1)
    finally:
        os.close(fd)


def append_durably(rollout_id: str, path: Path, data: bytes, *, line_start: bool = False) -> int:
    """Append `data` with fsync and return the file's new size.

    With `line_start`, a file whose last byte is not a newline gets one first, so the new
    line never merges into a newline-less line another writer left behind.
    """
    fd = open_capture(rollout_id, path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if line_start and size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if size == 0:
        # A new file's directory entry must be durable too.
        fsync_dir(path.parent)
    return size + len(data)


def replace_file(target: Path, data: bytes, *, durable: bool) -> None:
    """Replace `target` with `data` whole: a temp file beside it, fsynced, renamed over it.

    The temp file is always fsynced, so a crash never leaves an empty file behind the
    rename; `durable` adds the directory fsync that makes the rename itself survive."""
    fd, tmp = temp_beside(target, data)
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


# A temp file is made as mkstemp makes one (a new random name, readable by its owner
# only, never through a link) without mkstemp's setup on every call: a batch of freezes
# makes one per rollout.
_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_TRIES = 100


def temp_name(target: Path | str) -> str:
    """A new random hidden name for a temp file beside `target` (a path)."""
    head, name = os.path.split(os.fspath(target))
    return os.path.join(head, f".{name}.{os.urandom(6).hex()}.tmp")


def temp_beside(target: Path, data: bytes) -> tuple[int, str]:
    """A new hidden temp file beside `target` holding `data`, not yet fsynced: its open
    descriptor and its path (see `replace_file`)."""
    for _ in range(_TEMP_TRIES):
        tmp = temp_name(target)
        try:
            fd = os.open(tmp, _TEMP_FLAGS, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, f"no free temp file name beside {target} after {_TEMP_TRIES} tries")
    return fill_temp(fd, tmp, data)


def fill_temp(fd: int, tmp: str, data: bytes) -> tuple[int, str]:
    """Write `data` into the new temp file `tmp` open as `fd`; on failure close and
    remove it. Returns (fd, tmp)."""
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp


def touch(rollout_id: str, path: Path) -> None:
    os.close(open_capture(rollout_id, path, os.O_WRONLY | os.O_CREAT))


def unlink_all(paths: Iterable[Path]) -> None:
    """Unlink each path that exists; callers fsync the directory afterwards.

    Unlinking removes the directory entry itself, never what a link points to."""
    for path in paths:
        path.unlink(missing_ok=True)


def exists(path: Path) -> bool:
    # lstat: an entry is there even when it is a link to nothing (freezing masks it).
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


# -- rollout ids: the stem of every file name ------------------------------------------

_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
# The longest name a file system takes (NAME_MAX on Linux's ext4, xfs, btrfs, tmpfs).
NAME_MAX_BYTES = 255
# The longest name raycap derives from an id: a temp file beside the id's longest file name.
_LONGEST_SUFFIX = max((*NAMED_SUFFIXES, LOCK, COMMIT, RECORD), key=len)
_HEAD, _RANDOM, _TAIL = os.path.basename(temp_name("<id>" + _LONGEST_SUFFIX)).rsplit(".", 2)
LONGEST_DERIVED_NAME = f"{_HEAD}.{'X' * len(_RANDOM)}.{_TAIL}"
# A longer id passes the charset and fails later, mid-write, on a temp file (ENAMETOOLONG,
# with some of the rollout's files made): it is refused up front instead. Ids are ASCII,
# so characters are bytes.
MAX_ROLLOUT_ID_LENGTH = NAME_MAX_BYTES - (len(LONGEST_DERIVED_NAME) - len("<id>"))

def validate_rollout_id(rollout_id: str) -> str:
    """Return `rollout_id` if it is a valid file-name stem, else raise ValueError.

    Beyond the charset, an id made only of dots is refused: `.` and `..` name the
    directory itself or its parent, so a path built from them would leave the directory.
    So is an id longer than MAX_ROLLOUT_ID_LENGTH, whose longest derived file name
    would pass the file system's name limit.
    Non-string ids (int, bytes, None) are invalid ids too, with the same ValueError."""
    if not isinstance(rollout_id, str):
        raise ValueError(  # noqa: TRY004 - an invalid id is a ValueError wherever ids are judged
            f"Invalid rollout id: {rollout_id!r}; a rollout id must be a str, not "
            f"{type(rollout_id).__name__}; pass ids as strings"
        )
    if not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise ValueError(
            f"Invalid rollout id: {rollout_id!r}; a rollout id must be non-empty and use only "
            "ASCII letters, digits, '.', '_' and '-'; rename the rollout"
        )
    if not rollout_id.strip(".") or os.path.normpath(rollout_id) != rollout_id:
        raise ValueError(
            f"Invalid rollout id: {rollout_id!r}; an id made only of dots names a directory, not a "
            "file inside one; rename the rollout"
        )
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise ValueError(
            f"Invalid rollout id: {rollout_id[:40]!r}... ({len(rollout_id)} characters); a rollout id may have at "
            f"most {MAX_ROLLOUT_ID_LENGTH}, so that the longest file name raycap derives from it "
            f"({LONGEST_DERIVED_NAME}) fits the file system's {NAME_MAX_BYTES}-byte name limit; "
            "shorten the rollout id"
        )
    return rollout_id


def is_valid_rollout_id(rollout_id: Any) -> bool:
    """Whether `validate_rollout_id` accepts `rollout_id`."""
    try:
        validate_rollout_id(rollout_id)
    except ValueError:
        return False
    return True


# -- rollouts found by name -------------------------------------------------------------

# The ids raycap takes from file names it finds by itself (listings, watches, rebuilds or
# streams over every rollout): NeMo Gym's correlation rule (ROLLOUT_ID_PATTERN, SPEC
# 10.5), a letter or digit first. A hidden name (`.R...`: a copy in flight under a
# temporary name, as cp, rsync and sync tools leave for a moment) is never a rollout. Ids
# a caller names keep `validate_rollout_id`'s rule.
_DISCOVERED_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def is_discoverable_rollout_id(stem: Any) -> bool:
    """Whether `stem`, taken from a file name raycap found, names a rollout."""
    return isinstance(stem, str) and _DISCOVERED_ID_RE.fullmatch(stem) is not None and is_valid_rollout_id(stem)


def rollout_of_name(name: str, suffixes: Sequence[str] = NAMED_SUFFIXES) -> tuple[str, str] | None:
    """The rollout id and suffix of the capture file or marker called `name` (one of
    `suffixes`), or None when it is none or its stem fails the discovery rule: the one
    place a file name found in a directory becomes a rollout id."""
    for suffix in suffixes:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return (stem, suffix) if is_discoverable_rollout_id(stem) else None
    return None


# -- listing by name ---------------------------------------------------------------------


def scan(directory: Path, also: Sequence[str] = (), seen: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Every rollout with a capture file or a marker, each with its suffixes present: one
    pass over the directory's names, keeping only those `rollout_of_name` accepts. The
    rollouts with a file of another suffix of `also` go into `seen` in the same pass."""
    found: dict[str, set[str]] = {}
    with os.scandir(directory) as entries:
        for item in entries:
            named = rollout_of_name(item.name)
            if named is not None:
                found.setdefault(named[0], set()).add(named[1])
            elif also and seen is not None:
                named = rollout_of_name(item.name, also)
                if named is not None:
                    seen.setdefault(named[0], set()).add(named[1])
    return found


def retired_by_names(present: set[str]) -> bool | None:
    """Retired, not retired, or None when only the state can tell (see `raycap.capture.store`)."""
    files = present - {RETIRED}
    if RETIRED in present and files == TOMBSTONE_ONLY:
        return True
    if RETIRED in present or files == TOMBSTONE_ONLY:
        return None
    return False


def listed_ids(
    directory: Path, found: dict[str, set[str]], is_retired: Callable[[str], bool], *, skip_retired: bool
) -> list[str]:
    """Sorted ids of the rollouts that have capture files, from `scan`'s names.

    A rollout is listed when it has a JSONL, state, intents or incomplete file; that
    includes retired tombstones (freezing one reports "retired", which is what a
    consumer of that id must hear) unless `skip_retired`, for callers that rebuild a
    directory again after an earlier run consumed part of it. A rollout with only its
    lock file (and maybe a retired marker) left is not listed: `delete` cleared it for
    re-dispatch, and freezing it would refuse the new attempt's writes.

    Nothing is stat'ed or opened, except with `skip_retired` the state of the rare
    rollouts that names cannot settle (`is_retired`). No sizes come back: on Linux the
    directory listing does not carry them; `held_ids` returns them for the ids that
    need them."""
    ids = sorted(r for r, present in found.items() if not present <= {RETIRED})
    if not skip_retired:
        return ids
    kept = []
    reads = 0
    for rollout_id in ids:
        retired = retired_by_names(found[rollout_id])
        if retired is None:
            reads += 1
            retired = is_retired(rollout_id)
        if not retired:
            kept.append(rollout_id)
    if reads:
        logger.debug(
            "%s: %d of %d listed rollouts needed a state read to tell whether they are retired",
            directory, reads, len(ids),
        )
    return kept


def held_ids(
    directory: Path,
    ids: Sequence[str],
    paths: Sequence[Any],
    is_retired: Callable[[str], bool],
    *,
    skip_retired: bool,
) -> dict[str, int]:
    """Of `ids` (valid, without repeats; `paths` their CapturePaths), the ones listed by
    `listed_ids`'s rule, each with its JSONL size in bytes (0 without one).

    Costs a few stats per given id, never a directory listing; ids come back in the
    order given."""
    if not ids:
        return {}
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"capture directory {directory} does not exist; check the path")
    out: dict[str, int] = {}
    for rollout_id, where in zip(ids, paths):
        try:
            size = os.lstat(where.jsonl).st_size
            present = {JSONL}
        except FileNotFoundError:
            size = 0
            present = set()
        if exists(where.state):
            present.add(STATE)
        if not present or (skip_retired and present == TOMBSTONE_ONLY):
            # Only here does it matter whether there is more than a state.
            for suffix, path in ((INTENTS, where.intents), (INCOMPLETE, where.incomplete)):
                if exists(path):
                    present.add(suffix)
        if not present:
            continue
        if skip_retired and STATE in present:
            if exists(where.retired):
                present.add(RETIRED)
            retired = retired_by_names(present)
            if retired is None:
                retired = is_retired(rollout_id)
            if retired:
                continue
        out[rollout_id] = size
    return out
