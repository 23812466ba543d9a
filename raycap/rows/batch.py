"""One batch of rollouts, from frozen parts to Arrow rows: the work of a builder task.

A batch is the rollouts one builder task builds; `batch_size` sets it. The Ray driver
sends each builder task a batch of consecutive rollout ids and, for every capture
directory that may hold them, that directory's freezes; the local executor does the same
in-process. This module is what both run, so the rows cannot depend on where they were
built.

Containment is the rule: whatever goes wrong with one rollout (freezing, parsing,
building, projection, conversion to Arrow) is that rollout's masked row, and every other
row of the batch is exactly what it would be alone. Conversion is tried for the whole
batch at once (the fast path) and, only if that fails, rollout by rollout, so a rollout
whose ids are valid records but do not fit the int64 columns masks itself alone.

Expected masks are not news: a batch of a million rollouts with 5% masked must not print
fifty thousand pydantic reports. Each masked rollout logs one short line at debug level;
`verbose=True` logs each one's whole reason as a warning (which worker processes forward)
and lets the single-rollout layer's detailed warnings through.

This module does not import Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa

from raycap.capture.consumer import RolloutBuild, build_frozen, error_text, failed_build
from raycap.capture.freezebatch import CHUNK_ROLLOUTS
from raycap.capture.maskreasons import CAPTURE_INCOMPLETE
from raycap.capture.outcomes import FreezeFailed, Part, as_part
from raycap.capture.spares import Spares
from raycap.capture.store import FrozenCapture, TokenCaptureStore, is_valid_rollout_id
from raycap.observe import timing
from raycap.rows.arrow import CHAIN_SCHEMA, ROLLOUT_SCHEMA, builds_to_table, chains_to_table, with_versions
from raycap.rows.chains import ChainsBuild, build_frozen_chains, failed_chains
from raycap.rows.collector import collector_paused
from raycap.rows.options import DELIVERIES as DELIVERIES
from raycap.rows.options import MAX_CAPTURE_BYTES as MAX_CAPTURE_BYTES

logger = logging.getLogger(__name__)


# The single-rollout layer warns about every masked build, as the spec's consumer does.
_DETAIL_LOGGERS = ("raycap.capture.consumer", "raycap.rows.chains")

def schema_of(delivery: str, version_key: str | None = None) -> pa.Schema:
    """The row schema of a delivery; with a version key, plus the version columns."""
    schema = CHAIN_SCHEMA if delivery == "chains" else ROLLOUT_SCHEMA
    return schema if version_key is None else with_versions(schema)


def empty_rows(delivery: str, version_key: str | None = None) -> pa.Table:
    """A table of no rows in the delivery's schema. Not `Schema.empty_table`: pyarrow
    imports pandas for it, a third of a second in a process that has not yet."""
    return pa.Table.from_batches([], schema=schema_of(delivery, version_key))


def failed(rollout_id: str, builder: str, model: str, error: str, delivery: str) -> RolloutBuild | ChainsBuild:
    """The masked result of a rollout that could not be built, in the delivery's form."""
    if delivery == "chains":
        return failed_chains(rollout_id, builder, model, error)
    return failed_build(rollout_id, builder, model, error)


def failed_rows(
    rollout_ids: Sequence[str], dirs: Sequence[Sequence[str]], builder: str, model: str, error: str, delivery: str
) -> pa.Table:
    """One masked row per rollout, all carrying `error` (a batch that was lost as a whole)."""
    return to_table([failed(rid, builder, model, error, delivery) for rid in rollout_ids], dirs, delivery)


def to_table(
    builds: Sequence[RolloutBuild | ChainsBuild], dirs: Sequence[Sequence[str]], delivery: str,
    version_key: str | None = None,
) -> pa.Table:
    if delivery == "chains":
        return chains_to_table(builds, dirs, version_key=version_key)
    return builds_to_table(builds, dirs, version_key=version_key)


def _rollout_of(build: RolloutBuild | ChainsBuild) -> RolloutBuild:
    return build.rollout if isinstance(build, ChainsBuild) else build


