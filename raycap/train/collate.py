"""Rows to fixed-shape token batches: `collate` (one batch of rows) and `token_batches`
(a stream of row batches), packed first fit or padded one row per line.

- Rows that must not be trained on are left out: `mask_sample` true, or null (fail
  closed), or a row without tokens (a failed build). When the rows have no `mask_sample`
  column, every row is taken as given. A row whose token list is empty though its
  `mask_sample` is false has nothing to train on and says otherwise (a damaged row): it
  is left out too, and its rollout id is listed in `TokenBatch.empty_rows`.
- `pack=True` (default) packs several rows into one line, first fit in row order: a row
  goes into the first line with room for it, or a new line. `pack=False` pads: one row
  per line.
- A row longer than `seq_len` is never truncated (that would train on a cut trajectory
  whose loss mask no longer matches what was sampled): `too_long="error"` (default)
  raises ValueError naming the rollout, `too_long="skip"` leaves the row out and lists
  its rollout id in `TokenBatch.skipped`.

Rows are a pyarrow Table or RecordBatch, or the dict of columns
`Dataset.iter_batches(batch_format="numpy")` gives. The token copies are slices, never
Python loops over tokens.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa

from raycap.capture.untrusted import bounded_repr
from raycap.rows.arrow import fill_call_versions
from raycap.train.rewards import RECORD_FEED_COLUMNS, group_key, has_record_columns, own_group, reward_value
from raycap.train.tokenbatch import NO_VERSION, TokenBatch

TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs")
# What per-token versions are built from, when the rows have them (see `raycap.rows.arrow`).
VERSION_FEED_COLUMNS = ("call_gen_start", "call_gen_end", "call_versions")
# What collate reads: the token columns, plus the verdict, the id, the weight, the
# version spans and the record columns when present.
FEED_COLUMNS = ("rollout_id", "mask_sample", "weight", *TOKEN_COLUMNS, *VERSION_FEED_COLUMNS, *RECORD_FEED_COLUMNS)


@dataclass
class _Row:
    rollout_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    weight: float
    # Per-token versions (NO_VERSION where none); None when the batch has no versions.
    versions: np.ndarray | None = None
    reward: float | None = None
    group: str | None = None


def _column(batch: Any, name: str) -> list | None:
    """One column of a row batch as a list of per-row values (arrays stay numpy)."""
    if isinstance(batch, (pa.Table, pa.RecordBatch)):
        if name not in batch.schema.names:
            return None
        column = batch.column(name)
        if name in VERSION_FEED_COLUMNS:
            # A few values per row (one per call), and call_versions holds nulls that a
            # numpy view would turn into floats: plain lists keep None as None.
            return column.to_pylist()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            return _list_rows(column)
        return column.to_pylist()
    if isinstance(batch, Mapping):
        if name not in batch:
            return None
        return list(batch[name])
    raise TypeError(f"collate takes a pyarrow Table or RecordBatch or a dict of columns, not {type(batch).__name__}")


def _list_rows(column: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """A list column as one numpy view per row (None for null rows), via offsets."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[np.ndarray | None] = []
    for chunk in chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        out.extend(values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(chunk)))
    return out


def has_versions(batch: Any) -> bool:
    """Whether a row batch carries the version columns per-token versions need."""
    names = batch.schema.names if isinstance(batch, (pa.Table, pa.RecordBatch)) else batch
    return all(name in names for name in VERSION_FEED_COLUMNS)


def _token_versions(length: int, starts: Any, ends: Any, versions: Any) -> np.ndarray:
    """One row's per-token versions: each call's version over its generated span."""
    out = np.full(length, NO_VERSION, dtype=np.int64)
    if starts is None or ends is None or versions is None:
        return out  # no trajectory, or no call with a version
    fill_call_versions(out, None, list(starts), list(ends), list(versions))
    return out


