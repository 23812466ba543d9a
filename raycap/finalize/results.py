"""Results files: a rollout collection's records in, finalized records out.

- A results file is JSONL, one record per line, as NeMo Gym's collection writes it;
  blank lines are no records; a record's position from 0 is its `record_index`.
- `scan_results` is one streaming pass that keeps no record: the sha256 that names the
  input, the record count, and batches of consecutive lines cut by records and by cost
  (their bytes, and their captures' with a `CaptureCost`). `record_fields` are typed
  there, one Arrow type each across the output.
- A batch's bytes are read again when its task is sent (`ResultsScan.read`), digested on
  the way: a file changed meanwhile fails the run instead of mixing two versions.
- An iterable of records is spooled to a file first (`spool_records`).
- `dumps_record` writes a record back as Gym does (orjson), or by Python's json where
  orjson would not write the value back exactly; a value that is no JSON is refused.
- The file is opened as capture files are (`raycap.capture.files.open_regular`): never
  through a link, FIFO or device. `write_records_file` writes an output's finalized
  records as one results file; `read_records` yields them, in input order.

The rules in full: docs/internals.md ("Results files"). No Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Protocol, Sequence

import orjson
import pyarrow as pa

from raycap.capture.files import open_regular
from raycap.capture.records import _line_spans, iter_lines, loads_line, read_line
from raycap.capture.untrusted import bounded
from raycap.errors import ResultsError  # noqa: F401 - raised here, declared with the others
from raycap.output.durable import replace_durably
from raycap.output.faults import write_fault
from raycap.rows.arrow import record_field_type

READ_CHUNK = 8 << 20
# A batch's default bounds: enough records that a task's overhead is negligible, few
# enough bytes that the batches in flight stay small.
BATCH_RECORDS = 128
BATCH_BYTES = 16 << 20
# What orjson must refuse rather than turn into something else: dataclasses, dates and
# subclasses of JSON types are no JSON values of a results file.
_STRICT = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


# --- writing a record ------------------------------------------------------------------------------


def dumps_record(record: Any, *, exact: bool = True, label: str = "results", index: int | None = None) -> bytes:
    """One record as a JSON line (without its newline), as Gym's collection writes it
    (orjson); with `exact` False, or when orjson refuses the value, by Python's json
    (see the module docstring). ResultsError when it is no JSON value."""
    if exact:
        try:
            return orjson.dumps(record, option=_STRICT)
        except orjson.JSONEncodeError as exc:
            if "key must be str" in str(exc):
                raise _not_json(label, index, exc) from None
    try:
        return json.dumps(record, ensure_ascii=True, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise _not_json(label, index, exc) from None


def _not_json(label: str, index: int | None, exc: BaseException) -> ResultsError:
    where = f"record {index} of {label}" if index is not None else f"a record of {label}"
    return ResultsError(f"{where} is not a JSON value ({type(exc).__name__}: {bounded(exc)}); give records as JSON objects")


def dumps_exactly(record: Any, label: str, index: int) -> bytes:
    """`dumps_record` of a record given as a value: orjson's text when it reads back as
    the same value, else Python's json's (which reads back the same). ResultsError when
    it is no JSON value."""
    line = dumps_record(record, label=label, index=index)
    try:
        same = read_line(line)[0] == record
    except ValueError:
        same = False
    return line if same else dumps_record(record, exact=False, label=label, index=index)


# --- reading a results file -----------------------------------------------------------------------


@dataclass(frozen=True)
class ResultsBatch:
    """Consecutive lines of a results file, finalized by one task: bytes `start` to
    `end`, holding `records` records, the first at position `first_index` on line
    `first_line` (from 1) of the file."""

    index: int
    start: int
    end: int
    first_index: int
    first_line: int
    records: int


@dataclass
class ResultsScan:
    """What one pass over a results file found: where it is (`path`; `label` names it
    in messages), its sha256 and size, its records, their batches, and the Arrow type of
    each field carried by name (pa.null() for a field no record gives a value)."""

    path: Path
    label: str
    sha256: str
    size: int
    records: int
    batches: list[ResultsBatch]
    field_types: dict[str, pa.DataType] = field(default_factory=dict)
    # The bytes of the records' captures, as the batches were cut by them (0 without a cost).
    capture_bytes: int = 0

    def read(self) -> Iterator[tuple[ResultsBatch, bytes]]:
        """Each batch with its bytes, in order, read again from the file and digested
        on the way: ResultsError if the file is no longer the one scanned."""
        digest = hashlib.sha256()
        fd = open_results(self.path, self.label)
        try:
            if os.fstat(fd).st_size != self.size:
                raise _changed(self.label)
            position = 0
            for batch in self.batches:
                if batch.start != position:
                    raise _changed(self.label)
                data = os.pread(fd, batch.end - batch.start, batch.start)
                digest.update(data)
                position = batch.end
                yield batch, data
            if position < self.size:
                digest.update(os.pread(fd, self.size - position, position))
        finally:
            os.close(fd)
        if digest.hexdigest() != self.sha256:
            raise _changed(self.label)


def _changed(label: str) -> ResultsError:
    return ResultsError(f"{label} changed while it was finalized; nothing was committed: rerun once it is complete")


def open_results(path: str | os.PathLike, label: str) -> int:
    """A results file's descriptor, opened as capture files are (never through a link,
    never waiting on a FIFO, a regular file only)."""

    def refuse(kind: str) -> ResultsError:
        return ResultsError(
            f"results file {label} is not a regular file but {kind}; raycap reads only regular files, never through "
            "a link: give the file itself"
        )

    try:
        return open_regular(Path(path), os.O_RDONLY, refuse)
    except FileNotFoundError:
        raise ResultsError(f"results file {label} does not exist; give the JSONL file a rollout collection wrote") from None
    except IsADirectoryError:
        raise ResultsError(f"results file {label} is a directory; give the JSONL file a rollout collection wrote") from None


def check_results_start(fd: int, label: str) -> None:
    """Refuse a results file that cannot be JSONL, from its first bytes: an empty one
    (no record to finalize) and one JSON array (records one per line, not in a list)."""
    head = os.pread(fd, 4096, 0)
    offset = 4096
    while head and not head.strip():
        head = os.pread(fd, 4096, offset)
        offset += 4096
    if not head:
        raise ResultsError(f"results file {label} is empty: there is no record to finalize; give the JSONL file a rollout collection wrote")
    if head.lstrip()[:1] == b"[":
        raise ResultsError(
            f"results file {label} holds a JSON array; a results file is JSONL, one record (a JSON object) per line: "
            "write each record on its own line (e.g. jq -c '.[]')"
        )


class CaptureCost(Protocol):
    """What a record's rollout costs besides its line: `rollout_id` reads it from a
    parsed record (None: no capture to read), `capture_bytes` gives the bytes of
    captures of each of a window of ids (0 where none is known)."""

    def rollout_id(self, record: Any) -> str | None: ...

    def capture_bytes(self, rollout_ids: list[str | None]) -> list[int]: ...


# Records whose rollouts' captures are looked up at once (a few KB of paths each while looked up).
COST_WINDOW = 256


class _Cutter:
    """Cuts records into batches as a scan finds them (global byte offsets): a batch
    closes at `batch_records` records, or once its cost (its bytes, and the bytes of
    its records' captures when a CaptureCost is given) reaches `batch_bytes`."""

    def __init__(self, batch_records: int, batch_bytes: int, cost: CaptureCost | None = None) -> None:
        self.batch_records, self.batch_bytes, self.cost = batch_records, batch_bytes, cost
        self.batches: list[ResultsBatch] = []
        self.records = 0
        self.start, self.first_line, self.first_index, self.held, self.spent = 0, 1, 0, 0, 0
        self.capture_bytes = 0
        # Records waiting for their captures' bytes: (line end, lines up to it, rollout id).
        self.pending: list[tuple[int, int, str | None]] = []

    def add(self, line_end: int, lines_to_end: int, rollout_id: str | None = None) -> None:
        """One record whose line ends at `line_end` (after its newline), with
        `lines_to_end` newlines before that offset, and its rollout id."""
        if self.cost is None:
            self._add(line_end, lines_to_end, 0)
            return
        self.pending.append((line_end, lines_to_end, rollout_id))
        if len(self.pending) >= COST_WINDOW:
            self.flush()

    def flush(self) -> None:
        """Cut the records waiting for their captures' bytes."""
        if not self.pending:
            return
        assert self.cost is not None
        pending, self.pending = self.pending, []
        sizes = self.cost.capture_bytes([rollout_id for _, _, rollout_id in pending])
        for (line_end, lines_to_end, _), size in zip(pending, sizes):
            self._add(line_end, lines_to_end, size)

    def _add(self, line_end: int, lines_to_end: int, capture_bytes: int) -> None:
        if not self.held:
            self.first_index = self.records
        self.held += 1
        self.records += 1
        self.spent += capture_bytes
        self.capture_bytes += capture_bytes
        if self.held >= self.batch_records or line_end - self.start + self.spent >= self.batch_bytes:
            self._close(line_end)
            self.first_line = 1 + lines_to_end

    def _close(self, end: int) -> None:
        self.batches.append(ResultsBatch(len(self.batches), self.start, end, self.first_index, self.first_line, self.held))
        self.start, self.held, self.spent = end, 0, 0

    def finish(self, size: int) -> list[ResultsBatch]:
        if self.cost is not None:
            self.flush()
        if self.held:
            self._close(size)
        elif self.batches and self.batches[-1].end < size:
            # Blank lines after the last record belong to the last batch.
            self.batches[-1] = replace(self.batches[-1], end=size)
        return self.batches


def scan_results(
    path: str | os.PathLike,
    *,
    label: str | None = None,
    batch_records: int = BATCH_RECORDS,
    batch_bytes: int = BATCH_BYTES,
    record_fields: Sequence[str] = (),
    cost: CaptureCost | None = None,
) -> ResultsScan:
    """One streaming pass over the results file at `path` (see the module docstring);
    ResultsError when it cannot be read as one. With `cost`, a batch's bytes count its
    records' captures too (each line is then parsed for its rollout id)."""
    label = label or str(path)
    fd = open_results(path, label)
    digest = hashlib.sha256()
    cutter = _Cutter(batch_records, batch_bytes, cost)
    types: dict[str, tuple[pa.DataType, int]] = {}
    offset, carry = 0, b""
    index = 0  # records scanned (the cutter may hold the latest back while it looks up their captures)
    newlines = {"count": 0, "at": 0}  # newlines before file offset "at"
    region = b""

    def newlines_to(position: int) -> int:
        newlines["count"] += region.count(b"\n", newlines["at"] - offset, position - offset)
        newlines["at"] = position
        return newlines["count"]

    try:
        while True:
            chunk = _read_chunk(fd)
            digest.update(chunk)
            buffer = carry + chunk
            if chunk:
                complete = buffer.rfind(b"\n") + 1
                if not complete:
                    carry = buffer
                    continue
            else:
                complete = len(buffer)
            region, carry = buffer[:complete], buffer[complete:]
            for start, end in _line_spans(region):
                record = None
                if record_fields:
                    line_no = lambda at=offset + start: 1 + newlines_to(at)  # noqa: E731 - only asked for an error's line
                    record = _field_types(region[start:end], record_fields, types, label, index, line_no)
                rollout_id = None
                if cost is not None:
                    rollout_id = _rollout_id(cost, region[start:end] if record is None else None, record)
                line_end = offset + min(end + 1, complete)
                cutter.add(line_end, newlines_to(line_end), rollout_id)
                index += 1
            newlines_to(offset + complete)
            offset += complete
            if not chunk:
                break
    finally:
        os.close(fd)
    batches = cutter.finish(offset)
    return ResultsScan(
        Path(path), label, digest.hexdigest(), offset, cutter.records, batches,
        {name: types[name][0] if name in types else pa.null() for name in record_fields},
        cutter.capture_bytes,
    )


def _read_chunk(fd: int) -> bytes:
    parts, wanted = [], READ_CHUNK
    while wanted:
        data = os.read(fd, wanted)
        if not data:
            break
        parts.append(data)
        wanted -= len(data)
    return b"".join(parts)


def _field_types(
    line: bytes, names: Sequence[str], types: dict[str, tuple[pa.DataType, int]], label: str, index: int, line_no: Any
) -> Any:
    """Check the fields carried by name of one record against the types seen so far;
    the record."""
    try:
        record = loads_line(line)
    except ValueError as exc:
        raise ResultsError(f"{label} line {line_no()} (record {index}) is not JSON: {exc}; fix or remove that line and rerun") from None
    check_field_types(record, names, types, label, index)
    return record


def _rollout_id(cost: CaptureCost, line: bytes | None, record: Any) -> str | None:
    """The rollout id of a record (parsed from `line` when not given), for its cost
    alone: a line that is not JSON, or a record without a usable id, has none (its
    batch's task says what is wrong with it)."""
    try:
        return cost.rollout_id(loads_line(line) if line is not None else record)
    except Exception:  # noqa: BLE001 - a cost only; the record's task reports the fault
        return None


def check_field_types(record: Any, names: Sequence[str], types: dict[str, tuple[pa.DataType, int]], label: str, index: int) -> None:
    """Record the Arrow type of each field of `record` carried by name (`types`: name ->
    (type, first record giving it)); ResultsError naming the field and both records when
    one disagrees, or naming the record when a value has no scalar type."""
    if not isinstance(record, dict):
        return
    for name in names:
        try:
            kind = record_field_type(record.get(name))
        except ValueError as exc:
            raise ResultsError(
                f"record_fields: field {name!r} of record {index} of {label} {exc}; leave it out of record_fields"
            ) from None
        if kind is None:
            continue
        seen = types.setdefault(name, (kind, index))
        if seen[0] != kind:
            raise ResultsError(
                f"record_fields: field {name!r} is {seen[0]} in record {seen[1]} but {kind} in record {index} of "
                f"{label}; a field carried by name has one type across the output: make the records agree, or leave "
                "it out of record_fields"
            )


def spool_records(records: Iterable[Any], spool: Path, label: str) -> None:
    """Write the records of an iterable to `spool`, one line each (see `dumps_record`)."""

    def write(handle: BinaryIO) -> None:
        for index, record in enumerate(records):
            handle.write(dumps_exactly(record, label, index) + b"\n")

    replace_durably(spool, write)


# --- an output's records -------------------------------------------------------------------------


def read_records(output: str | os.PathLike) -> Iterator[Any]:
    """The finalized records of an output `raycap.finalize_rollouts` wrote, in input
    order, each equal to what NeMo Gym's finalizer leaves in that record. Its manifest
    is read as every manifest is, and each `.records/` part opened without following a
    link and checked against the manifest (size, sha256) before a record of it is
    yielded; OutputError (one line) for an output without records or a part that is not
    the one listed. One part is held at a time."""
    from raycap.output.faults import OutputError
    from raycap.output.manifest import read_manifest, read_records_part

    manifest = read_manifest(output)
    if manifest.records is None:
        raise OutputError(
            f"{output} holds no finalized records (it was written by a rebuild, or is a stream's step of rollouts "
            "given by id); finalize a results file into an output, or submit records to a stream, to read records back"
        )
    for part in manifest.records.parts:
        data = read_records_part(output, part)
        lines = list(iter_lines(data))
        if len(lines) != part.records:
            raise OutputError(
                f"{output}/{part.name} holds {len(lines)} records where its manifest says {part.records}; "
                "restore it, or finalize the output again"
            )
        del data
        for line in lines:
            yield loads_line(line)


def write_records_file(output: str | os.PathLike, target: str | os.PathLike, manifest: Any = None) -> int:
    """Write the finalized records of `output` as one results file at `target`, durably
    (a temp file beside it, fsync, rename: a link at `target` is replaced, never written
    through); the number of records written. `manifest` is the output's manifest when
    the caller has read it already."""
    from raycap.output.manifest import read_manifest, stream_records_part

    if manifest is None:
        manifest = read_manifest(output)
    if manifest.records is None:
        raise ValueError(f"{output} holds no finalized records")
    return write_records(target, manifest, lambda part, write: stream_records_part(output, part, write))


def write_records(target: str | os.PathLike, manifest: Any, stream: Callable[[Any, Callable[[Any], Any]], None]) -> int:
    """`write_records_file` of a manifest's records, each part's bytes passed on by
    `stream(part, write)` (`raycap.output.backend.Backend.stream_part`, which raises
    before the file is renamed into place when a part is not the one listed)."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_fault(target, exc) from None

    def write(handle: BinaryIO) -> None:
        for part in manifest.records.parts:
            stream(part, handle.write)

    replace_durably(target, write, direct=True)
    return manifest.records.records