def _unconvertible(build: RolloutBuild | ChainsBuild, exc: BaseException, delivery: str) -> RolloutBuild | ChainsBuild:
    """The masked stand-in for a build whose rows could not be made; it keeps the
    snapshot identity (evidence), and masked rows are never retired."""
    rollout = _rollout_of(build)
    if isinstance(exc, OverflowError):
        error = (
            f"OverflowError: rollout {rollout.rollout_id} holds token ids that are valid records but do not "
            "fit the int64 token columns of the Arrow table; it is masked, its capture is kept"
        )
    else:
        error = f"{error_text(exc)} (converting rollout {rollout.rollout_id} to Arrow rows)"
    masked = dataclasses.replace(
        failed_build(rollout.rollout_id, rollout.builder, rollout.model, error, rollout.metrics.n_calls),
        snapshots=rollout.snapshots,
        incomplete=rollout.incomplete,
    )
    return ChainsBuild(masked, [], True) if delivery == "chains" else masked


def contained_table(
    builds: Sequence[RolloutBuild | ChainsBuild], dirs: Sequence[Sequence[str]], delivery: str,
    version_key: str | None = None,
) -> pa.Table:
    """The rows of `builds`; a build whose conversion fails becomes its own masked row."""
    try:
        return to_table(builds, dirs, delivery, version_key)
    except Exception:  # noqa: BLE001 - find the culprit below; the rest stay as they are
        pass
    tables = []
    for build, where in zip(builds, dirs):
        try:
            tables.append(to_table([build], [where], delivery, version_key))
        except Exception as exc:  # noqa: BLE001 - one rollout never sinks its batch
            stand_in = _unconvertible(build, exc, delivery)
            logger.warning("rollout %s: %s", stand_in_id(stand_in), _rollout_of(stand_in).error)
            tables.append(to_table([stand_in], [where], delivery, version_key))
    return pa.concat_tables(tables) if tables else empty_rows(delivery, version_key)


def stand_in_id(build: RolloutBuild | ChainsBuild) -> str:
    return _rollout_of(build).rollout_id


class _Masking:
    """The detail loggers' levels while builds of this process silence them: the first
    build to start saves and raises them, the last to end restores them. (Builds run on
    several threads at once: each saving and restoring on its own could save another's
    raised level and leave the loggers silenced for good.)"""

    lock = threading.Lock()
    builds = 0
    saved: list[tuple[str, int]] = []


@contextmanager
def _mask_logging(verbose: bool) -> Iterator[None]:
    """Silence the per-rollout detail warnings unless verbose; restore them after."""
    if verbose:
        logging.getLogger("raycap").setLevel(logging.DEBUG)
        yield
        return
    with _Masking.lock:
        if _Masking.builds == 0:
            _Masking.saved = [(name, logging.getLogger(name).level) for name in _DETAIL_LOGGERS]
            for name, _ in _Masking.saved:
                logging.getLogger(name).setLevel(logging.ERROR)
        _Masking.builds += 1
    try:
        yield
    finally:
        with _Masking.lock:
            _Masking.builds -= 1
            if _Masking.builds == 0:
                for name, level in _Masking.saved:
                    logging.getLogger(name).setLevel(level)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 200 else line[:197] + "..."


def _log_mask(build: RolloutBuild | ChainsBuild, verbose: bool) -> None:
    rollout = _rollout_of(build)
    masked = build.rollout_mask_sample if isinstance(build, ChainsBuild) else rollout.mask_sample
    if not masked:
        return
    reason = rollout.error or ", ".join(rollout.mask_reasons) or (CAPTURE_INCOMPLETE if rollout.incomplete else "")
    if verbose:
        # Asked for: the whole reason, at a level a worker process forwards.
        logger.warning("rollout %s masked: %s", rollout.rollout_id, reason)
    elif logger.isEnabledFor(logging.DEBUG):
        logger.debug("rollout %s masked: %s", rollout.rollout_id, _first_line(reason))


