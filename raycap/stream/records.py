"""Records a stream takes: a finished result record in, its row's record columns and its finalized record out.

By NeMo Gym's rules, through raycap's one implementation of them:

- `parse_submitted`, `submitted`: a submit's ids and records, read before anything is
  touched; the rollout a record names (Gym's rule), or why it is refused.
- `encode`: the record as it is kept beside its capture (`raycap.capture.recordfile`),
  written as Gym's collection writes records, so it reads back as the same value.
- `row_values`, `with_records`: the record columns of SPEC 10.7 and the row's `model`,
  set on every row of the rollout when it is taken.
- `finalize`: what Gym's `finalize_rollout_token_capture` leaves in the record
  (`raycap.capture.delivery.apply_build`), from the rollout's row read back: a stale
  mask masks the row, not the record.
- `record_lines`, `record_counts`: the finalized records as a step's records part.
- `keep_records`, `kept_records`: the directories' side, wherever it runs.

The rules in full: docs/internals.md ("Records a stream takes"). No Ray.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raycap.capture.delivery import apply_build, maybe_rollout_id_from_run_body, record_model, rollout_carries_token_ids
from raycap.capture.maskreasons import record_reasons
from raycap.capture.recordfile import MAX_RECORD_BYTES, KeptRecord, RecordFileError
from raycap.capture.records import loads_line
from raycap.capture.store import validate_rollout_id
from raycap.finalize.batch import plan_of
from raycap.finalize.results import ResultsError, dumps_exactly
from raycap.output.recordparts import RecordCounts
from raycap.rows.arrow import RECORD_COLUMNS, builds_from_table, record_columns
from raycap.rows.columns import column

LABEL = "the records submitted"
# The columns a record sets on its rollout's rows when it is taken.
VALUE_COLUMNS = (*RECORD_COLUMNS, ("model", pa.string()))


def submitted(record: Any) -> tuple[str | None, str | None]:
    """The rollout `record` names, and why a stream refuses it (None: it does not)."""
    plan = plan_of(record)
    if plan.error is not None:
        return None, plan.error
    if plan.rollout_id is None:
        return None, (
            "its response already carries token ids and it names no rollout (no capture key): Gym's finalizer leaves "
            "it as it is, and there is no capture to build; train on its own token ids"
        )
    try:
        validate_rollout_id(plan.rollout_id)
    except ValueError as exc:
        return plan.rollout_id, str(exc)
    return plan.rollout_id, None


def encode(record: Any, index: int) -> KeptRecord:
    """`record`, the item at `index` of a submit, as it is kept; ValueError (one line)
    when it cannot be (see the module docstring)."""
    try:
        data = dumps_exactly(record, LABEL, index)
    except (ResultsError, RecursionError) as exc:
        raise ValueError(str(exc)) from None
    kept = KeptRecord(index, data)
    size = len(kept.to_bytes())
    if size > MAX_RECORD_BYTES:
        raise ValueError(
            f"record {index} of {LABEL} takes {size} bytes as JSON, more than a kept record's {MAX_RECORD_BYTES}; "
            "submit its rollout id instead"
        )
    return kept


@dataclass
class Given:
    """What a submit gave, read before anything is touched: the valid rollout ids in
    order, each once (`ids`); the record each rollout was given with (`records`); where
    a refusal of each rollout is reported (`keys`: its id, or `record <i>` when a record
    named it); and what was refused already, with why."""

    ids: list[str] = field(default_factory=list)
    records: dict[str, KeptRecord] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def parse_submitted(items: Sequence[Any]) -> Given:
    """A submit's items (ids and records, checked for their types), read: an invalid id
    is refused under its own text, a record under `record <i>` (i its position), for the
    reasons of `submitted` and `encode`, or because an earlier record of the same submit
    names its rollout with other content (the same record twice is one)."""
    given = Given()
    for position, item in enumerate(items):
        if isinstance(item, str):
            try:
                validate_rollout_id(item)
            except ValueError as exc:
                given.refused[item] = str(exc)
                continue
            given.keys.setdefault(item, item)
            given.ids.append(item)
            continue
        key = f"record {position}"
        rid, why = submitted(item)
        kept = None
        if why is None:
            try:
                kept = encode(item, position)
            except ValueError as exc:
                why = str(exc)
        if why is not None or rid is None or kept is None:
            given.refused[key] = why or "it names no rollout"
            continue
        first = given.records.setdefault(rid, kept)
        if first.data != kept.data:
            given.refused[key] = (
                f"record {first.index} of this submit is another record of rollout {rid}; give each rollout one record"
            )
            continue
        given.keys[rid] = f"record {first.index}"
        given.ids.append(rid)
    given.ids = list(dict.fromkeys(given.ids))
    return given


def decode(kept: KeptRecord) -> Any:
    """A fresh copy of the kept record (finalizing writes into it)."""
    return loads_line(kept.data)


def checked(rollout_id: str, kept: KeptRecord) -> KeptRecord:
    """`kept`, read from `rollout_id`'s record file, if it is a record of that rollout;
    RecordFileError otherwise (it was damaged, or put there by hand)."""
    try:
        named = maybe_rollout_id_from_run_body(decode(kept))
    except Exception as exc:  # noqa: BLE001 - any failure: not a record a stream kept for this rollout
        named = f"nothing readable ({type(exc).__name__})"
    if named != rollout_id:
        raise RecordFileError(
            f"the record file of rollout {rollout_id} holds a record of {named!r}, not of {rollout_id}, so a stream "
            "did not write it: remove it, or delete() the rollout"
        )
    return kept


def row_values(kept: KeptRecord) -> dict[str, Any]:
    """The values a kept record sets on its rollout's rows (`VALUE_COLUMNS`)."""
    record = decode(kept)
    return {**record_columns(record, kept.index), "model": record_model(record)}


