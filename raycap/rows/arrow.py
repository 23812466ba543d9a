"""Builds as Arrow rows: the table schema, declared once, and the way back to build dicts.

- One row per rollout. The delivered chain is stored once, training-ready: `token_ids`,
  `loss_mask` (1 on generated positions) and `logprobs`; each call keeps what is needed
  to rebuild `rebuilt_response` exactly, never the per-call prompt copies.
- Failed and masked rollouts are rows too, with `mask_sample`, the reason in `error` or
  `mask_reasons`, and their snapshot identity.
- A row built from a rollout record also carries `RECORD_COLUMNS` (`record_columns`,
  `with_record_columns`), null on every other row; further named fields are appended
  last (`record_field_type`, `with_record_fields`).
- With a `version_key`, rows gain `VERSION_COLUMNS` (`call_versions`, `version_min`,
  `version_max`); without one the schema is exactly ROLLOUT_SCHEMA / CHAIN_SCHEMA.
- `retirable` gives the snapshots a committed shard allows dropping.

The long form: docs/internals.md ("Rows as Arrow").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Iterable, Sequence

import numpy as np
import orjson
import pyarrow as pa

from raycap.capture.builder import ProjectedCall, Projection
from raycap.capture.consumer import Metrics, RolloutBuild, SnapshotRef
from raycap.capture.maskreasons import row_reasons, verdict_of
from raycap.capture.records import loads_line
from raycap.rows.columns import column, list_lengths, list_of, list_rows, primitive, valid

_SNAPSHOT = pa.struct([("capture_dir", pa.string()), ("snapshot_id", pa.string()), ("version", pa.int64())])

# The columns of a row built from a rollout record (a results file's line; SPEC 10.7),
# after the build's own: null on every row not built from a record, so that every output
# of one kind shares one schema. `record_columns` reads them from a record.
RECORD_COLUMNS = (
    ("reward", pa.float64()),
    ("task_index", pa.int64()),
    ("rollout_index", pa.int64()),
    ("attempt_index", pa.int64()),
    ("agent_name", pa.string()),
    ("record_index", pa.int64()),
)
RECORD_NAMES = tuple(name for name, _ in RECORD_COLUMNS)

METRIC_COLUMNS = (
    ("n_calls", pa.int64()),
    ("chains", pa.int64()),
    ("roots", pa.int64()),
    ("quarantined_calls", pa.int64()),
    ("quarantined_fraction", pa.float64()),
    ("delivered_fraction", pa.float64()),
    ("generated_tokens_captured", pa.int64()),
    ("generated_tokens_delivered", pa.int64()),
    ("empty_generation_calls", pa.int64()),
)

ROLLOUT_SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("capture_dirs", pa.list_(pa.string())),
        ("builder", pa.string()),
        ("model", pa.string()),
        ("mask_sample", pa.bool_()),
        ("error", pa.string()),
        ("mask_reasons", pa.list_(pa.string())),
        *METRIC_COLUMNS,
        ("capture_incomplete", pa.bool_()),
        ("unresolved_retries", pa.list_(pa.string())),
        ("snapshot_id", pa.string()),
        ("snapshot_version", pa.int64()),
        ("snapshots", pa.list_(_SNAPSHOT)),
        ("token_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float64())),
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("call_ids", pa.list_(pa.string())),
        ("call_gen_start", pa.list_(pa.int64())),
        ("call_gen_end", pa.list_(pa.int64())),
        ("call_carriers", pa.list_(pa.list_(pa.int32()))),
        ("call_output_items", pa.list_(pa.string())),
        ("call_routed_experts", pa.list_(pa.string())),
        *RECORD_COLUMNS,
    ]
)


CHAIN_COLUMNS = (
    ("chain_id", pa.string()),
    ("chain_index", pa.int64()),
    ("n_chains", pa.int64()),
    ("is_main", pa.bool_()),
    ("weight", pa.float64()),
    ("rollout_mask_sample", pa.bool_()),
)

# Chain delivery: the rollout columns (the verdict and reasons are the chain's own; the
# metrics and snapshot identity the rollout's) plus the chain's identity and weight.
CHAIN_SCHEMA = pa.schema([*ROLLOUT_SCHEMA, *(pa.field(name, kind) for name, kind in CHAIN_COLUMNS)])


VERSION_COLUMNS = (
    ("call_versions", pa.list_(pa.int64())),
    ("version_min", pa.int64()),
    ("version_max", pa.int64()),
)
VERSION_NAMES = tuple(name for name, _ in VERSION_COLUMNS)


def with_versions(schema: pa.Schema) -> pa.Schema:
    """`schema` with the version columns appended (see the module docstring)."""
    return pa.schema([*schema, *(pa.field(name, kind) for name, kind in VERSION_COLUMNS)])


def without_versions(schema: pa.Schema) -> pa.Schema:
    """`schema` with any version columns removed: the delivery schema it extends."""
    return pa.schema([f for f in schema if f.name not in VERSION_NAMES])


def _version_of(value) -> int | None:
    # A version is an integer; anything else (a string, a fractional number, a bool,
    # which JSON would let through as 0 or 1) is no version rather than a guessed one.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _call_versions(build: RolloutBuild, version_key: str) -> dict[str, int | None]:
    """The version of every call of the build's chains, by model call id."""
    chains = build.build.chains if build.build is not None else []
    return {
        link.entry.model_call_id: _version_of((link.entry.model_extra or {}).get(version_key))
        for chain in chains
        for link in chain.links
    }


