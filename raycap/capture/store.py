"""The capture directory: one flat directory of per-rollout files, shared with other writers.

- For rollout id R: `R.tokens.jsonl`, `R.tokens.state.json`, `R.tokens.lock`,
  `R.tokens.intents` and `R.tokens.incomplete`; raycap adds `R.tokens.retired`, and a
  stream's `R.tokens.commit` and `R.tokens.record.json` (`raycap.capture.streamfiles`).
- An invalid id is refused with ValueError before the file system is touched (ASCII
  letters, digits, `.`, `_`, `-`; not only dots; at most 218 characters). Capture files
  must be regular files (`raycap.capture.files`).
- `TokenCaptureStore` is the directory's TokenSink and TokenSource, with Gym's names:
  coroutines (`put`, `freeze`, `drop`, ...) and synchronous forms (`append`,
  `freeze_now`, `drop_now`, ...).
- Every operation holds the rollout's lock; lines are fsynced before `append` returns;
  a torn last line is cut off, corruption before it reported, never skipped.
- `append` refuses a capture over `max_capture_bytes` (CaptureTooLarge); a reused call
  id with another payload marks the rollout incomplete and raises.
- `drop` retires exactly the consumed snapshot, tombstone first; `sweep_retired` removes
  old tombstones; `delete` clears a rollout. `rollout_ids` lists in one pass.

Shared machinery: `raycap.capture.rolloutfiles`. In full: docs/gym-api.md ("The capture
directory, file by file"). No Ray.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from raycap.capture.config import token_id_capture_config
from raycap.capture.files import (
    RETIRED,
    TOMBSTONE_ONLY,
    CaptureFileError,
    CaptureTooLarge,
    append_durably,
    fsync_dir,
    held_ids,
    is_valid_rollout_id,
    kind_of,
    listed_ids,
    located,
    not_regular,
    read_at,
    read_whole,
    scan,
    touch,
    unlink_all,
    validate_rollout_id,
)
from raycap.capture.freezebatch import Freezing, freeze_batch, freezing
from raycap.capture.markers import COMMIT, CommitMarker
from raycap.capture.protocols import TokenCaptureSnapshot
from raycap.capture.recordfile import RECORD
from raycap.capture.records import TokenEntry, entry_line, line_digest
from raycap.capture.rolloutfiles import CapturePaths, FrozenCapture, Lifecycle, _State
from raycap.capture.spares import Spares, remove_stale
from raycap.capture.streamfiles import StreamFiles

# Part of this module's API: importers of the store's names find them here.
__all__ = [
    "CaptureFileError",
    "CapturePaths",
    "CaptureTooLarge",
    "CommitMarker",
    "FrozenCapture",
    "Lifecycle",
    "TokenCaptureStore",
    "is_valid_rollout_id",
    "make_token_store",
    "validate_rollout_id",
]

logger = logging.getLogger(__name__)


def _validate_call_id(rollout_id: str, model_call_id: str) -> str:
    # Intents and incomplete markers are one id per line: a newline would split an id.
    if not isinstance(model_call_id, str) or "\n" in model_call_id or "\r" in model_call_id:
        raise ValueError(
            f"invalid model_call_id {model_call_id!r} for rollout {rollout_id!r}: "
            "it must be a string without line breaks"
        )
    return model_call_id


async def off_loop(function: Any, /, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` on a worker thread, awaited (asyncio.to_thread).
    asyncio is imported here, by the first async caller: a process that never awaits
    (a finalize, a build task) skips its 20 ms import."""
    import asyncio

    return await asyncio.to_thread(function, *args, **kwargs)


