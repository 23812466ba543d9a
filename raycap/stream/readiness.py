"""Whether a rollout is ready for a stream, judged from its capture directories alone.

One rule, run wherever the directories are: in the stream's process for local paths
(`raycap.stream.dirs`), in the directories' node actor for `NODE:/path`
(`raycap.cluster.nodes.node_stream`). A rollout is *ready* when its capture is frozen
in every directory that holds part of it, no part is retired, and its commit marker
(`raycap.capture.markers`) is absent or belongs to another snapshot.

- `judge` reads the state files and the marker, nothing else.
- A current marker means a commit of this snapshot began; `settle` decides whether it
  happened (a marker naming a step: that step holds the rollout's row, `CHECK_STEP`),
  then finishes it or undoes it. A damaged marker is `DAMAGED`: held back, neither
  delivered nor retired.
- The stream lock (`lock_directory`) keeps two streams off one directory.

The long form: docs/internals.md ("A rollout's readiness"). This module does not import Ray.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from raycap.capture.files import lock_or_raise, not_regular
from raycap.capture.markers import CommitMarker
from raycap.capture.store import TokenCaptureStore
from raycap.errors import DirectoryBusy  # noqa: F401 - raised here, declared with the others
from raycap.stream.steps import SnapshotPart

logger = logging.getLogger(__name__)

LOCK_NAME = ".raycap-stream.lock"

READY = "ready"
NOT_READY = "not ready"
CHECK_STEP = "check step"  # a current marker names a step: is this snapshot in it?
COMMITTED = "committed"  # a current marker names no step: the commit happened
DAMAGED = "damaged"


def lock_directory(path: str, label: str | None = None) -> int:
    """Take the stream lock of the directory at `path` (see the module docstring); the
    descriptor holding it. DirectoryBusy (one line, naming `label`) when another stream
    holds it."""
    lock = Path(path, LOCK_NAME)
    return lock_or_raise(
        lock,
        os.O_RDWR | os.O_CREAT,
        lambda kind: not_regular(LOCK_NAME, lock, kind),  # refused as a capture file would be
        lambda: DirectoryBusy(
            f"another stream consumes {label or path} (it holds {lock}); two consumers would deliver the same "
            "rollouts twice: close the other stream first"
        ),
    )


@dataclass(frozen=True)
class Judgement:
    """What the directories say of a rollout: `status` (READY, NOT_READY with the
    `reason`, CHECK_STEP or COMMITTED with the current `marker`, DAMAGED with the
    `reason`), and its snapshot parts, the first one as the marker names it."""

    status: str
    reason: str = ""
    marker: CommitMarker | None = None
    parts: tuple[SnapshotPart, ...] = field(default_factory=tuple)

    @property
    def snapshot(self) -> tuple[str, int] | None:
        return (self.parts[0].snapshot_id, self.parts[0].version) if self.parts else None


def judge(stores: Mapping[str, TokenCaptureStore], rollout_id: str) -> Judgement:
    """The rollout as its directories (`stores`, by label) say (see the module docstring)."""
    holders = []
    for label, store in stores.items():
        try:
            life = store.lifecycle(rollout_id)
        except (OSError, ValueError) as exc:
            return Judgement(NOT_READY, f"its state in {label} is unreadable ({type(exc).__name__}: {exc})")
        if life.frozen or life.retired:
            holders.append((label, store, life))
        elif store.held([rollout_id]):
            return Judgement(NOT_READY, "not frozen (not finished)")
    if not holders:
        return Judgement(NOT_READY, "not frozen (not finished)")
    if any(life.retired for _, _, life in holders):
        return Judgement(NOT_READY, "retired")
    parts = [SnapshotPart(label, life.snapshot_id, life.version) for label, _, life in holders]
    label, store, life = holders[0]
    try:
        marker = store.read_commit(rollout_id)
    except ValueError as exc:
        return Judgement(DAMAGED, f"its commit marker {store.commit_path(rollout_id)} is damaged ({exc})")
    # A marker belongs to a snapshot, not to a version: a call marked incomplete after
    # the commit bumps the version, and the rollout is still committed.
    if marker is None or marker.snapshot_id != life.snapshot_id:
        return Judgement(READY, parts=tuple(parts))
    # What was committed is exactly the marker's version of the first part.
    parts[0] = SnapshotPart(label, marker.snapshot_id, marker.version)
    return Judgement(CHECK_STEP if marker.output is not None else COMMITTED, marker=marker, parts=tuple(parts))


@dataclass(frozen=True)
class Settled:
    """What `settle` did: the rollout's status now (READY, or why it is not), and
    `recovered` ("ready": an unfinished commit undone; "finished": an interrupted
    retirement finished; "": neither)."""

    status: str
    recovered: str = ""


def settle(stores: Mapping[str, TokenCaptureStore], rollout_id: str, judged: Judgement, committed: bool) -> Settled:
    """Finish or undo the commit a current marker records (see the module docstring):
    `committed` says whether it happened."""
    marker = judged.marker
    assert marker is not None and judged.parts
    if not committed:
        # The step died before its dataset was renamed into place, or the output holds
        # another capture of this id (a reused step directory): never committed.
        stores[judged.parts[0].label].remove_commit(rollout_id, marker.snapshot_id)
        return Settled(READY, "ready")
    if marker.masked:
        return Settled(f"committed as masked evidence ({marker.reason})")
    # Committed and unmasked, but not yet retired: finish the retirement, of exactly the
    # committed version (a changed capture is then kept, as evidence, by the drop).
    drop_parts(stores, rollout_id, judged.parts)
    return Settled(COMMITTED, "finished")


def drop_parts(stores: Mapping[str, TokenCaptureStore], rollout_id: str, parts: tuple[SnapshotPart, ...] | list) -> bool:
    """Drop exactly these snapshot parts; False when one is no longer that snapshot."""
    ok = True
    # The first part last: its directory holds the marker, which must outlive the other
    # parts' drops, so that a crash between them is finished by the next stream.
    for part in [*parts[1:], *parts[:1]]:
        if not stores[part.label].drop_now(rollout_id, snapshot_id=part.snapshot_id, version=part.version):
            ok = False
            logger.warning(
                "rollout %s in %s is no longer snapshot %s; it was not dropped", rollout_id, part.label, part.snapshot_id
            )
    return ok


def frozen_live(stores: Mapping[str, TokenCaptureStore], skip: Container[str] = ()) -> list[str]:
    """The rollouts with a state file in any of the directories, not retired, not in
    `skip`, oldest state first: one pass over each directory's names (retired
    tombstones skipped by name) plus one stat per live rollout."""
    found: dict[str, int] = {}
    for store in stores.values():
        for rid in store.rollout_ids(skip_retired=True):
            if rid in skip:
                continue
            try:
                mtime = os.stat(store.paths(rid).state).st_mtime_ns
            except FileNotFoundError:
                continue  # never frozen (no state), or gone since the listing
            found[rid] = min(mtime, found.get(rid, mtime))
    return sorted(found, key=lambda r: (found[r], r))

