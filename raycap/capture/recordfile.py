"""The record file: a stream's durable copy of the result record submitted for a rollout.

A stream (`raycap.runs.stream`) takes finished result records as well as ids. A record's
fields (its reward, task and rollout indices, agent, response) must outlive the
stream's process until the rollout's rows are committed, since a rollout taken and not
committed is delivered again, with its fields, by the next stream. So the record is
kept in the capture directory, beside the rollout's capture, as `R.tokens.record.json`
(a raycap addition to the directory, like the commit marker `R.tokens.commit`):

    {"record_index": <int>, "record": <the record, as JSON>}

written as exactly those bytes: the record's own JSON text (`KeptRecord.data`, written
as Gym's collection writes records: `raycap.stream.records.encode`) after a fixed
prefix, so the record read back is byte for byte the one submitted, and two records
are the same record when their texts are equal. `record_index` is the record's position
in the sequence given to `submit`.

The store (`raycap.capture.store.TokenCaptureStore.write_record`) writes it under the rollout's
lock (temp file, fsync, rename, directory fsync) and only while the rollout is neither
retired nor committed; `drop` removes it with the capture it retires, `delete` and
`sweep_retired` with the rest of the rollout's files, and a masked rollout committed as
evidence keeps it beside its capture. Like every capture file it is opened by
descriptor, never through a link, never blocking on a FIFO (`raycap.capture.files`), and
it is read only up to `MAX_RECORD_BYTES`: a larger file was not written by a stream.
It never makes a rollout listed on its own.

This module does not import Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from raycap.capture.files import RECORD as RECORD  # the kept record's suffix, declared with the others
from raycap.capture.files import CaptureTooLarge, read_bounded
from raycap.errors import RecordFileError  # noqa: F401 - raised here, declared with the others

# A record holds a rollout's response, which may be long; far larger ones are not
# records a collection writes, and are never read into memory.
MAX_RECORD_BYTES = 64 << 20

_PREFIX = re.compile(rb'\{"record_index":(0|[1-9][0-9]{0,18}),"record":')


@dataclass(frozen=True)
class KeptRecord:
    """A submitted record as kept: its position in the sequence given to `submit`
    (`record_index`) and its JSON text."""

    index: int
    data: bytes

    def to_bytes(self) -> bytes:
        return b'{"record_index":%d,"record":' % self.index + self.data + b"}"

    @classmethod
    def from_bytes(cls, rollout_id: str, path: Path, raw: bytes) -> KeptRecord:
        """The record kept in `raw` (the bytes of `path`); RecordFileError when they are
        not a record file's."""
        found = _PREFIX.match(raw)
        if found is None or not raw.endswith(b"}") or found.end() >= len(raw) - 1:
            raise RecordFileError(
                f"record file {path} of rollout {rollout_id!r} is not one a stream writes (it is replaced only "
                "atomically, so it was damaged from outside): remove it, or delete() the rollout"
            )
        return cls(int(found.group(1)), raw[found.end() : -1])


def read_record_file(rollout_id: str, path: Path) -> KeptRecord | None:
    """The record kept at `path`, or None when there is none. Opened as every capture
    file is, and read only up to MAX_RECORD_BYTES; RecordFileError otherwise."""
    try:
        raw = read_bounded(rollout_id, path, MAX_RECORD_BYTES, "record file")
    except CaptureTooLarge as exc:
        raise RecordFileError(f"{exc}, so a stream did not write it: remove it, or delete() the rollout") from None
    except ValueError as exc:  # CaptureFileError: a link, FIFO, directory, ...
        raise RecordFileError(f"record file of rollout {rollout_id!r}: {exc}") from None
    if raw is None:
        return None
    return KeptRecord.from_bytes(rollout_id, path, raw)