class TokenCaptureStore(StreamFiles):
    """The capture directory of section 2 of the spec: durable, rollout-keyed JSONL."""

    # -- writer operations ----------------------------------------------------------------

    def append(self, entry: TokenEntry) -> None:
        """Append one record durably; an identical re-append is a no-op."""
        rollout_id = validate_rollout_id(entry.rollout_id)
        paths = self.paths(rollout_id)
        line = entry_line(entry)
        digest = line_digest(line)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            self._refuse_if_retired(rollout_id, state, "accept entries")
            self._refuse_if_frozen(rollout_id, state, "accept entries")
            with self._jsonl(rollout_id, paths) as jsonl:
                size = 0 if jsonl is None else os.fstat(jsonl).st_size
                grown = size + len(line) + 1 + (size > 0 and os.pread(jsonl, 1, size - 1) != b"\n")
                if self.max_capture_bytes is not None and grown > self.max_capture_bytes:
                    raise CaptureTooLarge(
                        f"rollout {rollout_id!r}: a record of {len(line)} bytes would take capture file {paths.jsonl} "
                        f"to {grown} bytes, over max_capture_bytes={self.max_capture_bytes}; nothing was written (raise "
                        "the store's max_capture_bytes, and the rebuild's, to capture more)"
                    )
                changed = self._sync_index(rollout_id, paths, state, jsonl)
            existing = state.entry_digests.get(entry.model_call_id)
            if existing == digest:
                if changed:
                    self._write_state(paths, state, durable=False)
                return
            if existing is not None:
                self._mark_incomplete_locked(paths, state, entry.model_call_id)
                raise ValueError(
                    f"model_call_id {entry.model_call_id!r} of rollout {rollout_id!r} was reused "
                    "with a different payload; the rollout is marked incomplete and will be "
                    "masked; give every model call a fresh id"
                )
            state.indexed_size = append_durably(rollout_id, paths.jsonl, line + b"\n", line_start=True)
            state.entry_digests[entry.model_call_id] = digest
            state.version += 1
            # The fsynced line is the durability guarantee; the index can be rebuilt from it.
            self._write_state(paths, state, durable=False)

    def mark_incomplete_now(self, rollout_id: str, model_call_id: str = "") -> None:
        """Record durably that a call of the rollout failed to capture."""
        paths = self.paths(rollout_id)
        _validate_call_id(rollout_id, model_call_id)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            self._refuse_if_retired(rollout_id, state, "be marked incomplete")
            self._mark_incomplete_locked(paths, state, model_call_id)

    def begin_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Record durably that a call is about to be dispatched (its intent)."""
        paths = self.paths(rollout_id)
        _validate_call_id(rollout_id, model_call_id)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            self._refuse_if_retired(rollout_id, state, "begin calls")
            self._refuse_if_frozen(rollout_id, state, "begin calls")
            append_durably(rollout_id, paths.intents, model_call_id.encode() + b"\n")

    # -- consumer operations --------------------------------------------------------------

    def freeze_many(
        self,
        rollout_ids: list[str],
        *,
        read: bool = True,
        read_below: int = 0,
        max_bytes: int | None = None,
        spares: Spares | None = None,
    ) -> list[FrozenCapture | str]:
        """Freeze several rollouts; a failure is "<Type>: <message>" in its slot; with
        `spares`, files made from spare files (`raycap.capture.spares`).

        Each freeze is as durable when it is returned as `freeze_raw`'s, at a fraction
        of the cost for a batch (a training step freezes dozens of small rollouts): the
        state files are fsynced together and the directory once (`raycap.capture.freezebatch`)."""
        return freeze_batch(self, rollout_ids, read=read, read_below=read_below, max_bytes=max_bytes, spares=spares)

    def freezing(
        self, rollout_ids: list[str], *, read: bool = True, read_below: int = 0, max_bytes: int | None = None,
        spares: Spares | None = None,
    ) -> Freezing:
        """`freeze_many` of at most one chunk of rollouts, in two halves: their freezes
        (and bytes) as soon as they are made under their locks, to be used meanwhile,
        and `Freezing.finish()`, which makes them durable and hands them out. `spares`:
        spare files to make its files from (`raycap.capture.spares`)."""
        return freezing(self, rollout_ids, read=read, read_below=read_below, max_bytes=max_bytes, spares=spares)

    def freeze_raw(
        self,
        rollout_id: str,
        *,
        read: bool = True,
        sync_directory: bool = True,
        read_below: int = 0,
        max_bytes: int | None = None,
    ) -> FrozenCapture:
        """Freeze the rollout (idempotent) and return its indexed JSONL bytes unparsed
        (or, with read=False, only the frozen identity and size; the bytes too when there
        are fewer than `read_below`: a small capture is read under the freeze's lock
        rather than locked and opened again for `read_frozen`).

        sync_directory=False leaves the directory fsync to the caller, which must make it
        before handing the snapshot out (see `freeze_many`).

        With `max_bytes`, a JSONL larger than that raises CaptureTooLarge, judged by the
        opened file's size before any of it is read. Every file of the rollout is checked
        to be a regular file before the state changes: any other kind raises
        CaptureFileError and leaves the rollout as it was."""
        return self._freeze(rollout_id, read, sync_directory, read_below, max_bytes)[0]

    def _freeze(
        self, rollout_id: str, read: bool, sync_directory: bool, read_below: int, max_bytes: int | None, parse: bool = False
    ) -> tuple[FrozenCapture, list[TokenEntry]]:
        """`freeze_raw`; with `parse`, the records too, read under the lock as Gym's freeze reads them."""
        paths = self.paths(rollout_id)
        with self._locked(paths), self._jsonl(rollout_id, paths, limit=max_bytes) as jsonl:
            frozen, state = self._freeze_locked(
                rollout_id, paths, jsonl, read=read and not parse, read_below=0 if parse else read_below
            )
            if state is not None:
                self._write_state(paths, state, durable=sync_directory)
            # The index covers the whole file now.
            entries = self._read_entries_unlocked(rollout_id) if parse else []
            return frozen, entries

    def _freeze_locked(
        self, rollout_id: str, paths: CapturePaths, jsonl: int | None, *, read: bool, read_below: int
    ) -> tuple[FrozenCapture, _State | None]:
        """The freeze of a rollout whose lock the caller holds, with its JSONL opened, and
        the state the caller must write durably before handing the freeze out (None
        when the state file is current already)."""
        state = self._read_state(rollout_id, paths)
        self._refuse_if_retired(rollout_id, state)
        intents = (read_whole(rollout_id, paths.intents) or b"").splitlines()
        for path in (paths.incomplete, paths.retired):
            # Not read by a freeze, but written by other operations: a rollout with a
            # link or a FIFO among its files is masked as a whole, whichever file it is.
            try:
                kind = kind_of(os.lstat(path).st_mode)
            except FileNotFoundError:
                kind = None
            if kind is not None:
                raise not_regular(rollout_id, path, kind)
        # A small capture no writer indexed is parsed whole here anyway: its records go
        # with the freeze, so that a build in this process does not parse it again. It is
        # read once: the bytes parsed are the bytes handed out.
        # Its size is looked at only when a small one may be read (read_below > 0);
        # otherwise the index sync below takes the size itself.
        unindexed = jsonl is not None and not state.indexed_size and read_below > 0
        size = os.fstat(jsonl).st_size if unindexed else 0
        whole = read_at(jsonl, size) if unindexed and size < read_below else None
        parsed: list | None = [] if whole is not None else None
        changed = self._sync_index(rollout_id, paths, state, jsonl, parsed, tail=whole)
        if not state.frozen:
            state.frozen = True
            state.snapshot_id = uuid.uuid4().hex
            state.version += 1
            changed = True
        data = b""
        if whole is not None and len(whole) == state.indexed_size:
            data = whole
        elif state.indexed_size and (read or state.indexed_size < read_below):
            data = self._read_entries_unlocked(rollout_id, size=state.indexed_size, raw=True, jsonl=jsonl)
        # A dispatched call without an entry was lost: the rollout must be masked.
        dangling = any(
            call_id and call_id.decode("utf-8", "replace") not in state.entry_digests
            for call_id in (raw.strip() for raw in intents)
        )
        frozen = FrozenCapture(
            rollout_id=rollout_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            incomplete=state.incomplete or dangling,
            data=data,
            size=state.indexed_size,
            parsed=parsed if parsed and len(data) == state.indexed_size else [],
        )
        return frozen, state if changed else None

    def read_frozen(self, frozen: FrozenCapture) -> bytes:
        """The JSONL bytes of a freeze made with read=False, under the shared lock.

        Raises RuntimeError when the rollout is no longer that snapshot (dropped, deleted
        or re-frozen since): the bytes read would not be the ones frozen."""
        paths = self.paths(frozen.rollout_id)
        with self._locked(paths, shared=True):
            state = self._read_state(frozen.rollout_id, paths)
            if not state.frozen or state.retired or state.snapshot_id != frozen.snapshot_id:
                raise located(frozen.rollout_id, self.directory, RuntimeError(
                    f"rollout {frozen.rollout_id!r} is no longer snapshot "
                    f"{frozen.snapshot_id} (dropped, deleted or cleared since it was frozen); rebuild it"
                ))
            if not frozen.size:
                return b""
            data = self._read_entries_unlocked(frozen.rollout_id, size=frozen.size, raw=True)
            if len(data) != frozen.size:
                raise located(frozen.rollout_id, paths.jsonl, RuntimeError(
                    f"{paths.jsonl.name} of rollout {frozen.rollout_id!r} is shorter than when it was "
                    "frozen: it was truncated outside the store; inspect it, or delete() the rollout"
                ))
            return data

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze the rollout and return its validated records in file order. A record that fails validation raises pydantic's ValidationError; it is never
        skipped, because a missing call would make a wrong trajectory look right.
        """
        frozen, entries = self._freeze(rollout_id, False, True, 0, None, parse=True)
        return TokenCaptureSnapshot(
            rollout_id=frozen.rollout_id,
            entries=tuple(entries),
            incomplete=frozen.incomplete,
            snapshot_id=frozen.snapshot_id,
            version=frozen.version,
        )

    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly the consumed snapshot; False if it is not the current one.

        The JSONL, intents and incomplete files go; a retired tombstone state stays, so a
        late writer of the consumed attempt is still refused, with the retired marker
        that lets listing skip it by name. The tombstone is durable before any file goes,
        so a crash leaves a retired rollout with leftover files, which dropping the same
        snapshot again (or the sweep) removes.
        """
        paths = self.paths(rollout_id)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            if not state.frozen or state.snapshot_id != snapshot_id or state.version != version:
                return False
            # Before the state: a marker is trusted unread only beside a state alone, and a
            # frozen rollout that still has data has more than that (see the module docstring).
            touch(rollout_id, paths.retired)
            if not state.retired:
                state.retired = True
                state.indexed_size = 0
                state.entry_digests = {}
                self._write_state(paths, state, durable=True)
            # The commit marker last: while it is there, a crash before the drop finished
            # still tells the next stream that this snapshot was committed.
            unlink_all((
                paths.jsonl, paths.incomplete, paths.intents, self.record_path(rollout_id),
                self.commit_path(rollout_id),
            ))
            fsync_dir(self.directory)
            return True

    def delete(self, rollout_id: str) -> None:
        """Remove every file of the rollout except its lock (idempotent).

        Administrative: clears stale captures before a rollout id is dispatched again.
        The lock stays so concurrent callers keep locking the same inode.
        """
        paths = self.paths(rollout_id)
        with self._locked(paths):
            # The marker first, so a crash cannot leave it to the next attempt's state.
            unlink_all((
                paths.retired, paths.jsonl, paths.state, paths.intents, paths.incomplete,
                self.record_path(rollout_id), self.commit_path(rollout_id),
            ))
            fsync_dir(self.directory)

    def lifecycle(self, rollout_id: str) -> Lifecycle:
        """Where the rollout stands, from its state file alone: one small read, no lock
        (the state file is only ever replaced whole)."""
        state = self._read_state(rollout_id, self.paths(rollout_id))
        return Lifecycle(state.frozen, state.retired, state.snapshot_id, state.version)

    def sweep_retired(self, older_than_seconds: float) -> int:
        """Remove retired tombstones whose state file is older than the cutoff; return the count.

        Removes the state, lock and retired marker, and any JSONL, intents or incomplete
        file an interrupted drop left. The caller picks the retention: it must outlast any
        late writer of a consumed attempt, which a removed tombstone can no longer refuse.

        Candidates come from one pass over names: rollouts with a retired marker, and
        rollouts with only a state file (tombstones of writers that leave no marker). Each
        is confirmed under its lock by the state file's age and its retired flag. A marker
        that turns out stale (no state, or a state that is not retired) is removed so that
        listing need not read that state again. Spare files older than the cutoff, left
        by a trainer that was killed (`raycap.capture.spares`), are removed too.
        """
        cutoff = time.time() - older_than_seconds
        removed = 0
        changed = False
        for rollout_id, present in sorted(scan(self.directory).items()):
            if RETIRED not in present and present != TOMBSTONE_ONLY:
                continue
            paths = self.paths(rollout_id)
            with self._locked(paths):
                try:
                    young = os.lstat(paths.state).st_mtime > cutoff
                except FileNotFoundError:
                    # No state, so nothing is retired: the marker is stale, and when it was
                    # all that was left (another writer's delete or sweep) so is the lock.
                    unlink_all((paths.retired, paths.lock) if present == {RETIRED} else (paths.retired,))
                    changed = True
                    continue
                if young:
                    continue
                try:
                    retired = self._read_state(rollout_id, paths).retired
                except CaptureFileError as exc:
                    # Not a tombstone this store wrote: leave every file to whoever owns it.
                    logger.warning("sweep of %s skips rollout %r: %s", self.directory, rollout_id, exc)
                    continue
                if not retired:
                    if RETIRED in present:
                        unlink_all((paths.retired,))
                        changed = True
                    continue
                # The marker first, the lock last, for the reasons `delete` gives.
                unlink_all((
                    paths.retired, paths.jsonl, paths.intents, paths.incomplete, self.record_path(rollout_id),
                    self.commit_path(rollout_id), paths.state, paths.lock,
                ))
                removed += 1
                changed = True
        if remove_stale(self.directory, cutoff):
            changed = True
        if changed:
            fsync_dir(self.directory)
        return removed

    def rollout_ids(self, *, skip_retired: bool = False) -> list[str]:
        """Sorted ids of the rollouts that have capture files here: one pass over names
        (see `raycap.capture.files.listed_ids`); a retired marker left alone is removed."""
        own: dict[str, set[str]] = {}
        found = scan(self.directory, (COMMIT, RECORD), own)  # one pass: the stream's files too
        self._finish_drops([r for r in own if RETIRED in found.get(r, ())])
        found = self._clear_lone_markers(found, (COMMIT, RECORD))
        return listed_ids(self.directory, found, self._is_retired, skip_retired=skip_retired)

    def _finish_drops(self, dropping: list[str]) -> None:
        """Drop again each of `dropping`, retired by name but still holding a stream's
        commit marker or record file: a drop that stopped after its tombstone, which no
        one else would finish (a stream skips a retired rollout by name, the sweep only
        old ones). `drop_now` of the snapshot it retired removes the rest; one not
        retired yet is left to its stream. Never raises (a read-only directory keeps its
        files)."""
        for rollout_id in dropping:
            try:
                life = self.lifecycle(rollout_id)
                if life.retired and self.drop_now(rollout_id, snapshot_id=life.snapshot_id, version=life.version):
                    logger.info("%s: finished the interrupted retirement of rollout %r", self.directory, rollout_id)
            except (OSError, ValueError) as exc:
                logger.debug("%s: left what a drop of rollout %r left (%s)", self.directory, rollout_id, exc)

    def held(self, rollout_ids: Iterable[str], *, skip_retired: bool = False) -> dict[str, int]:
        """The given ids this directory holds, each with its JSONL size in bytes (0 without
        one); a few stats per id (see `raycap.capture.files.held_ids`). Invalid ids raise
        ValueError before the file system is touched."""
        ids = list(dict.fromkeys(validate_rollout_id(r) for r in rollout_ids))
        return held_ids(self.directory, ids, [self.paths(r) for r in ids], self._is_retired, skip_retired=skip_retired)

    def _is_retired(self, rollout_id: str) -> bool:
        try:
            return self._read_state(rollout_id, self.paths(rollout_id)).retired
        except (ValueError, OSError):
            return False  # listed, so that freezing it reports the damage

    # -- NeMo Gym's names -------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The capture directory."""
        return self.directory

    def path_for(self, rollout_id: str) -> Path:
        return self.paths(rollout_id).jsonl

    def state_path_for(self, rollout_id: str) -> Path:
        return self.paths(rollout_id).state

    def lock_path_for(self, rollout_id: str) -> Path:
        return self.paths(rollout_id).lock

    def intents_path_for(self, rollout_id: str) -> Path:
        return self.paths(rollout_id).intents

    def incomplete_path_for(self, rollout_id: str) -> Path:
        return self.paths(rollout_id).incomplete

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether the rollout's state says a call of it failed to capture (False without
        a state file), read under the shared lock. Dangling intents are judged by `freeze`."""
        paths = self.paths(rollout_id)
        with self._locked(paths, shared=True):
            return self._read_state(rollout_id, paths).incomplete

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """The rollout's records in file order, under the shared lock, without freezing
        ([] when it has none). A look for tools and tests: it changes nothing, so a torn
        final line left by a crashed writer raises here; `freeze_now` repairs it."""
        with self._locked(self.paths(rollout_id), shared=True):
            return self._read_entries_unlocked(rollout_id)

    # -- the async protocols (TokenSink and TokenSource) -------------------------------------
    # The file work blocks (flock, fsync), so each call runs it in a worker thread: a writer
    # or consumer in an async server never stalls its event loop. The synchronous forms
    # above are for scripts and for raycap's own workers, which run off any loop already.

    async def put(self, entry: TokenEntry) -> None:
        """TokenSink: `append` (durable before it returns)."""
        await off_loop(self.append, entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """TokenSink: `mark_incomplete_now`."""
        await off_loop(self.mark_incomplete_now, rollout_id, model_call_id)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """`begin_call_now`: announce a call before dispatching it."""
        await off_loop(self.begin_call_now, rollout_id, model_call_id)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """TokenSource: `freeze_now`."""
        return await off_loop(self.freeze_now, rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """TokenSource: `drop_now`."""
        return await off_loop(self.drop_now, rollout_id, snapshot_id=snapshot_id, version=version)

    async def close(self) -> None:
        """Nothing to release: every operation opens and closes its own files."""


def make_token_store(global_config_dict: Any) -> TokenCaptureStore | None:
    """The store a run's config names (validated as given, so it may raise): None when
    capture is disabled, a sink is configured, or there is no directory."""
    config = token_id_capture_config(global_config_dict)
    directory = config.resolved_dir()
    if not config.enabled or config.token_id_capture.sink is not None or directory is None:
        return None
    return TokenCaptureStore(directory)
