"""The commit marker: a stream's durable record, in the capture directory, that one
snapshot of a rollout was committed.

`R.tokens.commit` holds JSON: the snapshot it commits (id and version), the output its
rows were written to (or null when the caller declared them durable elsewhere), whether
the row was masked, and why. A marker belongs to one snapshot: one whose snapshot id is
not the rollout's current one is stale and means nothing, so a rollout cleared and
dispatched again is never taken for committed. It is replaced whole (temp file, fsync,
rename, directory fsync), so a reader sees the old marker or the new one, never half.
The store (`raycap.capture.store`) writes and removes it under the rollout's lock.

This module does not import Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raycap.capture.files import COMMIT as COMMIT  # the commit marker's suffix, declared with the others
from raycap.capture.files import CaptureTooLarge, read_bounded, replace_file
from raycap.capture.untrusted import bounded, bounded_repr, loads_untrusted

# A marker is a few hundred bytes (an output path at most a few KiB): anything larger
# was not written by a stream, and is never read into memory.
MAX_MARKER_BYTES = 64 << 10


@dataclass(frozen=True)
class CommitMarker:
    """What a stream committed for one snapshot of a rollout (`R.tokens.commit`).

    `output` is the committed dataset that holds the rollout's rows, or None when the
    caller declared them durable elsewhere; `masked` rows keep their capture as evidence."""

    snapshot_id: str
    version: int
    output: str | None
    masked: bool
    reason: str

    def to_json(self) -> bytes:
        return json.dumps(
            {"snapshot_id": self.snapshot_id, "version": self.version, "output": self.output,
             "masked": self.masked, "reason": self.reason},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: Any) -> CommitMarker:
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        output = raw["output"]
        if not isinstance(raw["snapshot_id"], str) or not (output is None or isinstance(output, str)):
            raise TypeError("snapshot_id must be a string and output a string or null")
        version = raw["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, not {bounded_repr(version)}")
        return cls(raw["snapshot_id"], version, output, bool(raw["masked"]), str(raw.get("reason", "")))


def write_marker(target: Path, marker: CommitMarker) -> None:
    """Replace `target` with `marker`, durably (the caller holds the rollout's lock)."""
    replace_file(target, marker.to_json(), durable=True)


def read_marker(rollout_id: str, path: Path) -> CommitMarker | None:
    """The marker at `path` as written, stale or not; None when there is none.

    Opened like every capture file (never through a link, never blocking on a FIFO) and
    read only up to `MAX_MARKER_BYTES`. Raises ValueError when it is not a regular file,
    too large, or not a marker: it was damaged from outside, and guessing could deliver
    a committed row twice."""
    try:
        raw = read_bounded(rollout_id, path, MAX_MARKER_BYTES, "commit marker")
    except CaptureTooLarge as exc:
        raise ValueError(f"{exc}, so it was damaged from outside: remove it by hand if the rollout should be "
                         "delivered again") from None
    except ValueError as exc:  # CaptureFileError: a link, FIFO, directory, ...
        raise ValueError(f"commit marker of rollout {rollout_id!r}: {exc}; remove it by hand if the rollout "
                         "should be delivered again") from None
    if raw is None:
        return None
    try:
        return CommitMarker.from_json(loads_untrusted(raw, "its text"))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"commit marker {path} of rollout {rollout_id!r} is unreadable ({type(exc).__name__}: {bounded(exc)}); "
            "it is only ever replaced atomically, so it was damaged from outside: remove it by hand if "
            "the rollout should be delivered again"
        ) from None