def with_records(table: pa.Table, counts: Sequence[int], values: Sequence[Mapping[str, Any] | None]) -> pa.Table:
    """`table` (consecutive rows per rollout, `counts[i]` of rollout i) with the record
    columns and model of each rollout that has `values` set on all of its rows; the
    other rows are left as they are."""
    if not any(v is not None for v in values):
        return table
    if sum(counts) != table.num_rows:
        raise ValueError(f"{sum(counts)} rows counted for a table of {table.num_rows}")
    for name, kind in VALUE_COLUMNS:
        index = table.schema.get_field_index(name)
        current = table.column(index).to_pylist()
        at = 0
        for count, value in zip(counts, values):
            if value is not None:
                current[at : at + count] = [value[name]] * count
            at += count
        table = table.set_column(index, table.schema.field(index), column(current, kind))
    return table


@dataclass(frozen=True)
class Finalized:
    """A record as Gym's finalizer leaves it (`record`), and its outcome: `kind`
    ("rebuilt", or "redundant" when its response carries token ids and it is left as it
    is), whether it is masked, and the reasons a collection counts."""

    rollout_id: str
    record: Any
    kind: str
    masked: bool = False
    reasons: list[str] = field(default_factory=list)


def finalize(kept: KeptRecord, rollout_id: str, build: Mapping[str, Any]) -> Finalized:
    """What Gym's finalizer leaves in the kept record, given the rollout's
    single-response build dict (see the module docstring)."""
    record = decode(kept)
    if rollout_carries_token_ids(record):
        return Finalized(rollout_id, record, "redundant")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the masks are the rows' and the summary's to say
        built = apply_build(record, rollout_id, dict(build))
    masked = bool(built.get("mask_sample"))
    return Finalized(rollout_id, record, "rebuilt", masked, record_reasons(built) if masked else [])


def finalize_rows(kept: Mapping[str, KeptRecord], *tables: pa.Table) -> list[Finalized]:
    """`finalize` for each rollout of `kept`, from its single-response row in `tables`
    (rollout delivery: its one row; wherever the rows are, on Ray too)."""
    rows = pa.concat_tables(tables) if len(tables) != 1 else tables[0]
    rows = rows.filter(pc.is_in(rows.column("rollout_id"), pa.array(list(kept), pa.string())))
    builds = {build["rollout_id"]: build for build in builds_from_table(rows)}
    missing = [rid for rid in kept if rid not in builds]
    if missing:
        raise ValueError(f"no row of rollout {missing[0]} to finalize its record from ({len(missing)} such rollouts)")
    return [finalize(record, rid, builds[rid]) for rid, record in kept.items()]


def record_lines(finalized: Sequence[Finalized]) -> list[bytes]:
    """The finalized records as a records part's lines (as Gym's collection writes them)."""
    return [dumps_exactly(f.record, LABEL, i) for i, f in enumerate(finalized)]


def record_counts(finalized: Sequence[Finalized]) -> RecordCounts:
    """The outcomes of the finalized records, counted as a collection counts them."""
    counts = RecordCounts()
    for f in finalized:
        counts.count_outcome(f.kind, f.masked, f.reasons)
    return counts


# --- a stream's directories: keeping and reading the records ------------------------------------


def keep_records(stores: Mapping[str, Any], held: Mapping[str, Any], records: Mapping[str, KeptRecord]) -> dict[str, str]:
    """Keep each record in the first of `stores` (by label, in the stream's order) that
    holds its rollout (`held`: per label, the ids it holds), before the rollout is
    frozen (`raycap.capture.store.TokenCaptureStore.write_record`); the rollouts whose record
    was not kept, with why (their rollout is then not frozen)."""
    refused: dict[str, str] = {}
    for rid, kept in records.items():
        first = next((label for label in stores if rid in held[label]), None)
        if first is None:
            continue  # held nowhere: refused as any id is
        try:
            why = stores[first].write_record(rid, kept)
        except (OSError, ValueError) as exc:
            why = f"its record could not be kept in {first} ({type(exc).__name__}: {exc})"
        if why is not None:
            refused[rid] = why
    return refused


def kept_records(stores: Mapping[str, Any], ids: Sequence[str]) -> tuple[dict[str, KeptRecord], dict[str, str]]:
    """The records kept for `ids` (in the first of `stores` holding one), and the ids
    whose record file is damaged, with why (`checked`): those are held back."""
    found: dict[str, KeptRecord] = {}
    damaged: dict[str, str] = {}
    for rid in ids:
        for store in stores.values():
            try:
                kept = store.read_record(rid)
                if kept is not None:
                    found[rid] = checked(rid, kept)
            except (OSError, ValueError) as exc:
                damaged[rid] = str(exc)
                kept = None
            if kept is not None or rid in damaged:
                break
    return found, damaged
