"""One rollout's files in a capture directory: their paths, its lock, its state file and
the entry index.

`RolloutFiles` is the part of the store (`raycap.capture.store`) that every operation goes
through, whatever it then does (write, freeze, drop, sweep): the rollout's file paths
(each the string name "<id><suffix>" inside the directory, the id validated first), its
`fcntl.flock` (exclusive for changes, shared for pure reads, on a lock file whose inode
is checked after waiting, so a sweep that unlinked it cannot split the callers), the
state file (read as untrusted JSON; replaced whole, durably for lifecycle transitions),
and the entry index, which is rebuilt from the JSONL's unindexed tail: a writer that died
between its line and its state update, or one that keeps no index, loses nothing. A torn
final line was never acknowledged and is cut off, through a descriptor of the checked
inode; an invalid line with content after it is corruption and is reported, never
skipped. Every file is opened through `raycap.capture.files`: never through a link, never
blocking on a FIFO.

This module does not import Ray.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from raycap.capture.files import (
    INCOMPLETE,
    INTENTS,
    JSONL,
    LOCK,
    RETIRED,
    STATE,
    CaptureTooLarge,
    append_durably,
    exists,
    located,
    open_capture,
    open_existing,
    read_at,
    read_whole,
    replace_file,
    unlink_all,
    validate_rollout_id,
    write_all,
)
from raycap.capture.records import line_digest, loads_line, parse_entries, parse_lines, parse_record
from raycap.capture.untrusted import UntrustedJSONError, bounded, loads_untrusted

logger = logging.getLogger(__name__)


# The largest capture a rollout may have before it is a masked row instead of being
# read: a capture is parsed in memory, so this bounds a builder's memory; 1 GiB leaves
# a 24 GiB node room for several builders at once.
MAX_CAPTURE_BYTES = 1 << 30

def retired_text(rollout_id: str) -> str:
    """Why a retired rollout cannot be frozen, in NeMo Gym's words: finalized records
    carry it as their error and are aggregated by it, so it is Gym's text exactly."""
    return f"Token capture for rollout {rollout_id} is retired"


class CapturePaths(NamedTuple):
    """The files of one rollout: the spec's five, then the retired marker."""

    jsonl: Path
    state: Path
    lock: Path
    intents: Path
    incomplete: Path
    retired: Path


@dataclass(frozen=True)
class FrozenCapture:
    """A freeze as raw bytes: the indexed JSONL content read under the lock, not parsed.

    `size` is the length of the frozen JSONL prefix. A freeze made with `read=False`
    carries no data; `read_frozen` reads the same bytes later, because after a freeze
    no append can succeed and the prefix never changes."""

    rollout_id: str
    snapshot_id: str
    version: int
    incomplete: bool
    data: bytes
    size: int = -1
    # The records of `data` when the freeze parsed them already (indexing a capture no
    # writer had indexed), for a build in this process to take once instead of parsing
    # the same bytes again (`take_parsed`). Never pickled: elsewhere `data` is parsed.
    parsed: list = field(default_factory=list, compare=False, repr=False)

    def take_parsed(self) -> list:
        """The records parsed while freezing ([] when there are none, or were taken)."""
        taken = list(self.parsed)
        self.parsed.clear()
        return taken

    def __reduce__(self) -> tuple:
        return FrozenCapture, (self.rollout_id, self.snapshot_id, self.version, self.incomplete, self.data, self.size)


@dataclass(frozen=True)
class Lifecycle:
    """A rollout's lifecycle flags and current snapshot identity."""

    frozen: bool
    retired: bool
    snapshot_id: str
    version: int


