"""The trainer's side: committed rows as a Ray Dataset, and fixed-shape token batches.

`dataset(output)` reads the committed shards of an output (`raycap.output`) with Ray
Data: only the shards its manifest lists, so a half-written or rejected run is never
read. Blocks may be consumed out of order unless Ray Data is told to preserve order.

`collate` turns rows (any batch of them: a pyarrow Table or RecordBatch, or the dict of
columns `Dataset.iter_batches(batch_format="numpy")` gives) into token arrays of a fixed
width `seq_len`; `token_batches` does it over a stream of row batches and yields batches
of exactly `lines` x `seq_len` tokens, for a trainer whose step has a fixed shape.

- Rows that must not be trained on are left out: `mask_sample` true, or null (fail
  closed), or a row without tokens (a failed build). When the rows have no `mask_sample`
  column, every row is taken as given.
- `pack=True` (default) packs several rows into one line, first fit in row order: a row
  goes into the first line with room for it, or a new line. `pack=False` pads: one row
  per line.
- A row longer than `seq_len` is never truncated (that would train on a cut trajectory
  whose loss mask no longer matches what was sampled): `too_long="error"` (default)
  raises ValueError naming the rollout, `too_long="skip"` leaves the row out and lists
  its rollout id in `TokenBatch.skipped`.

The arrays of a `TokenBatch`, each of shape (lines, seq_len):

- `token_ids` int64: the rows' tokens, `pad_id` after them;
- `loss_mask` int8: 1 on generated (trained) tokens, 0 on prompt, tool and padding;
- `logprobs` float64: the captured log probs on generated tokens, 0.0 elsewhere;
- `attention_mask` int8: 1 on real tokens, 0 on padding;
- `segment_ids` int32: which row of the line a token belongs to, 1, 2, ... in packing
  order, 0 on padding. Packed rows must not attend to each other: build block-diagonal
  attention from it (or varlen attention from its run lengths);
- `position_ids` int64: the position within the token's own row (restarts at 0 for each
  packed row), 0 on padding;
- `loss_weights` float32: `loss_mask` times the row's `weight` (chain delivery gives each
  chain 1 / the rollout's unmasked chains; 1.0 when the rows have no `weight`).

`TokenBatch.rollout_ids` lists, per line, the rollout ids packed into it, in segment
order. Only numpy is used; the token copies are slices, never Python loops over tokens.

This module does not import Ray; `dataset` loads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa

TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs")
# What collate reads: the token columns, plus the verdict, the id and the weight when present.
FEED_COLUMNS = ("rollout_id", "mask_sample", "weight", *TOKEN_COLUMNS)


def dataset(output: str | os.PathLike, **read_args: Any) -> Any:
    """The committed rows of `output` as a Ray Dataset (`ray.data.read_parquet` of the
    shards its manifest lists); `read_args` go to read_parquet (e.g. columns=[...])."""
    from raycap.output import shard_paths

    paths = [str(p) for p in shard_paths(output)]  # raises OutputError unless committed
    import ray.data

    from raycap.cluster.console import quiet_ray_data

    quiet_ray_data()
    return ray.data.read_parquet(paths, **read_args)


@dataclass
class TokenBatch:
    """Fixed-width token arrays for a trainer (see the module docstring for each)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    attention_mask: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    loss_weights: np.ndarray
    rollout_ids: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # too_long="skip": rollouts left out

    ARRAYS = (
        "token_ids", "loss_mask", "logprobs", "attention_mask", "segment_ids", "position_ids", "loss_weights",
    )

    @property
    def shape(self) -> tuple[int, int]:
        return self.token_ids.shape

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by name, as a trainer's batch dict."""
        return {name: getattr(self, name) for name in self.ARRAYS}


@dataclass
class _Row:
    rollout_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    weight: float


def _column(batch: Any, name: str) -> list | None:
    """One column of a row batch as a list of per-row values (arrays stay numpy)."""
    if isinstance(batch, (pa.Table, pa.RecordBatch)):
        if name not in batch.schema.names:
            return None
        column = batch.column(name)
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


def _rows(batch: Any) -> tuple[list[_Row], int]:
    """The trainable rows of a batch, and how many were left out as masked."""
    columns = {name: _column(batch, name) for name in FEED_COLUMNS}
    missing = [name for name in TOKEN_COLUMNS if columns[name] is None]
    if missing:
        raise ValueError(f"rows to collate need the columns {', '.join(TOKEN_COLUMNS)}; missing: {', '.join(missing)}")
    n = len(columns["token_ids"])
    ids = columns["rollout_id"] or [f"row {i}" for i in range(n)]
    masks = columns["mask_sample"]
    weights = columns["weight"]
    rows, masked = [], 0
    for i in range(n):
        tokens = columns["token_ids"][i]
        if (masks is not None and (masks[i] is None or bool(masks[i]))) or tokens is None:
            masked += 1
            continue
        loss_mask, logprobs = columns["loss_mask"][i], columns["logprobs"][i]
        if loss_mask is None or logprobs is None or not len(tokens) == len(loss_mask) == len(logprobs):
            raise ValueError(f"rollout {ids[i]}: token_ids, loss_mask and logprobs differ in length; the row is damaged")
        weight = 1.0 if weights is None or weights[i] is None else float(weights[i])
        rows.append(_Row(str(ids[i]), np.asarray(tokens), np.asarray(loss_mask), np.asarray(logprobs), weight))
    return rows, masked


class _Packer:
    """Places rows into lines of `seq_len` tokens (first fit, or one per line)."""

    def __init__(self, seq_len: int, *, pack: bool, too_long: str) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        if too_long not in ("error", "skip"):
            raise ValueError(f"too_long must be 'error' or 'skip', not {too_long!r}")
        self.seq_len, self.pack, self.too_long = seq_len, pack, too_long
        self.lines: list[list[_Row]] = []
        self.free: list[int] = []
        self.skipped: list[str] = []

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
        )
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
                batch.rollout_ids[line].append(row.rollout_id)
                start = end
        self.lines, self.free, self.skipped = [], [], []
        return batch


def collate(rows: Any, *, seq_len: int, pack: bool = True, pad_id: int = 0, too_long: str = "error") -> TokenBatch:
    """Pack (or pad) the trainable rows of one batch into as few lines of `seq_len`
    tokens as they need: arrays of shape (lines, seq_len)."""
    packer = _Packer(seq_len, pack=pack, too_long=too_long)
    for row in _rows(rows)[0]:
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
    is padded with empty lines (attention 0) unless `drop_last`, which drops it."""
    if lines < 1:
        raise ValueError(f"lines must be at least 1, not {lines}")
    packer = _Packer(seq_len, pack=pack, too_long=too_long)
    for batch in row_batches:
        for row in _rows(batch)[0]:
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
