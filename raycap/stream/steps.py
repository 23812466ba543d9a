"""A stream's rows: stale masks, the stream's schema, rows cut by rollout, and a step
dataset written in the rebuild job's format.

The stream (`raycap.runs.stream`) keeps what it built as `Built` pieces: rows built in this
process are tables; rows built on Ray stay in the object store, and only their metadata
(`META_COLUMNS`) comes to the driver. `describe`, `assemble` and `write_step` run beside
those rows as small Ray tasks (`ray_task`), so a taker of refs and a step's commit never
pull rows through the driver. `mask_stale` is the one rule for staleness, applied alike
to whole rows and to their metadata.

A step is identified by its rows' snapshots (`row_keys`: rollout id, real directory,
snapshot id, version), never by rollout ids alone: a recycled id names another capture.
A stream whose directories are not in its process (`NODE:/path`) never resolves them:
its keys leave the directory out (`real_dirs=False`), since a snapshot id is a fresh
uuid4 of one freeze in one directory, and a node named another way after a restart
must not make a committed snapshot look new.
`check_step` takes an existing step for a commit's own only when it holds exactly the
commit's snapshots (a retried commit), and refuses anything else there (`StepRefused`);
`committed_parts` is what recovery reads to tell whether a marker's step holds its snapshot.
A step output is a path or a `raycap.output.location.Location` (`s3://...`): on an object store
the step is committed as every output is there (`raycap.output.objectstore.writes`), and reading a
committed step for recovery finishes its roll-forward first (the stream is its writer).

This module does not import Ray; `ray_task` loads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raycap.output.faults import OutputError
from raycap.output.location import Location, as_location
from raycap.output.protocol import backend_of
from raycap.rows.arrow import VERSION_COLUMNS

# What this process needs of rows built on Ray: identity and snapshots (to commit and
# retire), the verdict (masked rollouts are kept) and what staleness reads and writes.
META_COLUMNS = (
    "rollout_id", "snapshots", "mask_sample", "error", "mask_reasons", "rollout_mask_sample", "weight", "version_min",
)
from raycap.capture.consumer import SnapshotRef
from raycap.capture.maskreasons import STALE
from raycap.errors import (
    PiecesLost,  # noqa: F401 - raised here, declared with the others
    StepRefused,  # noqa: F401 - raised here, declared with the others
)


@dataclass
class Built:
    """One built rollout. Built on this process: `table` is its rows. Built on Ray:
    its rows stay in the object store, rows `offset`..+`rows` of the batch table `ref`,
    and `table` holds only their metadata (`META_COLUMNS`)."""

    rollout_id: str
    table: pa.Table
    nbytes: int
    ref: Any = None
    offset: int = 0
    # The record kept for the rollout when it was built (`raycap.capture.recordfile.KeptRecord`).
    record: Any = None

    @property
    def rows(self) -> int:
        return self.table.num_rows


# A directory's snapshot of a taken rollout (what a drop needs): the one snapshot type.
SnapshotPart = SnapshotRef


def conform(table: pa.Table, schema: pa.Schema, version_key: str | None) -> pa.Table:
    """`table` in the stream's schema: a batch lost as a whole comes back as masked rows
    without the version columns, which are null for it."""
    if version_key is None or table.schema.equals(schema, check_metadata=False):
        return table
    for name, kind in VERSION_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(pa.field(name, kind), pa.nulls(table.num_rows, kind))
    return table.select(schema.names).cast(schema)


def mask_stale(table: pa.Table, oldest: int | None) -> tuple[pa.Table, int]:
    """`table` with the rows whose `version_min` is below `oldest` masked as stale (the
    reason appended, and weight 0 in chain delivery), and how many rollouts that hit.
    Works on whole rows and on their metadata columns alike, so the masks computed here
    for rows that stay on Ray are the ones their assembly applies."""
    if oldest is None or "version_min" not in table.column_names or not table.num_rows:
        return table, 0
    stale = pc.fill_null(pc.less(table.column("version_min"), oldest), False)
    if not pc.any(stale).as_py():
        return table, 0
    flags = stale.to_pylist()
    ids = table.column("rollout_id").to_pylist()
    hit = {rid for rid, flag in zip(ids, flags) if flag}
    reasons = [
        (list(r or []) + [STALE]) if flag else r
        for r, flag in zip(table.column("mask_reasons").to_pylist(), flags)
    ]
    columns = {
        "mask_sample": pc.or_(pc.fill_null(table.column("mask_sample"), True), stale),
        "mask_reasons": pa.array(reasons, pa.list_(pa.string())),
    }
    if "rollout_mask_sample" in table.column_names:
        columns["rollout_mask_sample"] = pc.or_(
            pc.fill_null(table.column("rollout_mask_sample"), True), pa.array([rid in hit for rid in ids])
        )
        columns["weight"] = pc.if_else(stale, 0.0, table.column("weight"))
    for name, values in columns.items():
        index = table.column_names.index(name)
        table = table.set_column(index, table.schema.field(name), values)
    return table, len(hit)


def write_step(inputs: Any, out: Location, ids: list[str], snapshots: frozenset, real_dirs: bool, *tables: pa.Table,
               records: tuple[list[bytes], Any] | None = None) -> None:
    """The rows of `ids` in `tables` as one committed dataset at `out` (the rebuild
    job's format: a shard, the manifest, an atomic rename). `snapshots` is what the
    step holds (`row_keys`, with `real_dirs`): a step committed before with exactly
    these (a retried commit) is left as it is; anything else at `out` is refused
    (`check_step`). `records` (their lines and `raycap.output.recordparts.RecordCounts`) are
    the step's finalized records, written as its `.records/` part and listed in its
    manifest, as `raycap.finalize_rollouts` writes them."""
    from raycap.output.commit import StagedOutput
    from raycap.output.recordparts import RecordsManifest, write_records_part
    from raycap.output.shards import write_shard

    if check_step(out, snapshots, real_dirs=real_dirs):
        return  # this step was committed before (a retried commit): its rows are durable
    rows = pa.concat_tables(tables)
    if set(rows.column("rollout_id").to_pylist()) != set(ids):
        rows = rows_of(rows, ids)
    with StagedOutput(out, inputs=inputs, schema=inputs.delivery) as staged:
        shard = write_shard(staged.staging, 0, rows)
        manifest = None
        if records is not None:
            lines, counts = records
            part = write_records_part(staged.staging, 0, lines, first_index=0, records=len(lines))
            manifest = RecordsManifest((part,), counts)
        staged.commit([shard], records=manifest)


def check_step(out: Location, snapshots: frozenset, *, real_dirs: bool = True) -> bool:
    """Whether the step output `out` (parsed once, by the stream) already holds exactly
    `snapshots` (a retried commit, nothing to write); False when nothing is there.
    StepRefused (one line) when something else is: a committed step of other rollouts,
    or of other snapshots of the same ids (a reused step directory, whose rows must never
    be taken for this commit's), or anything that is not a committed dataset."""
    if backend_of(out).empty(out):
        return False  # nothing there, or an empty directory: the commit replaces it
    return _held(out, snapshots, real_dirs)


def _held(out: Location, snapshots: frozenset, real_dirs: bool) -> bool:
    try:
        held = step_snapshots(out, real_dirs=real_dirs)
    except OutputError as exc:
        raise StepRefused(f"step output {out} already exists and {exc}; nothing was committed or retired: give each "
                          "step its own new directory") from None
    if held is None:
        raise StepRefused(
            f"step output {out} already exists and is not a committed raycap dataset; nothing was committed or "
            "retired: give each step its own new directory"
        )
    if held != snapshots:
        other = len({rid for rid, _ in held ^ snapshots})
        raise StepRefused(
            f"step output {out} is already committed with other rows ({other} rollouts differ in id or snapshot: "
            "a reused step directory); nothing was committed or retired: give each step its own new directory"
        )
    return True


def row_keys(table: pa.Table, *, real_dirs: bool = True) -> frozenset:
    """What identifies the rows of `table` for a commit: each row's rollout id with its
    exact snapshots (real directory, snapshot id, version), never the id alone, since a
    recycled id names another capture. Without `real_dirs` the directory is "" (see
    the module docstring)."""
    real: dict[str, str] = {}
    return frozenset(
        (row["rollout_id"], key_parts(row["snapshots"], real, real_dirs))
        for row in table.select(["rollout_id", "snapshots"]).to_pylist()
    )


def key_parts(snapshots: list[dict] | None, real: dict[str, str], real_dirs: bool) -> tuple:
    """One row's snapshots as its key's parts (`row_keys`); `real` caches resolved
    directories."""
    parts = []
    for s in snapshots or []:
        label = s["capture_dir"]
        if label not in real:
            real[label] = os.path.realpath(label) if real_dirs else ""
        parts.append((real[label], s["snapshot_id"], s["version"]))
    return tuple(sorted(parts))


def step_snapshots(output: Location, *, real_dirs: bool = True) -> frozenset | None:
    """The `row_keys` of a committed output, read shard by shard from two small
    columns; None when nothing is committed there. OutputError when a shard cannot be
    read: a link or a FIFO planted as a shard is refused, never followed or waited on.
    A step on an object store is rolled forward first, if its commit was cut short; a
    store that cannot be asked is an OutputError, never "nothing committed" (which would
    deliver committed rows again)."""
    backend = backend_of(output)
    if not backend.has_manifest(output):
        return None
    keys: set = set()
    try:
        manifest = backend.manifest(output)
        backend.finish(output, manifest)
        for path in backend.shards(output, manifest):
            keys |= row_keys(backend.read_table(path, ["rollout_id", "snapshots"]), real_dirs=real_dirs)
    except (OutputError, OSError, ValueError, pa.ArrowException, KeyError, TypeError) as exc:
        # A manifest naming shards outside the output, or a link or FIFO planted as a shard.
        raise OutputError(f"the shards of {output} cannot be read ({type(exc).__name__}: {exc})") from None
    return frozenset(keys)


def step_holds(cache: dict[str, Any], output: str, rollout_id: str, label: str, snapshot_id: str, version: int, *,
               real_dirs: bool = True) -> bool:
    """Whether the committed step `output` holds a row of `rollout_id` with exactly this
    snapshot part (its directory `label`, resolved as `row_keys` does). `cache` keeps
    each step's parts for the calls of one pass; OutputError when the step cannot be
    read (then whether it holds the row cannot be told)."""
    if output not in cache:
        cache[output] = committed_parts(output, real_dirs=real_dirs)
    held = cache[output]
    where = os.path.realpath(label) if real_dirs else ""
    return held is not None and (rollout_id, where, snapshot_id, version) in held


def committed_parts(output: str | os.PathLike | Location, *, real_dirs: bool = True) -> set[tuple[str, str, str, int]] | None:
    """(rollout id, real directory or "", snapshot id, version) of every snapshot part a
    committed output holds a row of; None when nothing is committed there. `output` is
    a step as a commit marker names it (its text), parsed here, once."""
    keys = step_snapshots(as_location(output), real_dirs=real_dirs)
    return None if keys is None else {(rid, *part) for rid, parts in keys for part in parts}


def describe(table: pa.Table, schema: pa.Schema, version_key: str | None) -> tuple[pa.Table, list[int]]:
    """On Ray, beside a built batch: its metadata columns, and each rollout's bytes."""
    table = conform(table, schema, version_key)
    pieces = split_by_rollout(table)
    meta = table.select([c for c in META_COLUMNS if c in table.column_names])
    return meta, [piece.get_total_buffer_size() for _, piece in pieces]


def assemble(schema: pa.Schema, version_key: str | None, slices: list[tuple[int, int, int]], oldest: int | None,
              *batches: pa.Table, values: list[dict | None] | None = None) -> pa.Table:
    """On Ray: the taken rollouts' rows, sliced out of their batches, with the record
    columns of the rollouts taken with a record (`values`, one per slice:
    `raycap.stream.records.with_records`), masks applied."""
    from raycap.stream.records import with_records

    tables = [conform(b, schema, version_key) for b in batches]
    rows = pa.concat_tables([tables[b].slice(offset, length) for b, offset, length in slices])
    if values is not None:
        rows = with_records(rows, [length for _, _, length in slices], values)
    return mask_stale(rows, oldest)[0]


def batch_slices(pieces: list[Built]) -> list[Any]:
    """The `assemble` arguments after `oldest`: (batch, offset, rows) per piece, then
    the distinct batch refs (Ray resolves them to tables where the task runs)."""
    batches = list(dict.fromkeys(p.ref for p in pieces))
    return [(batches.index(p.ref), p.offset, p.rows) for p in pieces], batches


_REMOTES: dict[str, Any] = {}


def ray_task(name: str) -> Any:
    """The Ray remote function `name`, made on first use (the stream imports without Ray)."""
    if name not in _REMOTES:
        import ray

        from raycap.stream.records import finalize_rows

        functions = {"describe": describe, "assemble": assemble, "write_step": write_step, "finalize_rows": finalize_rows}
        # No CPU reserved: these are small and on the latency path, and must not queue
        # behind the builder tasks for a slot.
        _REMOTES[name] = ray.remote(num_cpus=0)(functions[name])
    return _REMOTES[name]


def split_by_rollout(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """Consecutive rows of one rollout as one piece (chain delivery has several)."""
    ids = table.column("rollout_id").to_pylist()
    pieces = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            pieces.append((ids[start], table.slice(start, i - start)))
            start = i
    return pieces


def rows_of(rows: pa.Table, ids: list[str]) -> pa.Table:
    return rows.filter(pc.is_in(rows.column("rollout_id"), pa.array(ids, pa.string())))