def _version_values(projection: Projection | None, by_call: dict[str, int | None]) -> dict:
    if projection is None:
        return {"call_versions": None, "version_min": None, "version_max": None}
    versions = [by_call.get(call.model_call_id) for call in projection.calls]
    known = [v for v in versions if v is not None]
    if not known:
        return {"call_versions": None, "version_min": None, "version_max": None}
    return {"call_versions": versions, "version_min": min(known), "version_max": max(known)}


def fill_call_versions(values: np.ndarray, known: np.ndarray | None, starts, ends, versions) -> None:
    """Write each call's version over its generated span into one row's `values` (and
    mark those positions in `known`): one slice per call, never a loop over tokens.
    A span outside the row raises ValueError: the row is damaged."""
    for start, end, version in zip(starts or [], ends or [], versions or []):
        if version is None or (isinstance(version, float) and np.isnan(version)):
            continue
        if not 0 <= int(start) <= int(end) <= len(values):
            raise ValueError(
                f"a call's generated span {start}..{end} lies outside the row's {len(values)} tokens; the row is damaged"
            )
        values[int(start) : int(end)] = int(version)
        if known is not None:
            known[int(start) : int(end)] = True


def token_versions(table: pa.Table) -> pa.Array:
    """Per-token policy versions of rows with the version columns: list<int64> aligned
    with `token_ids`, each generated position holding the version of the call that
    generated it (its `call_gen_start`..`call_gen_end` span) and every other position
    (prompt, tool output, a call without a version) null. A row without a trajectory is
    null. This is what a trainer bounding staleness per token reads."""
    tokens = table.column("token_ids").combine_chunks()
    present = valid(tokens)
    lengths = list_lengths(tokens)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    values = np.zeros(int(bounds[-1]), dtype=np.int64)
    known = np.zeros(len(values), dtype=bool)
    rows = zip(
        table.column("call_gen_start").to_pylist(),
        table.column("call_gen_end").to_pylist(),
        table.column("call_versions").to_pylist(),
    )
    for row, (starts, ends, versions) in enumerate(rows):
        at, end = int(bounds[row]), int(bounds[row + 1])
        fill_call_versions(values[at:end], known[at:end], starts, ends, versions)
    validity = None if known.all() else pa.py_buffer(np.packbits(known, bitorder="little"))
    child = pa.Array.from_buffers(pa.int64(), len(values), [validity, pa.py_buffer(values)], int((~known).sum()))
    return list_of([True if p else None for p in present], lengths, child)


# --- the columns a rollout record gives its row (SPEC 10.7) ----------------------------------


def _int64_or_none(value: Any) -> int | None:
    # JSON's true and false are no index, and an index must fit the column.
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if -(1 << 63) <= value < (1 << 63) else None


