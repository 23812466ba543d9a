"""The two files a stream keeps beside a capture: the commit marker and the record file.

A stream (`raycap.runs.stream`) records what it committed in a per-rollout commit marker,
`R.tokens.commit` (`raycap.capture.markers`), written under the rollout's lock and only while
the rollout is frozen in the marker's snapshot. It never makes a rollout listed on its
own; `drop` removes it after the tombstone is durable, `delete` and `sweep_retired`
with the rest of the rollout's files.

A stream also keeps the result record submitted for a rollout, from its submit until
its commit, in `R.tokens.record.json` (`raycap.capture.recordfile`), written under the
rollout's lock (`write_record`: temp file, fsync, rename, directory fsync) only while
the rollout is neither retired nor committed, and never replaced by another record once
the rollout is frozen with one. Like the marker it never makes a rollout listed; `drop`
removes it with the capture it retires (before the marker), `delete` and
`sweep_retired` with the rest of the rollout's files, and a masked rollout committed as
evidence keeps it.

These two files are raycap's additions to the directory of the spec's table (which is
NeMo Gym's): Gym's writers neither read nor write them.

`StreamFiles` adds them to the per-rollout machinery (`raycap.capture.rolloutfiles`);
`raycap.capture.store.TokenCaptureStore` is one. This module does not import Ray.
"""

from __future__ import annotations

from pathlib import Path

from raycap.capture.files import fsync_dir, replace_file, unlink_all, validate_rollout_id
from raycap.capture.markers import COMMIT, CommitMarker, read_marker, write_marker
from raycap.capture.recordfile import RECORD, KeptRecord, read_record_file
from raycap.capture.rolloutfiles import RolloutFiles, retired_text


class StreamFiles(RolloutFiles):
    """A capture directory's commit markers and record files (see the module docstring)."""

    # -- commit markers ----------------------------------------

    def commit_path(self, rollout_id: str) -> Path:
        """The path of the rollout's commit marker (validates the id)."""
        return self.directory / (validate_rollout_id(rollout_id) + COMMIT)

    def write_commit(self, rollout_id: str, marker: CommitMarker) -> bool:
        """Write the commit marker durably; False, writing nothing, unless the rollout is
        frozen, not retired, and in exactly the marker's snapshot (a marker for another
        snapshot would be stale the moment it was written)."""
        paths = self.paths(rollout_id)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            if not state.frozen or state.retired or (state.snapshot_id, state.version) != (
                marker.snapshot_id, marker.version,
            ):
                return False
            write_marker(self.commit_path(rollout_id), marker)
            return True

    def read_commit(self, rollout_id: str) -> CommitMarker | None:
        """The rollout's commit marker as written, stale or not; None when there is none
        (see `raycap.capture.markers.read_marker`)."""
        return read_marker(rollout_id, self.commit_path(rollout_id))

    def remove_commit(self, rollout_id: str, snapshot_id: str) -> bool:
        """Remove the commit marker of `snapshot_id` (a commit that never became durable);
        False when the marker is absent or belongs to another snapshot."""
        paths = self.paths(rollout_id)
        with self._locked(paths):
            marker = self.read_commit(rollout_id)
            if marker is None or marker.snapshot_id != snapshot_id:
                return False
            unlink_all((self.commit_path(rollout_id),))
            fsync_dir(self.directory)
            return True

    # -- record files --------------------------------------------

    def record_path(self, rollout_id: str) -> Path:
        """The path of the rollout's record file (validates the id)."""
        return self.directory / (validate_rollout_id(rollout_id) + RECORD)

    def write_record(self, rollout_id: str, record: KeptRecord) -> str | None:
        """Keep `record` for the rollout, durably; None when it is kept (written, or the
        same record was kept already), else why not, writing nothing: the rollout is
        retired, a commit of its snapshot began (its commit marker is current), or it is
        frozen with another record, which stays until its commit. A record left beside a
        rollout that is not frozen was never taken (its submit died before the freeze):
        it is replaced."""
        paths = self.paths(rollout_id)
        target = self.record_path(rollout_id)
        with self._locked(paths):
            state = self._read_state(rollout_id, paths)
            if state.retired:
                return f"{retired_text(rollout_id)} (its capture was consumed and dropped)"
            if state.frozen:
                try:
                    marker = self.read_commit(rollout_id)
                    kept = read_record_file(rollout_id, target)
                except ValueError as exc:
                    return str(exc)
                if marker is not None and marker.snapshot_id == state.snapshot_id:
                    return (
                        f"a commit of rollout {rollout_id} began (its commit marker {self.commit_path(rollout_id)} "
                        "is current); a committed rollout takes no record"
                    )
                if kept is not None:
                    if kept.data == record.data:
                        return None
                    return (
                        f"rollout {rollout_id} is pending with another record (kept in {target} since it was "
                        "submitted); a rollout is delivered with one record until its commit"
                    )
            replace_file(target, record.to_bytes(), durable=True)
            return None

    def read_record(self, rollout_id: str) -> KeptRecord | None:
        """The record kept for the rollout, or None; RecordFileError (a ValueError) when
        the file is not one a stream writes (see `raycap.capture.recordfile`). No lock: the file
        is only ever replaced whole."""
        return read_record_file(rollout_id, self.record_path(rollout_id))
