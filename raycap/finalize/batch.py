"""One batch of a results file, finalized: the work of a finalize task, on either executor.

A batch is consecutive lines of a results file (`raycap.finalize.results`).
`prepare_batch` parses them and finalizes every record exactly as NeMo Gym's
one-at-a-time finalizer does, through the same functions of `raycap.capture.delivery`
(`plan_record`, `apply_build`); the rollouts are frozen together and built with the
rebuild's code (`raycap.rows.batch`), and each record receives its row read back, so a
record and its row always say the same. Per record (SPEC 10.4):

- no usable rollout id or capture key: masked as unusable, no row;
- a response that carries token ids already: left as it is, its capture frozen only to
  be retired as redundant, no row;
- otherwise built: one row with the record's columns, the rebuilt response written in.

A rollout named by several records is frozen once and built for each. `write_batch`
writes the records, in input order, as the batch's records part and the rows as its
shard, into the staging area; records are written back as Gym writes them (orjson),
or by Python's json where orjson would not write the value back exactly.

The rules in full: docs/internals.md ("One batch of a results file"). No Ray.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from raycap.capture.consumer import error_text
from raycap.capture.delivery import RecordPlan, apply_build, mark_unusable, plan_record, redundant_build
from raycap.capture.outcomes import FreezeFailed, Part
from raycap.capture.records import _line_spans, parse_records, read_line
from raycap.capture.store import FrozenCapture
from raycap.finalize.results import ResultsBatch, ResultsError, dumps_record
from raycap.finalize.shelf import Handed
from raycap.output.recordparts import RecordCounts, RecordsPart, Snapshot, write_records_part
from raycap.output.shards import ShardInfo, write_shard
from raycap.rows.arrow import (
    FIELD_TYPE_NAMES,
    builds_from_table,
    record_columns,
    with_record_columns,
    with_record_fields,
)
from raycap.rows.batch import read_and_build
from raycap.rows.collector import collector_paused
from raycap.rows.columns import list_rows
from raycap.rows.options import RebuildOptions

# freeze(rollout_ids) -> per source, per id: its freeze there (see raycap.rows.batch).
Freeze = Callable[[list[str]], list[list[Part]]]
# read(source index, parts) -> the parts with their bytes read.
Read = Callable[[int, list[Part]], list[Part]]


@dataclass(frozen=True)
class FinalizedBatch:
    """What a finalize task reports: its shard (None when no record got a row), its
    records part, and the outcome counts of its records.

    In the process that wrote the part, `lines` are the lines it was written from, so a
    records file drafted there takes them instead of reading the part back
    (`raycap.finalize.recordsfile`). They never leave that process: a report pickled to
    another (a worker's reply, a task's result) carries None. A worker process hands them
    to its driver in a shared slot instead (`raycap.finalize.shelf`): `handed` is
    (slot, bytes) on the way, and the driver's `lines` the slot's `Handed` bytes."""

    index: int
    shard: ShardInfo | None
    part: RecordsPart
    counts: RecordCounts
    lines: Sequence[bytes] | Handed | None = field(default=None, repr=False, compare=False)
    handed: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "lines": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def parse_batch(data: bytes, batch: ResultsBatch, label: str) -> tuple[list[Any], list[bool]]:
    """The records of a batch's lines (whitespace-only lines are no records) and, for
    each, whether orjson read it; ResultsError naming the line for one that is not JSON."""
    records, exact = [], []
    for start, end in _line_spans(data):
        try:
            record, by_orjson = read_line(data[start:end])
        except ValueError as exc:
            line = batch.first_line + data.count(b"\n", 0, start)
            raise ResultsError(
                f"{label} line {line} (record {batch.first_index + len(records)}) is not JSON: {exc}; fix or remove "
                "that line and rerun"
            ) from None
        records.append(record)
        exact.append(by_orjson)
    if len(records) != batch.records:
        raise ResultsError(f"{label} changed while it was finalized (batch {batch.index} holds other lines); rerun")
    return records, exact


def plan_of(record: Any) -> RecordPlan:
    """`raycap.capture.delivery.plan_record`, where an id rule that raises otherwise (`int()` of
    an infinity) makes the record's id malformed too, so it masks that record alone."""
    try:
        return plan_record(record)
    except Exception as exc:  # noqa: BLE001 - an id rule that raises otherwise (int() of an infinity) masks the record alone
        return RecordPlan(None, error=f"malformed rollout id: {error_text(exc)}")


def _finite_rows(table: pa.Table) -> np.ndarray:
    """Per row, whether every log prob is finite (orjson writes NaN and infinities as null)."""
    finite = np.ones(table.num_rows, dtype=bool)
    for j, values in enumerate(list_rows(table.column("logprobs"))):
        if values is not None and len(values) and not np.isfinite(values).all():
            finite[j] = False
    return finite


def _redundant(rollout_id: str, parts: list[Part], labels: Sequence[str], read: Read) -> tuple[dict | None, tuple[Snapshot, ...]]:
    """The redundant build of a record carrying its own token ids, from its freezes (one
    per source; None where a source does not hold it), and the snapshots to retire; None
    when the finalizer's freeze would have failed (a freeze or a record that fails)."""
    held = [(k, part) for k, part in enumerate(parts) if part is not None]
    if not held or any(isinstance(part, FreezeFailed) for _, part in held):
        return None, ()
    snapshots = []
    for k, part in held:
        assert isinstance(part, FrozenCapture)
        (read_part,) = read(k, [part])
        if not isinstance(read_part, FrozenCapture):
            return None, ()
        try:
            parse_records(read_part.data, prompt_lists=False)  # the finalizer's freeze validates every record
        except Exception:  # noqa: BLE001 - as the finalizer: the capture is left in place
            return None, ()
        snapshots.append((labels[k], rollout_id, part.snapshot_id, part.version))
    first = held[0][1]
    assert isinstance(first, FrozenCapture)
    return redundant_build(first.snapshot_id, first.version), tuple(snapshots)