def _number_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _text_or_none(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        return None  # a lone surrogate (JSON allows one escaped) is no Arrow string
    return value


def record_columns(record: Any, index: int) -> dict[str, Any]:
    """The RECORD_COLUMNS values of the row built from `record`, the record at position
    `index` of its results file or iterable: `reward` (the top-level reward, when a
    number), `task_index`, `rollout_index`, `attempt_index` (`_ng_task_index`,
    `_ng_rollout_index`, `_ng_attempt_index`, when integers), `agent_name`
    (`agent_ref.name`, when a string) and `record_index`; None where the record has no
    such value."""
    get = record.get if isinstance(record, Mapping) else (lambda _key: None)
    agent = get("agent_ref")
    return {
        "reward": _number_or_none(get("reward")),
        "task_index": _int64_or_none(get("_ng_task_index")),
        "rollout_index": _int64_or_none(get("_ng_rollout_index")),
        "attempt_index": _int64_or_none(get("_ng_attempt_index")),
        "agent_name": _text_or_none(agent.get("name")) if isinstance(agent, Mapping) else None,
        "record_index": index,
    }


def with_record_columns(table: pa.Table, values: Sequence[Mapping[str, Any]]) -> pa.Table:
    """`table` with its RECORD_COLUMNS set from `values` (`record_columns` of each row's
    record, in row order)."""
    if len(values) != table.num_rows:
        raise ValueError(f"{len(values)} records for {table.num_rows} rows")
    for name, kind in RECORD_COLUMNS:
        index = table.schema.get_field_index(name)
        table = table.set_column(index, table.schema.field(index), column([v[name] for v in values], kind))
    return table


# The Arrow type of a `record_fields` value, by its JSON type; null is no type.
_FIELD_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
FIELD_TYPE_NAMES = {"bool": pa.bool_(), "int64": pa.int64(), "double": pa.float64(), "string": pa.string(), "null": pa.null()}


def record_field_type(value: Any) -> pa.DataType | None:
    """The Arrow type a record field carried by name (`record_fields`) takes from
    `value`: bool, int64, float64 (JSON's double) or string; None for null. ValueError
    for a value no scalar column holds (an object, an array, an integer beyond int64)."""
    if value is None:
        return None
    kind = _FIELD_TYPES.get(type(value))
    if kind is None:
        what = {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)
        raise ValueError(f"is {what}, and record_fields carries scalar fields only (bool, integer, number, string)")
    if kind == pa.int64() and _int64_or_none(value) is None:
        raise ValueError(f"is the integer {value}, which does not fit int64")
    if kind == pa.string() and _text_or_none(value) is None:
        raise ValueError("is a string holding a lone surrogate, which no Arrow string holds")
    return kind


def with_record_fields(table: pa.Table, types: Mapping[str, pa.DataType], values: Mapping[str, Sequence[Any]]) -> pa.Table:
    """`table` with one column appended per `record_fields` field, in the order of
    `types` (the type each field has across the output), from `values` (per field, in
    row order)."""
    for name, kind in types.items():
        if kind == pa.null():
            array = pa.nulls(table.num_rows)
        else:
            array = column(list(values[name]), kind)
        table = table.append_column(pa.field(name, kind), array)
    return table


def _dumps(value) -> str:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        # orjson refuses integers beyond 64 bits and NaN-free guarantees; json keeps them.
        return json.dumps(value)


def mask_reasons(build: RolloutBuild) -> list[str]:
    """Why a row is masked (`raycap.capture.maskreasons.row_reasons`)."""
    return row_reasons(build.error, build.mask_reasons, build.incomplete)


def _list_array(arrays: Sequence[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """A list column from per-row numpy arrays (None = null row) without per-item Python work."""
    present = [a for a in arrays if a is not None and len(a)]
    # Token ids beyond int64 (object arrays) raise OverflowError here: the caller masks
    # that rollout alone.
    values = np.concatenate(present) if present else np.empty(0)
    lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int64)
    return list_of(arrays, lengths, primitive(values, value_type))


class _Rows:
    """Column builder shared by both deliveries: one call of `add` per row."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.columns: dict[str, list] = {name: [] for name in schema.names}
        self.tokens: list[np.ndarray | None] = []
        self.masks: list[np.ndarray | None] = []
        self.logprobs: list[np.ndarray | None] = []

    def add(
        self,
        build: RolloutBuild,
        dirs: Sequence[str],
        *,
        mask: bool,
        error: str | None,
        reasons: list[str],
        projection: Projection | None,
        usage: dict | None,
        extra: dict | None = None,
    ) -> None:
        columns = self.columns
        columns["rollout_id"].append(build.rollout_id)
        columns["capture_dirs"].append(list(dirs))
        columns["builder"].append(build.builder)
        columns["model"].append(build.model)
        columns["mask_sample"].append(mask)
        columns["error"].append(error)
        columns["mask_reasons"].append(reasons)
        for name, _ in METRIC_COLUMNS:
            columns[name].append(getattr(build.metrics, name))
        columns["capture_incomplete"].append(build.incomplete)
        columns["unresolved_retries"].append(None if build.error is not None else list(build.unresolved_retries or []))
        first = build.snapshots[0] if build.snapshots else None
        columns["snapshot_id"].append(first.snapshot_id if first else None)
        columns["snapshot_version"].append(first.version if first else None)
        columns["snapshots"].append(
            [{"capture_dir": s.capture_dir, "snapshot_id": s.snapshot_id, "version": s.version} for s in build.snapshots]
        )
        for name in RECORD_NAMES:
            columns[name].append(None)  # filled by `with_record_columns` for rows built from records
        for name, value in (extra or {}).items():
            columns[name].append(value)
        if projection is None:
            self.tokens.append(None)
            self.masks.append(None)
            self.logprobs.append(None)
            for name in _CALL_COLUMNS:
                columns[name].append(None)
            return
        self.tokens.append(projection.token_ids)
        self.masks.append(projection.loss_mask)
        self.logprobs.append(projection.log_probs)
        columns["input_tokens"].append(usage["input_tokens"])
        columns["output_tokens"].append(usage["output_tokens"])
        calls = projection.calls
        columns["call_ids"].append([c.model_call_id for c in calls])
        columns["call_gen_start"].append([c.gen_start for c in calls])
        columns["call_gen_end"].append([c.gen_end for c in calls])
        columns["call_carriers"].append([list(c.carriers) for c in calls])
        columns["call_output_items"].append([_dumps(c.output_items) for c in calls])
        columns["call_routed_experts"].append(
            [None if c.routed_experts is None else _dumps(c.routed_experts) for c in calls]
        )

    def table(self) -> pa.Table:
        arrays = []
        for field in self.schema:
            if field.name == "token_ids":
                arrays.append(_list_array(self.tokens, pa.int64()))
            elif field.name == "loss_mask":
                arrays.append(_list_array(self.masks, pa.int8()))
            elif field.name == "logprobs":
                arrays.append(_list_array(self.logprobs, pa.float64()))
            else:
                arrays.append(column(self.columns[field.name], field.type))
        return pa.Table.from_arrays(arrays, schema=self.schema)


_CALL_COLUMNS = (
    "input_tokens",
    "output_tokens",
    "call_ids",
    "call_gen_start",
    "call_gen_end",
    "call_carriers",
    "call_output_items",
    "call_routed_experts",
)


def _dirs(build: RolloutBuild, capture_dirs: Sequence[Sequence[str]] | None, i: int) -> list[str]:
    return list(capture_dirs[i]) if capture_dirs is not None else [s.capture_dir for s in build.snapshots]


def builds_to_table(
    builds: Iterable[RolloutBuild], capture_dirs: Sequence[Sequence[str]] | None = None, *, version_key: str | None = None
) -> pa.Table:
    """Single-response delivery: one row per rollout, in ROLLOUT_SCHEMA (with the
    version columns when `version_key` is given)."""
    rows = _Rows(ROLLOUT_SCHEMA if version_key is None else with_versions(ROLLOUT_SCHEMA))
    for i, build in enumerate(builds):
        ok = build.error is None
        projection = build.projection if ok else None
        rows.add(
            build,
            _dirs(build, capture_dirs, i),
            mask=build.mask_sample,
            error=build.error,
            reasons=mask_reasons(build),
            projection=projection,
            usage=build.usage if ok else None,
            extra=None if version_key is None else _version_values(projection, _call_versions(build, version_key)),
        )
    return rows.table()


def chains_to_table(
    builds: Iterable, capture_dirs: Sequence[Sequence[str]] | None = None, *, version_key: str | None = None
) -> pa.Table:
    """Chain delivery: one row per chain (raycap.rows.chains.ChainsBuild), in CHAIN_SCHEMA
    (with the version columns when `version_key` is given).

    A rollout without any chain gives exactly one masked row carrying its reason."""
    rows = _Rows(CHAIN_SCHEMA if version_key is None else with_versions(CHAIN_SCHEMA))
    for i, chains_build in enumerate(builds):
        build = chains_build.rollout
        dirs = _dirs(build, capture_dirs, i)
        by_call = {} if version_key is None else _call_versions(build, version_key)
        if not chains_build.rows:
            extra = {"chain_id": None, "chain_index": None, "n_chains": 0, "is_main": False, "weight": 0.0,
                     "rollout_mask_sample": True}
            if version_key is not None:
                extra.update(_version_values(None, by_call))
            rows.add(build, dirs, mask=True, error=build.error, reasons=mask_reasons(build), projection=None,
                     usage=None, extra=extra)
            continue
        for row in chains_build.rows:
            extra = {
                "chain_id": row.chain_id,
                "chain_index": row.chain_index,
                "n_chains": len(chains_build.rows),
                "is_main": row.is_main,
                "weight": row.weight,
                "rollout_mask_sample": chains_build.rollout_mask_sample,
            }
            if version_key is not None:
                extra.update(_version_values(row.projection, by_call))
            rows.add(build, dirs, mask=row.masked, error=row.error, reasons=list(row.reasons),
                     projection=row.projection, usage=row.usage, extra=extra)
    return rows.table()


def row_to_build(row: dict, token_ids: np.ndarray | None, log_probs: np.ndarray | None, loss_mask: np.ndarray | None) -> RolloutBuild:
    """The typed build of one table row (scalar columns as a dict, token columns as arrays)."""
    metrics = Metrics(**{name: row[name] for name, _ in METRIC_COLUMNS})
    snapshots = tuple(SnapshotRef(s["capture_dir"], s["snapshot_id"], s["version"]) for s in row["snapshots"] or [])
    build = RolloutBuild(
        row["rollout_id"],
        row["builder"],
        row["model"],
        metrics,
        error=row["error"],
        snapshots=snapshots,
        incomplete=bool(row["capture_incomplete"]),
    )
    if row["error"] is not None:
        return build
    build.unresolved_retries = list(row["unresolved_retries"] or [])
    build.mask_reasons = verdict_of(row["mask_reasons"])
    build.usage = {"input_tokens": row["input_tokens"], "output_tokens": row["output_tokens"]}
    calls = []
    for i, call_id in enumerate(row["call_ids"]):
        routed = row["call_routed_experts"][i]
        calls.append(
            ProjectedCall(
                call_id,
                loads_line(row["call_output_items"][i].encode()),
                None if routed is None else loads_line(routed.encode()),
                row["call_gen_start"][i],
                row["call_gen_end"][i],
                tuple(row["call_carriers"][i]),
            )
        )
    build.projection = Projection(token_ids, log_probs, loss_mask, calls)
    return build


_TOKEN_COLUMNS = ("token_ids", "logprobs", "loss_mask")


def builds_from_table(table: pa.Table, as_text: Sequence[bool] | None = None) -> list[dict]:
    """Row by row, exactly the dicts `trajectories_for_rollout` returns for each rollout.

    For a chain-delivery table each row gives the dict of its own chain, projected as
    that chain's response (masked as the row is). Where `as_text[i]`, row i's response
    items hold their token arrays as orjson fragments (`raycap.rows.tokentext`): the same
    bytes when orjson writes them, without a Python list of each prompt."""
    from raycap.rows.tokentext import projection_text_items

    scalar_names = [name for name in table.column_names if name not in _TOKEN_COLUMNS]
    rows = table.select(scalar_names).to_pylist()
    arrays = {name: list_rows(table.column(name)) for name in _TOKEN_COLUMNS}
    chains = "chain_id" in table.column_names
    out = []
    for i, row in enumerate(rows):
        typed = row_to_build(row, arrays["token_ids"][i], arrays["logprobs"][i], arrays["loss_mask"][i])
        build = typed.to_build(projection_text_items) if as_text is not None and as_text[i] else typed.to_build()
        if chains:
            build["mask_sample"] = row["mask_sample"]
            build["_chain"] = {name: row[name] for name, _ in CHAIN_COLUMNS}
        out.append(build)
    return out


RETIRE_COLUMNS = ("rollout_id", "mask_sample", "error", "snapshots")


def retirable(table: pa.Table) -> list[tuple[str, str, str, int]]:
    """(capture_dir, rollout_id, snapshot_id, version) of every snapshot safe to drop.

    A rollout's snapshots are dropped only when every row of the rollout is successful
    and unmasked: its single row in rollout delivery, all of its chain rows in chain
    delivery. Masked and failed rollouts keep their evidence. The table must hold all rows
    of each rollout it mentions. (Rows built from records that name one rollout share its
    snapshot, so they share its verdict; a snapshot several rows allow is listed once.)"""
    rows = table.select(list(RETIRE_COLUMNS)).to_pylist()
    kept = {row["rollout_id"] for row in rows if row["mask_sample"] or row["error"] is not None}
    out: dict[tuple[str, str, str, int], None] = {}
    for row in rows:
        if row["rollout_id"] in kept:
            continue
        for part in row["snapshots"] or []:
            out[(part["capture_dir"], row["rollout_id"], part["snapshot_id"], part["version"])] = None
    return list(out)
