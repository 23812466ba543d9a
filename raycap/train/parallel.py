"""Fixed-shape token batches for data-parallel ranks that step together: `DataParallelFeed`
and `shard_batches`.

Data-parallel ranks must take the same number of steps, or the last collective waits
forever. The feed plans the packing of a whole output once, the same on every rank
without coordination, deals the packed lines out round robin and pads the lagging ranks
with empty lines: every trainable row exactly once, unchanged, and equal step counts.
Splitting rows (`streaming_split`) does not give that. Every shard read is checked
against the output's manifest, so ranks never feed different rows. Only numpy and
pyarrow are used; no Ray.
"""

from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa

from raycap.capture.untrusted import bounded_repr
from raycap.observe.figures import PREFIX
from raycap.train.collate import FEED_COLUMNS, _count, _Packer, _Row, _rows, has_versions
from raycap.train.rewards import has_record_columns
from raycap.train.tokenbatch import TokenBatch


class DataParallelFeed:
    """Fixed-shape token batches for `world_size` data-parallel ranks that step together.

    `source` is a committed output (a path: its manifest's shards, in order) or a pyarrow
    Table. Every rank builds the same plan on its own, with no coordination, because the
    plan depends only on the rows and the arguments:

    1. the trainable rows (the rules of `collate`), in output order, are packed first fit
       into lines of `seq_len` tokens (`pack=False`: one row per line), exactly as
       `collate` would pack them all at once;
    2. line j goes to rank j % world_size, so ranks' loads differ by at most one line;
    3. every rank takes `steps` batches of `lines` x `seq_len`: the lines of the most
       loaded rank, rounded up to whole batches. A rank with fewer lines fills its last
       batches with padding lines (attention 0, loss mask and loss weight 0), counted in
       `TokenBatch.padding_lines` and `padding_lines(rank)`.

    Batches carry per-token `versions` (see `raycap.train.tokenbatch`) on every rank when any
    part of the source has the version columns, and `rewards` and `groups` when any part
    has a `reward` column, so all ranks' batches have one form.

    So across ranks every trainable row is fed exactly once, unchanged, and nothing is
    dropped to even the ranks out. A row longer than `seq_len` is never truncated:
    `too_long="error"` raises ValueError naming the longest such rollout and its length
    (the summary's token-length percentiles help choose `seq_len`); `too_long="skip"`
    leaves those rows out and lists them in `skipped`. Rows with an empty token list
    though `mask_sample` is false are never fed and are listed in `empty_rows`. Both
    lists are also on each rank's first batch.

    A rank's batch can be entirely padding (a lagging rank's last steps, or more ranks
    than lines): its `trained_tokens` is 0. A trainer that averages its loss over its own
    batch's tokens then computes 0/0 = NaN on that rank, and the gradient all-reduce of
    DDP spreads the NaN into every rank's weights. Normalise by the step's tokens across
    all ranks instead: `batch.step_trained_tokens` (or `step_tokens(step).trained`),
    which every rank knows from the plan without a collective. Sum the rank's token losses
    times `loss_weights`, divide by the step's trained tokens, and multiply by
    `world_size` when DDP averages the gradients over ranks; a rank of padding then adds
    exactly 0.

    Building the plan reads the id, verdict, token and loss-mask columns of every shard
    (lengths decide the packing; loss masks give the step counts). `batches(rank)` then
    reads the shards again, one at a time, and keeps only this rank's rows (about
    1/world_size of the output) while it yields: a line may hold rows of several shards,
    so they are gathered before the first step. `streaming_split(n, equal=True)` and Ray
    Train's `get_dataset_shard` split rows, not packed lines, so their step counts can
    differ by a batch (a collective then waits forever): feed data-parallel ranks from
    this instead.

    Ranks agree only if they read the same rows, so every read of a shard is checked
    against the output's manifest: its size, its row count and (when the manifest records
    it) the sha256 of its bytes. A shard that does not match is refused with OutputError
    naming it, before any plan is made; one that changes after the plan is refused by
    `batches(rank)` (which also checks each row's id and length against the plan), never
    fed. Shards are opened as `raycap.output.manifest.open_shard` opens them: no link is
    followed, no FIFO waited on. `world_size`, `seq_len`, `lines` and `rank` must be ints
    (TypeError otherwise, ValueError when out of range), judged before anything is read.
    """

    def __init__(
        self,
        source: str | os.PathLike | pa.Table,
        world_size: int,
        *,
        seq_len: int,
        lines: int,
        pack: bool = True,
        pad_id: int = 0,
        too_long: str = "error",
    ) -> None:
        world_size, lines = _count("world_size", world_size), _count("lines", lines)
        _Packer(seq_len, pack=pack, too_long=too_long)  # validates seq_len and too_long
        self.world_size, self.seq_len, self.lines = world_size, int(seq_len), lines
        self.pack, self.pad_id = pack, pad_id
        self._parts = _parts(source)
        plan = _trainable_lengths(self._parts)
        parts, rows, lengths, trained, ids = plan.parts, plan.rows, plan.lengths, plan.trained, plan.ids
        self.versioned, self.rewarded, self.empty_rows = plan.versioned, plan.rewarded, plan.empty
        over = lengths > seq_len
        self.skipped: list[str] = []
        if over.any():
            longest = int(np.argmax(np.where(over, lengths, -1)))
            if too_long == "error":
                raise ValueError(
                    f"rollout {ids[longest]} has {int(lengths[longest])} tokens, the longest of "
                    f"{int(over.sum())} trainable rows over seq_len {seq_len}; raise seq_len to at least "
                    f"{int(lengths[longest])}, or pass too_long='skip' to leave such rows out (rows are never truncated)"
                )
            self.skipped = [ids[i] for i in np.flatnonzero(over).tolist()]
            keep = ~over
            parts, rows, lengths, trained = parts[keep], rows[keep], lengths[keep], trained[keep]
            ids = [rid for rid, k in zip(ids, keep.tolist()) if k]
        self._row_part, self._row_index, self._ids, self._lengths = parts, rows, ids, lengths
        self._line_of = _first_fit(lengths, seq_len) if pack else np.arange(len(lengths), dtype=np.int64)
        self.total_lines = int(self._line_of.max()) + 1 if len(lengths) else 0
        most = -(-self.total_lines // world_size)
        self.steps = -(-most // lines)
        # Line j is rank j % world_size's (j // world_size)-th line, in its step of `lines`.
        step_of = (self._line_of // world_size) // lines
        self._step_total = np.bincount(step_of, weights=lengths, minlength=self.steps).astype(np.int64)
        self._step_trained = np.bincount(step_of, weights=trained, minlength=self.steps).astype(np.int64)

    def step_tokens(self, step: int) -> StepTokens:
        """The tokens of step `step` summed over every rank's batch, from the plan (the
        same number on every rank, no collective): the normaliser of a step's loss."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int in [0, {self.steps}), not {type(step).__name__} {bounded_repr(step)}")
        if not 0 <= step < self.steps:
            raise ValueError(f"step must be in [0, {self.steps}), not {step}")
        return StepTokens(total=int(self._step_total[step]), trained=int(self._step_trained[step]))

    def metrics(self, step: int) -> dict[str, float]:
        """Step `step`'s figures from the plan, as one flat dict under `raycap/` keys for a
        trainer's logger (`wandb.log(feed.metrics(step), step=step)`): the step's tokens
        over every rank (`step_tokens`, `step_trained_tokens`), the share of the step's
        token slots they fill (`token_fill`), the steps in all, and the rows left out as
        too long (`rows_skipped`). The same on every rank."""
        tokens = self.step_tokens(step)
        slots = self.world_size * self.lines * self.seq_len
        figures = {
            "step_tokens": tokens.total, "step_trained_tokens": tokens.trained,
            "token_fill": tokens.total / slots if slots else 0.0, "steps": self.steps, "rows_skipped": len(self.skipped),
        }
        return {PREFIX + key: value for key, value in figures.items()}

    def rank_lines(self, rank: int) -> int:
        """How many lines of rows this rank gets (before padding)."""
        self._check_rank(rank)
        return len(range(rank, self.total_lines, self.world_size))

    def padding_lines(self, rank: int) -> int:
        """How many padding lines this rank's batches carry in all."""
        return self.steps * self.lines - self.rank_lines(rank)

    def batches(self, rank: int) -> Iterator[TokenBatch]:
        """This rank's `steps` batches of exactly (lines, seq_len), in plan order (the
        rank is checked here, at the call)."""
        self._check_rank(rank)
        return self._batches(rank)

    def _batches(self, rank: int) -> Iterator[TokenBatch]:
        mine = np.flatnonzero(self._line_of % self.world_size == rank)
        by_line: dict[int, list[_Row]] = {}
        for part in np.unique(self._row_part[mine]).tolist():
            at = mine[self._row_part[mine] == part]  # ascending, so rows keep output order
            source = self._parts[part]
            table = _read_part(source, FEED_COLUMNS, planned=True)[0]
            if int(self._row_index[at].max()) >= table.num_rows:
                raise _changed(source, "it has fewer rows than the plan", planned=True)
            taken = _rows(table.take(pa.array(self._row_index[at])))[0]
            named = "rollout_id" in table.column_names  # else ids are row numbers, not comparable
            if [(r.rollout_id if named else "", len(r.token_ids)) for r in taken] != [
                (self._ids[i] if named else "", int(self._lengths[i])) for i in at.tolist()
            ]:
                raise _changed(source, "its rows' ids or token lengths differ from the plan's", planned=True)
            for row_at, row in zip(at.tolist(), taken):
                by_line.setdefault(int(self._line_of[row_at]), []).append((row_at, row))
        local = sorted(by_line)  # this rank's lines, in global line order
        packer = _Packer(self.seq_len, pack=self.pack, too_long="error")
        packer.versioned, packer.rewarded = self.versioned, self.rewarded
        for step in range(self.steps):
            chosen = local[step * self.lines : (step + 1) * self.lines]
            packer.lines = [[row for _, row in sorted(by_line[line], key=lambda item: item[0])] for line in chosen]
            batch = packer.take(self.lines, self.pad_id)
            batch.skipped = list(self.skipped) if step == 0 else []
            batch.empty_rows = list(self.empty_rows) if step == 0 else []
            batch.step_total_tokens, batch.step_trained_tokens = int(self._step_total[step]), int(self._step_trained[step])
            yield batch

    def _check_rank(self, rank: int) -> None:
        _check_rank(rank, self.world_size)


@dataclass(frozen=True)
class StepTokens:
    """The tokens of one data-parallel step, over every rank: `total` attended, `trained`
    with loss mask 1."""

    total: int
    trained: int


def _check_rank(rank: Any, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an int in [0, {world_size}), not {type(rank).__name__} {bounded_repr(rank)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), not {rank}")


def shard_batches(
    source: str | os.PathLike | pa.Table,
    rank: int,
    world_size: int,
    *,
    seq_len: int,
    lines: int,
    pack: bool = True,
    pad_id: int = 0,
    too_long: str = "error",
) -> Iterator[TokenBatch]:
    """Rank `rank`'s batches of a `DataParallelFeed`: every rank gets the same number.
    The rank and the world size are checked before anything is read."""
    _check_rank(rank, _count("world_size", world_size))
    feed = DataParallelFeed(source, world_size, seq_len=seq_len, lines=lines, pack=pack, pad_id=pad_id, too_long=too_long)
    return feed.batches(rank)


@dataclass(frozen=True)
class _Shard:
    """A committed shard to feed, and what the output's manifest says it holds."""

    path: Any  # a local shard's Path, or an object store's Location
    rows: int
    file_bytes: int
    sha256: str | None

    def __str__(self) -> str:
        return str(self.path)


def _parts(source: str | os.PathLike | pa.Table) -> list[Any]:
    if isinstance(source, pa.Table):
        return [source]
    from raycap.output.location import Location

    if isinstance(source, (str, os.PathLike, Location)):
        from raycap.output.location import parse_location
        from raycap.output.protocol import backend_of

        location = parse_location(source)
        backend = backend_of(location)
        manifest = backend.manifest(location)  # raises OutputError unless committed
        paths = backend.shards(location, manifest)  # ... or a shard is outside it, missing or not a file
        return [_Shard(p, s.rows, s.file_bytes, s.sha256) for p, s in zip(paths, manifest.shards)]
    raise TypeError(f"a data-parallel feed reads a committed output (a path) or a pyarrow Table, not {type(source).__name__}")


def _changed(shard: _Shard, what: str, *, planned: bool) -> Exception:
    from raycap.output.faults import OutputError

    if planned:
        return OutputError(
            f"shard {shard.path} changed since this feed planned it: {what}; nothing of it was fed. Every rank must "
            "read the same rows: restore the output, then make the feed again on every rank"
        )
    return OutputError(
        f"shard {shard.path} does not match its output's manifest: {what}; nothing was planned. It changed after "
        "the commit: restore it, or rebuild the output"
    )


def _read_part(part: Any, wanted: Iterable[str], *, planned: bool = False) -> tuple[pa.Table, list[str]]:
    """The `wanted` columns a part has, and all its column names. A shard is read whole
    and checked against its manifest entry first (size, then sha256, then rows)."""
    if isinstance(part, pa.Table):
        return part.select([name for name in wanted if name in part.column_names]), part.column_names
    import pyarrow.parquet as pq

    from raycap.output.manifest import open_shard

    with open_shard(part.path) as handle:
        size = handle.seek(0, os.SEEK_END)  # a local file's or a store's object's, the same way
        handle.seek(0)
        if size != part.file_bytes:
            raise _changed(part, f"it has {size} bytes, the manifest says {part.file_bytes}", planned=planned)
        data = handle.read(size + 1)
    if len(data) != part.file_bytes:
        raise _changed(part, f"it has {len(data)} bytes, the manifest says {part.file_bytes}", planned=planned)
    if part.sha256 is not None and hashlib.sha256(data).hexdigest() != part.sha256:
        raise _changed(part, "its bytes differ from those the manifest records (sha256)", planned=planned)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        if parquet.metadata.num_rows != part.rows:
            raise _changed(part, f"it has {parquet.metadata.num_rows} rows, the manifest says {part.rows}", planned=planned)
        names = parquet.schema_arrow.names
        return parquet.read(columns=[name for name in wanted if name in names]), names
    except pa.ArrowException as exc:
        raise _changed(part, f"it is not readable Parquet ({type(exc).__name__})", planned=planned) from None


@dataclass
class _Trainable:
    """The trainable rows of a source, in order: each one's part, index in the part,
    length, trained tokens and id; the damaged empty rows left out; and whether any part
    has the version columns or a reward column."""

    parts: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    trained: np.ndarray
    ids: list[str]
    empty: list[str]
    versioned: bool
    rewarded: bool


def _trainable_lengths(parts: list[Any]) -> _Trainable:
    import pyarrow.compute as pc

    where, index, lengths, trained, ids, empty = [], [], [], [], [], []
    versioned = rewarded = False
    for number, part in enumerate(parts):
        table, names = _read_part(part, ("rollout_id", "mask_sample", "token_ids", "loss_mask"))
        versioned = versioned or has_versions(names)
        rewarded = rewarded or has_record_columns(names)
        for column in ("token_ids", "loss_mask"):
            if column not in table.column_names:
                raise ValueError(f"{part if isinstance(part, _Shard) else 'the table'} has no {column} column to feed")
        live = pc.is_valid(table.column("token_ids"))
        if "mask_sample" in table.column_names:
            # Fail closed, as collate does: a row without a verdict is not trained on.
            live = pc.and_(live, pc.invert(pc.fill_null(table.column("mask_sample"), True)))
        live = np.asarray(live.to_numpy(zero_copy_only=False), dtype=bool)
        length = np.nan_to_num(pc.list_value_length(table.column("token_ids")).to_numpy(zero_copy_only=False)).astype(np.int64)
        # A trainable row with no tokens is damaged: never fed, named (as collate does).
        hollow = np.flatnonzero(live & (length == 0))
        at = np.flatnonzero(live & (length > 0))
        where.append(np.full(len(at), number, dtype=np.int64))
        index.append(at.astype(np.int64))
        lengths.append(length[at])
        trained.append(_nonzero_per_row(table.column("loss_mask"))[at])
        if "rollout_id" in table.column_names:
            ids.extend(str(v) for v in table.column("rollout_id").take(pa.array(at)).to_pylist())
            empty.extend(str(v) for v in table.column("rollout_id").take(pa.array(hollow)).to_pylist())
        else:
            ids.extend(f"row {i}" for i in at.tolist())
            empty.extend(f"row {i}" for i in hollow.tolist())
    none = np.empty(0, dtype=np.int64)
    return _Trainable(
        parts=np.concatenate(where) if where else none,
        rows=np.concatenate(index) if index else none,
        lengths=np.concatenate(lengths) if lengths else none,
        trained=np.concatenate(trained) if trained else none,
        ids=ids,
        empty=empty,
        versioned=versioned,
        rewarded=rewarded,
    )


def _nonzero_per_row(column: pa.ChunkedArray) -> np.ndarray:
    """How many nonzero values each row of a list column holds (0 for a null row), from
    the offsets: a running count of nonzero values, differenced at each row's bounds."""
    out = []
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values = np.asarray(chunk.values.to_numpy(zero_copy_only=False)) != 0
        running = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        out.append(running[offsets[1:]] - running[offsets[:-1]])
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _first_fit(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The line of each row, first fit in row order (as `_Packer` places them), in
    O(rows log rows): a tree over the lines keeps each subtree's largest free space, so
    the first line with room is found by descending left whenever the left side fits."""
    count = len(lengths)
    size = 1
    while size < max(count, 1):
        size *= 2
    free = [seq_len] * (2 * size)  # lines not yet opened have all of seq_len free
    line_of = np.empty(count, dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        line_of[i] = node - size
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return line_of