def _rows(batch: Any) -> tuple[list[_Row], list[str]]:
    """The trainable rows of a batch, and the rollouts left out because their token list
    is empty though mask_sample calls them trainable."""
    columns = {name: _column(batch, name) for name in FEED_COLUMNS}
    versioned = all(columns[name] is not None for name in VERSION_FEED_COLUMNS)
    missing = [name for name in TOKEN_COLUMNS if columns[name] is None]
    if missing:
        raise ValueError(f"rows to collate need the columns {', '.join(TOKEN_COLUMNS)}; missing: {', '.join(missing)}")
    n = len(columns["token_ids"])
    ids = columns["rollout_id"] or [f"row {i}" for i in range(n)]
    masks = columns["mask_sample"]
    weights = columns["weight"]
    rewards, tasks = columns["reward"], columns["task_index"]
    rows, empty = [], []
    for i in range(n):
        tokens = columns["token_ids"][i]
        if (masks is not None and (masks[i] is None or bool(masks[i]))) or tokens is None:
            continue
        if not len(tokens):
            # Trainable by its verdict, yet nothing to train on: a damaged row, never fed.
            empty.append(str(ids[i]))
            continue
        loss_mask, logprobs = columns["loss_mask"][i], columns["logprobs"][i]
        if loss_mask is None or logprobs is None or not len(tokens) == len(loss_mask) == len(logprobs):
            raise ValueError(f"rollout {ids[i]}: token_ids, loss_mask and logprobs differ in length; the row is damaged")
        weight = 1.0 if weights is None or weights[i] is None else float(weights[i])
        versions = None
        if versioned:
            try:
                versions = _token_versions(
                    len(tokens), columns["call_gen_start"][i], columns["call_gen_end"][i], columns["call_versions"][i]
                )
            except ValueError as exc:
                raise ValueError(f"rollout {ids[i]}: {exc}") from None
        row = _Row(str(ids[i]), np.asarray(tokens), np.asarray(loss_mask), np.asarray(logprobs), weight, versions)
        if rewards is not None:
            row.reward = reward_value(rewards[i])
            row.group = group_key(None if tasks is None else tasks[i], row.rollout_id)
        rows.append(row)
    return rows, empty


class _Packer:
    """Places rows into lines of `seq_len` tokens (first fit, or one per line)."""

    def __init__(self, seq_len: int, *, pack: bool, too_long: str) -> None:
        seq_len = _count("seq_len", seq_len)
        if too_long not in ("error", "skip"):
            raise ValueError(f"too_long must be 'error' or 'skip', not {too_long!r}")
        self.seq_len, self.pack, self.too_long = seq_len, pack, too_long
        # Whether batches carry `versions` (`rewards` and `groups`): set once rows with
        # version (record) columns are seen.
        self.versioned = False
        self.rewarded = False
        self.lines: list[list[_Row]] = []
        self.free: list[int] = []
        self.skipped: list[str] = []
        self.empty: list[str] = []

    def fits(self, row: _Row) -> int | None:
        """The line this row goes into (len(lines) for a new one); None when too long."""
        if len(row.token_ids) > self.seq_len:
            if self.too_long == "error":
                raise ValueError(
                    f"rollout {row.rollout_id} has {len(row.token_ids)} tokens, more than seq_len {self.seq_len}; "
                    "raise seq_len, or pass too_long='skip' to leave such rows out (they are never truncated)"
                )
            return None
        if self.pack:
            for index, free in enumerate(self.free):
                if free >= len(row.token_ids):
                    return index
        return len(self.lines)

    def place(self, row: _Row, index: int) -> None:
        if index == len(self.lines):
            self.lines.append([])
            self.free.append(self.seq_len)
        self.lines[index].append(row)
        self.free[index] -= len(row.token_ids)

    def take(self, lines: int | None = None, pad_id: int = 0) -> TokenBatch:
        """The placed lines as arrays (padded with empty lines up to `lines`); resets."""
        count = len(self.lines) if lines is None else lines
        shape = (count, self.seq_len)
        batch = TokenBatch(
            token_ids=np.full(shape, pad_id, dtype=np.int64),
            loss_mask=np.zeros(shape, dtype=np.int8),
            logprobs=np.zeros(shape, dtype=np.float64),
            attention_mask=np.zeros(shape, dtype=np.int8),
            segment_ids=np.zeros(shape, dtype=np.int32),
            position_ids=np.zeros(shape, dtype=np.int64),
            loss_weights=np.zeros(shape, dtype=np.float32),
            rollout_ids=[[] for _ in range(count)],
            skipped=self.skipped,
            padding_lines=count - len(self.lines),
            versions=np.full(shape, NO_VERSION, dtype=np.int64) if self.versioned else None,
            empty_rows=self.empty,
        )
        if self.rewarded:
            # A row of a part without record columns has no reward and a group of its own.
            padded = self.lines + [[] for _ in range(count - len(self.lines))]
            batch.rewards = [[row.reward for row in rows] for rows in padded]
            batch.groups = [[row.group or own_group(row.rollout_id) for row in rows] for rows in padded]
        for line, rows in enumerate(self.lines):
            start = 0
            for segment, row in enumerate(rows, start=1):
                end = start + len(row.token_ids)
                batch.token_ids[line, start:end] = row.token_ids
                batch.loss_mask[line, start:end] = row.loss_mask
                batch.logprobs[line, start:end] = row.logprobs
                batch.attention_mask[line, start:end] = 1
                batch.segment_ids[line, start:end] = segment
                batch.position_ids[line, start:end] = np.arange(end - start)
                batch.loss_weights[line, start:end] = row.loss_mask * np.float32(row.weight)
                if batch.versions is not None and row.versions is not None:
                    batch.versions[line, start:end] = row.versions
                batch.rollout_ids[line].append(row.rollout_id)
                start = end
        batch.step_total_tokens, batch.step_trained_tokens = batch.total_tokens, batch.trained_tokens
        self.lines, self.free, self.skipped, self.empty = [], [], [], []
        return batch