@timing.timed("build")
def build_batch(
    rollout_ids: Sequence[str],
    parts: Sequence[Sequence[tuple[str, FrozenCapture | FreezeFailed]]],
    *,
    builder: str,
    model: str,
    delivery: str,
    verbose: bool = False,
    version_key: str | None = None,
    models: Sequence[str] | None = None,
) -> pa.Table:
    """The rows of a batch, or of the part of one read at a time: `parts[i]` lists
    (directory label, freeze or failed freeze) of every directory holding rollout i.
    Rows come in the order of `rollout_ids`; with a `version_key`, they carry the
    version columns (`raycap.rows.arrow`). `models[i]`, when given, is rollout i's model
    (a finalized record names its own), else every rollout's is `model`."""
    build_one = build_frozen_chains if delivery == "chains" else build_frozen
    timing.add("bytes_read", sum(p.size for held in parts for _, p in held if isinstance(p, FrozenCapture)))
    builds, dirs = [], []
    with collector_paused(), _mask_logging(verbose):
        for position, (rollout_id, held) in enumerate(zip(rollout_ids, parts)):
            own = model if models is None else models[position]
            failure = next((p for _, p in held if isinstance(p, FreezeFailed)), None)
            if not isinstance(rollout_id, str):
                # An invalid id's masked row still needs a text id for its column.
                rollout_id = repr(rollout_id)
            try:
                if failure is not None:
                    build = failed(rollout_id, builder, own, failure.error, delivery)
                else:
                    build = build_one(rollout_id, held, builder=builder, model=own)
            except Exception as exc:  # noqa: BLE001 - one rollout never sinks its batch
                build = failed(rollout_id, builder, own, error_text(exc), delivery)
            _log_mask(build, verbose)
            builds.append(build)
            dirs.append([label for label, _ in held])
        return contained_table(builds, dirs, delivery, version_key)


class IpcTable:
    """A batch's rows leaving a builder task as one Arrow IPC stream.

    Pickled as one Arrow IPC stream in an out-of-band buffer, unpickled as the pa.Table
    itself, zero-copy from the object store. Ray's own reducer for tables would do the
    same job column by column, but it calls pyarrow.compute with Python scalars, which
    makes pyarrow import pandas: half a second on every worker's first batch."""

    def __init__(self, table: pa.Table):
        self.table = table

    def __reduce_ex__(self, protocol: int) -> tuple:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.table.schema) as writer:
            writer.write_table(self.table)
        data = sink.getvalue()
        return _unship, (pickle.PickleBuffer(data) if protocol >= 5 else data.to_pybytes(),)


def _unship(data: Any) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


# --- a batch from its directories: freezing, and reading a bounded amount at a time -------------

READ_BYTES = 256 << 20
# A capture smaller than this is read while it is frozen, under the same lock; larger
# ones are read at most READ_BYTES at a time, so a batch never holds them all.
READ_WITH_FREEZE_BYTES = 1 << 20
# The largest capture (JSONL bytes, per directory) a build reads; a larger one is its
# masked row, judged before any of it is read. A build peaks at a few times its capture,
# so 1 GiB leaves room for a builder per core on a machine of a few tens of GiB. The
# `max_capture_bytes` keyword and job config key raise or lower it (None: no limit).
def cut(sizes: Sequence[int], target: int, most: int) -> list[list[int]]:
    """The positions of `sizes`, cut into consecutive lists of about `target` bytes and
    at most `most` items."""
    out: list[list[int]] = [[]]
    filled = 0
    for position, size in enumerate(sizes):
        if out[-1] and (filled + size > target or len(out[-1]) >= most):
            out.append([])
            filled = 0
        out[-1].append(position)
        filled += size
    return out if out[0] else []


@timing.timed("freeze")
def freeze_in(
    store: TokenCaptureStore,
    rollout_ids: list[str],
    *,
    held_only: bool,
    max_bytes: int | None = MAX_CAPTURE_BYTES,
    spares: Spares | None = None,
) -> list[Part]:
    """Freezes (identity and size; the bytes of small captures) of `rollout_ids` in one
    local directory; with held_only, None for an id the directory does not hold
    (freezing would create it). An invalid id is held nowhere, so it is frozen in the
    first directory, where the store refuses it: that rollout's masked row, no other's."""
    try:
        held = store.held([r for r in rollout_ids if is_valid_rollout_id(r)]) if held_only else None
    except Exception as exc:  # noqa: BLE001 - reported per rollout
        return [FreezeFailed(error_text(exc))] * len(rollout_ids)
    wanted = [i for i, rid in enumerate(rollout_ids) if held is None or (is_valid_rollout_id(rid) and rid in held)]
    frozen = store.freeze_many(
        [rollout_ids[i] for i in wanted], read=False, read_below=READ_WITH_FREEZE_BYTES, max_bytes=max_bytes,
        spares=spares,
    )
    out: list[Part] = [None] * len(rollout_ids)
    for i, part in zip(wanted, frozen):
        out[i] = as_part(part)
    return out


