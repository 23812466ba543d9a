"""The record file: a stream's durable copy of the result record submitted for a rollout.

A record's fields must outlive the stream's process until the rollout's rows are
committed, so the record is kept beside the capture as `R.tokens.record.json`:

    {"record_index": <int>, "record": <the record, as JSON>}

written as exactly those bytes (`KeptRecord.data` after a fixed prefix), so the record
read back is byte for byte the one submitted.

- The store writes it (`raycap.capture.store.TokenCaptureStore.write_record`) under the
  rollout's lock, durably, only while the rollout is neither retired nor committed.
- `drop`, `delete` and `sweep_retired` remove it with the capture.
- It is opened as every capture file (`raycap.capture.files`) and read up to
  `MAX_RECORD_BYTES`; it never makes a rollout listed on its own.

The long form: docs/internals.md ("The record file"). This module does not import Ray.
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
