"""Durable handoff: rebuilt rows are complete on disk before any capture is retired.

`ParquetOutput` streams Arrow tables into a temporary file next to the output
(`.NAME.partial`, in the same directory so the rename cannot cross file systems),
fsyncs it, renames it into place and fsyncs the directory. A reader sees either no
output or the whole of it; a crash at any point leaves at most the partial file, which
the next run truncates and rewrites. Only a committed output may be used to retire
snapshots, and `iter_retirable` reads the rows to retire back from that file, so no
snapshot is dropped whose row is not durable.

The output's Parquet key-value metadata records the inputs that produced it (`Inputs`:
capture directories, rollout ids, builder, model) and their fingerprint. A rerun with the
same inputs reuses the file instead of rebuilding, because rollouts retired by the first
run can no longer be rebuilt, and then finishes the retirement, which is safe to repeat.
An existing output with a different fingerprint, or none, is refused unless overwriting
was asked for: it may be another run's result that nobody has consumed yet.

Memory stays flat: tables are written as they arrive, buffered only up to one row group.

This module does not import Ray.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from raycap.arrow import RETIRE_COLUMNS, ROLLOUT_SCHEMA

FINGERPRINT_KEY = b"raycap.fingerprint"
INPUTS_KEY = b"raycap.inputs"
ROW_GROUP_BYTES = 64 << 20


class OutputError(RuntimeError):
    """The output cannot be written or reused; the message is one line with the way out."""


@dataclass(frozen=True)
class Inputs:
    """What a rebuild reads. Two runs with equal inputs produce the same rows, because
    freezing is idempotent; rollout_ids None means every rollout the directories list."""

    capture_dirs: tuple[str, ...]
    rollout_ids: tuple[str, ...] | None
    builder: str
    model: str
    delivery: str = "rollout"

    def _canonical(self) -> dict[str, Any]:
        canonical = {
            "capture_dirs": list(self.capture_dirs),
            "rollout_ids": None if self.rollout_ids is None else list(self.rollout_ids),
            "builder": self.builder,
            "model": self.model,
        }
        if self.delivery != "rollout":  # rollout-delivery fingerprints stay as they were
            canonical["delivery"] = self.delivery
        return canonical

    def fingerprint(self) -> str:
        text = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        """The inputs as recorded for people reading the file: ids are counted, not listed."""
        described = self._canonical()
        described["rollout_ids"] = "all listed" if self.rollout_ids is None else f"{len(self.rollout_ids)} given"
        return described

    def metadata(self) -> dict[bytes, bytes]:
        return {
            FINGERPRINT_KEY: self.fingerprint().encode(),
            INPUTS_KEY: json.dumps(self.describe(), sort_keys=True).encode(),
        }


@dataclass(frozen=True)
class Written:
    """A committed output: its rows, its size on disk and the Arrow bytes that went in."""

    path: Path
    rows: int
    file_bytes: int
    arrow_bytes: int


def partial_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def summary_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.summary.json")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recorded_fingerprint(path: str | os.PathLike) -> str | None:
    """The fingerprint an output file records, or None when it records none."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(
            f"output {path} exists but is not a readable Parquet file ({exc}); "
            "move it away or set overwrite: true"
        ) from None
    value = metadata.get(FINGERPRINT_KEY)
    return value.decode() if value is not None else None