@timing.timed("freeze")
def freeze_and_build(
    store: TokenCaptureStore,
    rollout_ids: list[str],
    label: str,
    *,
    max_bytes: int | None,
    spares: Spares | None = None,
    **build: Any,
) -> pa.Table:
    """Freeze a batch in one local directory and build it, as `freeze_in` and then
    `read_and_build` would, but building while the freezes' state files are being made
    durable: the rows come from the bytes read under the freezes' locks, and are returned
    only once every freeze is durable. A freeze that failed to become durable is rebuilt
    as its masked row. A batch that does not fit this (more rollouts than one chunk of
    locks, a busy lock, a capture too large to read under the lock) is frozen first.
    `spares`: spare files to make the freezes' files from (`raycap.capture.spares`)."""
    if len(rollout_ids) > CHUNK_ROLLOUTS:
        frozen = freeze_in(store, rollout_ids, held_only=False, max_bytes=max_bytes)
        return read_and_build(rollout_ids, [label], [frozen], lambda _, parts: read_in(store, parts), **build)
    freezing = store.freezing(
        rollout_ids, read=False, read_below=READ_WITH_FREEZE_BYTES, max_bytes=max_bytes, spares=spares
    )
    try:
        early = [None if part is None else as_part(part) for part in freezing.frozen]
        if freezing.complete and all(not isinstance(p, FrozenCapture) or p.size == len(p.data) for p in early):
            table = build_batch(rollout_ids, [[(label, p)] for p in early], **build)
        else:
            table = None  # built below, from the durable freezes read again
    finally:
        final = [as_part(part) for part in freezing.finish()]
    if table is not None and all(a is b or a == b for a, b in zip(early, final)):
        return table
    return read_and_build(rollout_ids, [label], [final], lambda _, parts: read_in(store, parts), **build)


def read_in(store: TokenCaptureStore, batch: list[Part]) -> list[Part]:
    """`batch` with the bytes of its freezes read from a local directory."""
    out = list(batch)
    for i, part in enumerate(batch):
        if isinstance(part, FrozenCapture) and part.size > len(part.data):
            try:
                out[i] = dataclasses.replace(part, data=store.read_frozen(part))
            except Exception as exc:  # noqa: BLE001 - reported per rollout
                out[i] = FreezeFailed(error_text(exc))
    return out


@timing.timed("read")
def read_and_build(
    rollout_ids: list[str],
    labels: Sequence[str],
    frozen: Sequence[list[Part]],
    read: Callable[[int, list[Part]], list[Part]],
    *,
    builder: str,
    model: str,
    delivery: str,
    verbose: bool = False,
    version_key: str | None = None,
    models: Sequence[str] | None = None,
) -> pa.Table:
    """Build a batch whose source k froze `frozen[k][i]` of rollout i (None: not held
    there), reading the bytes with `read(k, parts)`: it reads at most READ_BYTES of
    captures at a time, so a batch of large rollouts never holds all its bytes at once.
    `models` as for `build_batch`."""
    sizes = [
        sum(batch[i].size for batch in frozen if isinstance(batch[i], FrozenCapture) and batch[i].size > 0)
        for i in range(len(rollout_ids))
    ]
    tables = []
    for positions in cut(sizes, READ_BYTES, len(rollout_ids)):
        parts: list[list[tuple[str, Any]]] = [[] for _ in positions]
        for k, (label, batch) in enumerate(zip(labels, frozen)):
            for j, part in enumerate(read(k, [batch[i] for i in positions])):
                if part is not None:
                    parts[j].append((label, part))
        tables.append(
            build_batch(
                [rollout_ids[i] for i in positions], parts, builder=builder, model=model, delivery=delivery,
                verbose=verbose, version_key=version_key, models=None if models is None else [models[i] for i in positions],
            )
        )
    if not tables:
        return empty_rows(delivery, version_key)
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