def collate(rows: Any, *, seq_len: int, pack: bool = True, pad_id: int = 0, too_long: str = "error") -> TokenBatch:
    """Pack (or pad) the trainable rows of one batch into as few lines of `seq_len`
    tokens as they need: arrays of shape (lines, seq_len)."""
    packer = _Packer(seq_len, pack=pack, too_long=too_long)
    packer.versioned, packer.rewarded = has_versions(rows), has_record_columns(rows)
    taken, packer.empty = _rows(rows)
    for row in taken:
        index = packer.fits(row)
        if index is None:
            packer.skipped.append(row.rollout_id)
        else:
            packer.place(row, index)
    return packer.take(pad_id=pad_id)


def token_batches(
    row_batches: Iterable[Any],
    *,
    seq_len: int,
    lines: int,
    pack: bool = True,
    pad_id: int = 0,
    too_long: str = "error",
    drop_last: bool = False,
) -> Iterator[TokenBatch]:
    """Batches of exactly (lines, seq_len) tokens from a stream of row batches (e.g.
    `Dataset.iter_batches(batch_format="pyarrow")`), in row order.

    A batch is yielded when the next row fits none of its `lines` lines. The last batch
    is padded with empty lines (attention 0) unless `drop_last`, which drops it. Batches
    carry `versions` (`rewards` and `groups`) from the first row batch with version
    (record) columns on. Rows with an empty token list are named in the `empty_rows` of
    the batch yielded next."""
    lines = _count("lines", lines)
    packer = _Packer(seq_len, pack=pack, too_long=too_long)
    for batch in row_batches:
        packer.versioned = packer.versioned or has_versions(batch)
        packer.rewarded = packer.rewarded or has_record_columns(batch)
        taken, empty = _rows(batch)
        packer.empty.extend(empty)
        for row in taken:
            index = packer.fits(row)
            if index is None:
                packer.skipped.append(row.rollout_id)
                continue
            if index == lines:
                yield packer.take(lines, pad_id)
                index = 0
            packer.place(row, index)
    if packer.lines and not drop_last:
        yield packer.take(lines, pad_id)


def _count(name: str, value: Any) -> int:
    """`value` as an int of at least 1: TypeError for a float, bool, str or None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {bounded_repr(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return int(value)