def check_output(path: str | os.PathLike, inputs: Inputs, *, overwrite: bool = False) -> bool:
    """Decide before any work whether `path` is reused (True) or written (False).

    Reused when it exists and records the same inputs. Otherwise the directory is
    created if needed and probed for writability, so a bad output fails the job before
    anything is built."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"output {path} is a directory; give the path of the Parquet file to write")
    if path.exists():
        recorded = recorded_fingerprint(path)
        if recorded == inputs.fingerprint():
            return True
        if not overwrite:
            what = "different inputs" if recorded else "no raycap fingerprint"
            raise OutputError(
                f"output {path} already exists and was written from {what} (capture dirs, rollout ids, "
                "builder, model or delivery differ); choose another output or set overwrite: true to replace it"
            )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(
            f"cannot write output {path}: {exc.strerror or exc} ({exc.filename or path.parent}); "
            "choose a writable output directory"
        ) from None
    return False


class ParquetOutput:
    """One output file written durably: `write` tables, then `commit`, or `abort`.

    Holds an exclusive lock on the partial file while writing, so two runs given the same
    output cannot interleave their rows."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        metadata: dict[bytes, bytes] | None = None,
        schema: pa.Schema = ROLLOUT_SCHEMA,
        row_group_bytes: int = ROW_GROUP_BYTES,
    ) -> None:
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.schema = schema.with_metadata({**(schema.metadata or {}), **(metadata or {})})
        self.row_group_bytes = row_group_bytes
        self.rows = 0
        self.arrow_bytes = 0
        self._pending: list[pa.Table] = []
        self._pending_bytes = 0
        try:
            # Not O_TRUNC: truncating before holding the lock would wreck a running writer's file.
            fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot create {self.partial}: {exc.strerror or exc}; choose a writable output directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"another run is writing {self.path} (its partial file {self.partial} is locked); "
                "wait for it or choose another output"
            ) from None
        os.ftruncate(fd, 0)  # what a crashed run left behind is rebuilt, never appended to
        self._file = os.fdopen(fd, "wb")
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self._file, self.schema)

    def __enter__(self) -> "ParquetOutput":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._writer is not None or not self._file.closed:
            self.abort()

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            raise OutputError(f"output {self.path} was already committed or aborted")
        if not table.schema.equals(self.schema, check_metadata=False):
            raise OutputError(f"table for {self.path} does not match the output schema: {table.schema}")
        self.rows += table.num_rows
        self.arrow_bytes += table.nbytes
        self._pending.append(table)
        self._pending_bytes += table.nbytes
        if self._pending_bytes >= self.row_group_bytes:
            self._flush_row_group()

    def _flush_row_group(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending)
        self._pending, self._pending_bytes = [], 0
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))

    def commit(self) -> Written:
        """Make the output durable under its final name: fsync, rename, fsync the directory."""
        if self._writer is None:
            raise OutputError(f"output {self.path} was already committed or aborted")
        self._flush_row_group()
        self._writer.close()
        self._writer = None
        self._file.flush()
        os.fsync(self._file.fileno())
        os.replace(self.partial, self.path)
        _fsync_dir(self.path.parent)
        file_bytes = os.fstat(self._file.fileno()).st_size
        self._file.close()  # releases the lock, now on the committed file
        return Written(self.path, self.rows, file_bytes, self.arrow_bytes)

    def abort(self) -> None:
        """Discard the partial file (the output, if any, is left as it was)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the file is being thrown away
                pass
            self._writer = None
        if not self._file.closed:
            self.partial.unlink(missing_ok=True)
            self._file.close()


def write_durably(
    path: str | os.PathLike,
    tables: Iterable[pa.Table],
    *,
    metadata: dict[bytes, bytes] | None = None,
    schema: pa.Schema = ROLLOUT_SCHEMA,
) -> Written:
    """Stream `tables` into `path` durably; on any error the output is left untouched."""
    with ParquetOutput(path, metadata=metadata, schema=schema) as out:
        for table in tables:
            out.write(table)
        return out.commit()


def iter_retirable(path: str | os.PathLike, *, batch_rows: int = 8192) -> Iterator[pa.Table]:
    """The committed output's rows, only the columns retirement needs, in bounded batches.

    A batch never splits a rollout's rows (chain delivery has several per rollout): the
    retirement verdict needs all of them."""
    parquet = pq.ParquetFile(path)
    carry: pa.Table | None = None
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=list(RETIRE_COLUMNS)):
        table = pa.Table.from_batches([batch])
        if carry is not None:
            table = pa.concat_tables([carry, table])
        ids = table.column("rollout_id")
        last = ids[len(ids) - 1].as_py()
        cut = len(ids)
        while cut > 0 and ids[cut - 1].as_py() == last:
            cut -= 1
        if cut == 0:
            carry = table  # one rollout so far; keep reading
            continue
        carry = table.slice(cut)
        yield table.slice(0, cut)
    if carry is not None and carry.num_rows:
        yield carry


def write_json_durably(path: str | os.PathLike, value: Any) -> None:
    """Replace `path` atomically with `value` as indented JSON (temp file, fsync, rename)."""
    path = Path(path)
    data = (json.dumps(value, indent=2, sort_keys=False) + "\n").encode()
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)



def output_rollout_ids(path: str | os.PathLike) -> set[str]:
    """The rollout ids a committed output holds (read from its one small column)."""
    return set(pq.read_table(path, columns=["rollout_id"]).column("rollout_id").to_pylist())


def rejected_path(path: str | os.PathLike) -> Path:
    """Where an output that failed the mask check is kept for inspection."""
    path = Path(path)
    return path.with_name(path.name + ".rejected")


def set_aside(path: str | os.PathLike) -> Path:
    """Move a committed output (and its summary) out of the consumers' way, durably."""
    path = Path(path)
    target = rejected_path(path)
    os.replace(path, target)
    summary = summary_path(path)
    if summary.exists():
        os.replace(summary, summary_path(target))
    _fsync_dir(path.parent)
    return target