@dataclass
class PreparedBatch:
    """A batch finalized and not yet written: its records' lines, its rows, the snapshots
    its redundant records retire, and the outcome counts."""

    index: int
    first_index: int
    lines: list[bytes]
    rows: pa.Table
    redundant: list[Snapshot]
    counts: RecordCounts


@collector_paused()
def prepare_batch(
    data: bytes,
    batch: ResultsBatch,
    *,
    label: str,
    labels: Sequence[str],
    freeze: Freeze,
    read: Read,
    options: RebuildOptions,
    fields: Sequence[tuple[str, str]] = (),
) -> PreparedBatch:
    """Finalize one batch of a results file in memory (`data`: its lines, `batch`: where
    they are; `label` names the file in errors) against the capture directories `labels`
    (see the module docstring): its records' lines, its rows and its outcome counts, for
    `write_batch` to write. The cyclic collector stays paused while it runs
    (`raycap.rows.collector.collector_paused`): the batch's records and builds are acyclic."""
    records, exact = parse_batch(data, batch, label)
    plans = [plan_of(record) for record in records]
    wanted = list(dict.fromkeys(p.rollout_id for p in plans if p.error is None and p.rollout_id is not None))
    frozen = freeze(wanted) if wanted else [[] for _ in labels]  # type: ignore[arg-type]
    where = {rollout_id: i for i, rollout_id in enumerate(wanted)}

    built_at = [i for i, p in enumerate(plans) if p.error is None and not p.redundant]
    build_ids = [plans[i].rollout_id for i in built_at]
    table = read_and_build(
        build_ids,  # type: ignore[arg-type]
        labels,
        [[batch_parts[where[rid]] for rid in build_ids] for batch_parts in frozen],  # type: ignore[index]
        read,
        builder=options.builder,
        model=options.model,
        models=[plans[i].model for i in built_at],
        delivery="rollout",
        verbose=options.verbose,
    )
    finite = _finite_rows(table)
    # Records orjson writes back get their token arrays as text (`raycap.rows.tokentext`).
    as_text = [exact[i] and bool(finite[j]) for j, i in enumerate(built_at)]
    builds = builds_from_table(table, as_text=as_text)

    # The record's own fields, read before finalizing writes into it.
    rows = with_record_columns(table, [record_columns(records[i], batch.first_index + i) for i in built_at])
    if fields:
        types = {name: FIELD_TYPE_NAMES[kind] for name, kind in fields}
        rows = with_record_fields(rows, types, {name: [_field(records[i], name) for i in built_at] for name in types})

    counts = RecordCounts()
    redundant: list[Snapshot] = []
    row_of = {i: j for j, i in enumerate(built_at)}
    with warnings.catch_warnings():
        if not options.verbose:
            warnings.simplefilter("ignore")  # expected masks: the summary counts them
        for i, (record, plan) in enumerate(zip(records, plans)):
            if plan.error is not None:
                counts.count(mark_unusable(record, plan.error), kind="unusable")
            elif plan.redundant:
                built, snapshots = None, ()
                if plan.rollout_id is not None:
                    k_parts = [batch_parts[where[plan.rollout_id]] for batch_parts in frozen]
                    built, snapshots = _redundant(plan.rollout_id, k_parts, labels, read)
                redundant.extend(snapshots)
                counts.count(built, kind="redundant")
            else:
                j = row_of[i]
                counts.count(apply_build(record, plan.rollout_id, builds[j]), kind="rebuilt")  # type: ignore[arg-type]
                exact[i] = exact[i] and bool(finite[j])

    lines = []
    for i, (record, ok) in enumerate(zip(records, exact)):
        try:
            lines.append(dumps_record(record, exact=ok, label=label, index=batch.first_index + i))
        except ResultsError:
            j = row_of.get(i)
            if j is None or not as_text[j]:
                raise
            # orjson refused the record after all: the build again, with lists, as written before.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                apply_build(record, plans[i].rollout_id, builds_from_table(table.slice(j, 1))[0])  # type: ignore[arg-type]
            lines.append(dumps_record(record, exact=ok, label=label, index=batch.first_index + i))
    return PreparedBatch(batch.index, batch.first_index, lines, rows, list(dict.fromkeys(redundant)), counts)


def write_batch(prepared: PreparedBatch, staging: Any, keep_lines: bool = False) -> FinalizedBatch:
    """Write a prepared batch's records part and shard durably into `staging`. The part
    is written (and waited for on its fsync) on a thread while this one encodes the
    shard: the part is most of the batch's bytes. With `keep_lines`, the report keeps the
    lines for a records file drafted here (otherwise they go with the write)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-records-part") as writer:
        writing = writer.submit(
            write_records_part, staging, prepared.index, prepared.lines, first_index=prepared.first_index,
            records=len(prepared.lines), redundant=prepared.redundant,
        )
        rows = prepared.rows
        shard = write_shard(staging, prepared.index, rows) if rows.num_rows else None
        part = writing.result()
    return FinalizedBatch(prepared.index, shard, part, prepared.counts, prepared.lines if keep_lines else None)


def _field(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, dict) else None