@dataclass
class _State:
    """The state file of one rollout; unknown keys written by other writers are kept."""

    frozen: bool = False
    retired: bool = False
    incomplete: bool = False
    snapshot_id: str = ""
    version: int = 0
    entry_digests: dict[str, str] = field(default_factory=dict)
    indexed_size: int = 0
    # False when a state file carries no entry index (written by a writer that kept none):
    # the index is then built from the whole JSONL without version bumps. A missing state
    # file is an empty index, so its lines are recovered with bumps.
    has_index: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> _State:
        digests = raw.get("entry_digests")
        size = raw.get("indexed_size")
        size_ok = isinstance(size, int) and not isinstance(size, bool)
        known = {"frozen", "retired", "incomplete", "snapshot_id", "version", "entry_digests", "indexed_size"}
        return cls(
            frozen=bool(raw.get("frozen", False)),
            retired=bool(raw.get("retired", False)),
            incomplete=bool(raw.get("incomplete", False)),
            snapshot_id=str(raw.get("snapshot_id") or ""),
            version=int(raw.get("version") or 0),
            entry_digests=dict(digests) if isinstance(digests, dict) else {},
            indexed_size=size if size_ok else 0,
            has_index=isinstance(digests, dict) and size_ok,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_json(self) -> bytes:
        state = {
            **self.extra,
            "frozen": self.frozen,
            "retired": self.retired,
            "incomplete": self.incomplete,
            "snapshot_id": self.snapshot_id,
            "version": self.version,
            "entry_digests": self.entry_digests,
            "indexed_size": self.indexed_size,
        }
        return json.dumps(state, sort_keys=True).encode()


def _load_line(line: bytes) -> tuple[Any, json.JSONDecodeError | None]:
    """The parsed line and None, or None and the JSON error `loads_line` raised."""
    try:
        return loads_line(line), None
    except json.JSONDecodeError as exc:
        return None, exc


class RolloutFiles:
    """The per-rollout files of one capture directory (see the module docstring);
    `raycap.capture.store.TokenCaptureStore` builds its operations on these."""

    def __init__(
        self, root: str | os.PathLike, *, create: bool = True, max_capture_bytes: int | None = MAX_CAPTURE_BYTES
    ) -> None:
        if max_capture_bytes is not None and (not isinstance(max_capture_bytes, int) or max_capture_bytes < 1):
            raise ValueError(f"max_capture_bytes must be None or an int of at least 1, not {max_capture_bytes!r}")
        self.directory, self.max_capture_bytes = Path(root), max_capture_bytes
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"TokenCaptureStore({str(self.directory)!r})"

    # -- files and locks ------------------------------------------------------------------

    def paths(self, rollout_id: str) -> CapturePaths:
        """The file paths of a rollout (validates the id).

        Each is the string name "<id><suffix>" joined to the directory, as the format
        says; joining the id first and then adding the suffix would let `Path` collapse
        an id like `.` into the directory's own name."""
        stem = validate_rollout_id(rollout_id)
        suffixes = (JSONL, STATE, LOCK, INTENTS, INCOMPLETE, RETIRED)
        return CapturePaths(*(self.directory / (stem + suffix) for suffix in suffixes))

    @contextmanager
    def _locked(self, paths: CapturePaths, *, shared: bool = False) -> Iterator[None]:
        """Hold the rollout's lock: exclusive for changes, shared for pure reads."""
        fd = self._lock(paths, shared=shared, wait=True)
        assert fd is not None  # a waiting lock is always taken
        try:
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _lock(self, paths: CapturePaths, *, shared: bool = False, wait: bool = True) -> int | None:
        """The descriptor holding the rollout's lock (closing it releases the lock); with
        wait=False, None at once when another holder has it."""
        while True:
            try:
                fd = open_capture(paths.lock.name[: -len(LOCK)], paths.lock, os.O_RDWR | os.O_CREAT)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"capture directory {self.directory} does not exist; create it, or open the "
                    "store with create=True"
                ) from None
            try:
                mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
                try:
                    fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None
                # The sweep may unlink the lock file while we wait for it; a lock on the
                # unlinked inode would not exclude callers that open the new file.
                opened = os.fstat(fd)
                try:
                    current = os.lstat(paths.lock)
                except FileNotFoundError:
                    current = None
            except BaseException:
                os.close(fd)
                raise
            if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                return fd
            os.close(fd)

    def _clear_lone_markers(self, found: dict[str, set[str]], own_suffixes: tuple[str, ...]) -> dict[str, set[str]]:
        """Remove, with its lock and under it, the retired marker of each rollout of
        `found` (a scan) that has no other file: NeMo Gym's sweep removes every file of a
        retired rollout but raycap's marker, which would otherwise stay, one empty file
        per rollout. A writer that dispatched the id again meanwhile left a file (of the
        spec's or with one of raycap's `own_suffixes`), and then nothing is removed.
        Never raises (a read-only directory keeps its markers); returns `found`."""
        for rollout_id in [r for r, present in found.items() if present == {RETIRED}]:
            paths = self.paths(rollout_id)
            others = [self.directory / (rollout_id + suffix) for suffix in own_suffixes]
            try:
                with self._locked(paths):
                    if not any(exists(p) for p in (paths.state, paths.jsonl, paths.intents, paths.incomplete, *others)):
                        unlink_all((paths.retired, paths.lock))
            except OSError as exc:
                logger.debug("%s: left the lone retired marker of %r (%s)", self.directory, rollout_id, exc)
        return found

    def _read_state(self, rollout_id: str, paths: CapturePaths) -> _State:
        raw_bytes = read_whole(rollout_id, paths.state)
        if raw_bytes is None:
            # A missing state file is an empty index: every line found is recovered.
            return _State(has_index=True)
        advice = (
            "it is only ever replaced atomically, so it was damaged from outside: inspect it, or "
            "delete() the rollout to clear its capture"
        )
        try:
            raw = loads_untrusted(raw_bytes, "its text")
        except UntrustedJSONError as exc:
            # A plain JSONDecodeError: rows name the kind of a failure by its type's name.
            raise located(rollout_id, paths.state, json.JSONDecodeError(
                f"state file {paths.state.name} of rollout {rollout_id!r} is not valid JSON ({exc}); {advice}",
                raw_bytes.decode("utf-8", "replace"),
                getattr(exc, "pos", 0) or 0,
            )) from None
        if not isinstance(raw, dict):
            raise located(rollout_id, paths.state, ValueError(
                f"state file {paths.state.name} of rollout {rollout_id!r} is not a JSON object; {advice}"
            ))
        try:
            return _State.from_json(raw)
        except (ValueError, TypeError, OverflowError) as exc:
            raise located(rollout_id, paths.state, ValueError(
                f"state file {paths.state.name} of rollout {rollout_id!r} holds a value of the wrong type "
                f"({type(exc).__name__}: {bounded(exc)}); {advice}"
            )) from None

    def _write_state(self, paths: CapturePaths, state: _State, *, durable: bool) -> None:
        # Lifecycle transitions (freeze, mark, drop) need their rename to survive a crash;
        # index updates do not: the index is rebuilt from the JSONL.
        replace_file(paths.state, state.to_json(), durable=durable)

    def _mark_incomplete_locked(self, paths: CapturePaths, state: _State, model_call_id: str) -> None:
        state.incomplete = True
        state.version += 1
        self._write_state(paths, state, durable=True)
        append_durably(paths.state.name[: -len(STATE)], paths.incomplete, model_call_id.encode() + b"\n")

    def _refuse_if_retired(self, rollout_id: str, state: _State, action: str | None = None) -> None:
        """Refuse a retired rollout: a freeze with NeMo Gym's exact text (`retired_text`),
        which finalized records carry; a writer with the way out after it."""
        if state.retired:
            if action is None:
                raise RuntimeError(retired_text(rollout_id))
            raise RuntimeError(
                f"{retired_text(rollout_id)}: its snapshot was consumed and dropped, so it cannot "
                f"{action}; re-dispatch under a fresh rollout id, or delete() the rollout first"
            )

    def _refuse_if_frozen(self, rollout_id: str, state: _State, action: str) -> None:
        if state.frozen:
            raise RuntimeError(
                f"token capture of rollout {rollout_id!r} is already frozen (snapshot "
                f"{state.snapshot_id}), so it cannot {action}: a write after the freeze would "
                "be missing from the consumed snapshot; re-dispatch under a fresh rollout id"
            )

    # -- index sync -----------------------------------------------------------------------

    def _sync_index(
        self,
        rollout_id: str,
        paths: CapturePaths,
        state: _State,
        jsonl: int | None,
        parsed: list | None = None,
        *,
        tail: bytes | None = None,
    ) -> bool:
        """Index the JSONL bytes past `state.indexed_size`; True when the state changed.

        `jsonl` is the JSONL opened by `open_capture` (None when there is none): the
        size, the tail and any repair all go through that checked descriptor's inode.
        A writer fsyncs its line before it updates the state, so a writer that stopped in
        between (or one that keeps no index) leaves an unindexed tail. Only that tail is
        parsed: appends never re-read earlier token arrays. With `parsed` (a list), the
        tail is parsed as a capture reader parses it (`parse_lines`) and its records are
        added to the list, for a freeze to hand to its build; a tail with a bad line is
        then judged line by line, as always. `tail` is the unindexed bytes when the caller
        has read them already (what it read is what is indexed).
        """
        if tail is not None:
            file_size = state.indexed_size + len(tail)
        else:
            file_size = 0 if jsonl is None else os.fstat(jsonl).st_size
        if state.indexed_size > file_size:
            raise located(rollout_id, paths.jsonl, ValueError(
                f"{paths.jsonl.name} of rollout {rollout_id!r} is shorter than its index "
                f"({file_size} bytes, {state.indexed_size} indexed): the file was truncated or "
                "replaced outside the store; inspect it, or delete() the rollout to clear it"
            ))
        if state.indexed_size == file_size:
            if state.has_index:
                return False
            state.has_index = True
            return True

        digests = dict(state.entry_digests)
        recovered = 0
        assert jsonl is not None  # file_size > indexed_size >= 0
        if tail is None:
            tail = read_at(jsonl, file_size - state.indexed_size, state.indexed_size)
        position = 0
        last_line_unterminated = False
        if parsed is not None:
            try:
                spans, records = parse_lines(tail, prompt_lists=False)
            except Exception:  # noqa: BLE001 - a bad line: found again, and judged, line by line below
                pass
            else:
                position = len(tail)  # every line is a valid record: no line-by-line pass
                for (start, end), (entry, _) in zip(spans, records):
                    self._index_line(rollout_id, paths, state, digests, entry.model_call_id, tail[start:end].strip())
                recovered = len(records)
                last_line_unterminated = bool(spans) and spans[-1][1] == len(tail)
                parsed.extend(records)
        while position < len(tail):
            newline = tail.find(b"\n", position)
            end = len(tail) if newline == -1 else newline
            line = tail[position:end].strip()
            if line:
                record, error = _load_line(line)
                if error is not None:
                    offset = state.indexed_size + position
                    if tail[end + 1 :].strip():
                        # The error is the JSON parser's own, as a record carries it; where
                        # the line is goes to the log, not into the training data.
                        logger.warning(
                            "rollout %s: corrupt line at byte %d of %s, followed by more lines, so it is "
                            "not a torn final write; inspect the file or delete() the rollout: %s",
                            rollout_id, offset, paths.jsonl, error,
                        )
                        raise error
                    # A torn final line was never acknowledged to its writer: cut it off
                    # so the next line starts clean.
                    self._repair(rollout_id, paths, jsonl, lambda fd, at=offset: os.ftruncate(fd, at))
                    logger.warning(
                        "rollout %r: dropped a torn final line (%d bytes at byte %d) from %s",
                        rollout_id, len(tail) - position, offset, paths.jsonl,
                    )
                    file_size = offset
                    break
                # Recovered lines are records like any other: one that fails
                # validation stops here, in file order, with pydantic's error.
                key = parse_record(line, prompt_lists=False)[0].model_call_id
                self._index_line(rollout_id, paths, state, digests, key, line)
                recovered += 1
                last_line_unterminated = newline == -1
            position = end + 1
        if last_line_unterminated:
            # A complete last line without its newline: terminate it so the next
            # append starts a fresh line.
            self._repair(rollout_id, paths, jsonl, lambda fd: write_all(fd, b"\n"), append=True)
            file_size += 1

        if state.has_index:
            state.version += recovered
        state.entry_digests = digests
        state.indexed_size = file_size
        state.has_index = True
        return True

    def _index_line(
        self, rollout_id: str, paths: CapturePaths, state: _State, digests: dict[str, str], key: str, line: bytes
    ) -> None:
        """Add one recovered line's digest under its call id; a different payload already
        indexed under that id marks the rollout incomplete and raises."""
        digest = line_digest(line)
        existing = digests.get(key)
        if existing is not None and existing != digest:
            self._mark_incomplete_locked(paths, state, key)
            raise located(rollout_id, paths.jsonl, ValueError(
                f"model_call_id {key!r} of rollout {rollout_id!r} has conflicting "
                f"durable payloads in {paths.jsonl.name}; the rollout is marked incomplete "
                "and will be masked; give every model call a fresh id"
            ))
        digests[key] = digest

    @staticmethod
    def _repair(
        rollout_id: str, paths: CapturePaths, opened: int, change: Any, *, append: bool = False
    ) -> None:
        """Apply `change` to the JSONL through a writable descriptor of the same inode as
        `opened`, then fsync. Reads never need write access, so the descriptor for a
        repair is opened only here; it is checked like the first one and must be the
        same file, so nothing is ever written through a link or to a swapped-in entry."""
        fd = open_capture(rollout_id, paths.jsonl, os.O_WRONLY | (os.O_APPEND if append else 0))
        try:
            now, before = os.fstat(fd), os.fstat(opened)
            if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
                raise located(rollout_id, paths.jsonl, RuntimeError(
                    f"{paths.jsonl.name} of rollout {rollout_id!r} was replaced while it was being indexed, "
                    "under the rollout's lock: another program writes it without the lock; stop it"
                ))
            change(fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_entries_unlocked(
        self, rollout_id: str, *, size: int | None = None, raw: bool = False, jsonl: int | None = None
    ) -> Any:
        """The rollout's records in file order, read from the start of its JSONL ([] when
        there is none), by a caller that holds the rollout's lock.

        Every full read of a rollout's JSONL comes here (a freeze, `read_frozen`,
        `read_entries`), so that patching this method proves a path never rescans. An
        append does not come here: it parses only the tail its index does not cover
        (`_sync_index`), so its cost does not grow with the rollout. `size` reads only
        that many bytes (the prefix a freeze covers); with `raw` the bytes come back
        unparsed, for readers that parse them elsewhere; `jsonl` is the JSONL when the
        caller has it open already (`_jsonl`)."""
        if jsonl is None:
            with self._jsonl(rollout_id, self.paths(rollout_id)) as opened:
                data = b"" if opened is None else read_at(opened, -1 if size is None else size)
        else:
            data = read_at(jsonl, -1 if size is None else size)
        return data if raw else parse_entries(data)

    @contextmanager
    def _jsonl(self, rollout_id: str, paths: CapturePaths, *, limit: int | None = None) -> Iterator[int | None]:
        """The rollout's JSONL opened read-only and checked (None when there is none).

        With `limit`, a file larger than that many bytes raises CaptureTooLarge before
        a byte of it is read."""
        fd = open_existing(rollout_id, paths.jsonl)
        try:
            if fd is not None and limit is not None:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise located(rollout_id, paths.jsonl, CaptureTooLarge(
                        f"rollout {rollout_id!r}: capture file {paths.jsonl.name} is {size} bytes, more than "
                        f"max_capture_bytes={limit}; raise max_capture_bytes (the rebuild keyword or job "
                        "config key) to build it"
                    ))
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

