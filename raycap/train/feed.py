"""The trainer's side: committed rows as a Ray Dataset, and fixed-shape token batches.

`dataset(output)` reads the committed shards of an output (`raycap.output.commit`) with Ray
Data: only the shards its manifest lists, so a half-written or rejected run is never
read. Blocks may be consumed out of order unless Ray Data is told to preserve order.

`collate` turns rows (any batch of them: a pyarrow Table or RecordBatch, or the dict of
columns `Dataset.iter_batches(batch_format="numpy")` gives) into token arrays of a fixed
width `seq_len`; `token_batches` does it over a stream of row batches and yields batches
of exactly `lines` x `seq_len` tokens, for a trainer whose step has a fixed shape.

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
  chain 1 / the rollout's unmasked chains; 1.0 when the rows have no `weight`);
- `versions` int64, only when the rows carry version columns (built with a
  `version_key`, as `raycap.Stream` rows are; see `raycap.rows.arrow`), else None: the policy
  version that generated each token, from each call's generated span
  (`call_gen_start`..`call_gen_end`) and its `call_versions` entry. `NO_VERSION` (-1)
  everywhere else: prompt, tool and padding tokens, a call without a version, and every
  token of a row without versions. A trainer bounding staleness per token (or weighting
  by it) reads this; `versions >= 0` is a subset of `loss_mask == 1`.

`TokenBatch.rollout_ids` lists, per line, the rollout ids packed into it, in segment
order; `TokenBatch.padding_lines` counts its empty lines (attention and loss weight 0).

Rows built from rollout records carry the record columns (SPEC §10.7). When the rows
have a `reward` column, `TokenBatch.rewards` and `TokenBatch.groups` give, per line and
aligned with `rollout_ids`, each packed row's reward (a float; None when the row has
none, or a value that is not a finite number) and its GRPO group: `"task:<task_index>"`,
shared by the rollouts of one task, or, for a row without a task index, a key of its own
that no other row has (`"rollout:<id>:<random hex>"`, drawn anew for each batch). Without a
`reward` column both are None. The feed does not judge rewards: a trainer that uses them
must not train on a row whose reward is None (`raycap.train.trainers` masks it).

Token counts, for normalising a loss: `TokenBatch.total_tokens` (attention 1) and
`TokenBatch.trained_tokens` (loss mask 1) count this batch; `step_total_tokens` and
`step_trained_tokens` count the whole step, which for `collate` and `token_batches` is
this batch, and for `DataParallelFeed` is every rank's batch of that step, from the plan.

For torch: the arrays' default dtypes are numpy's; `TokenBatch.arrays(torch_dtypes=True)`
gives the dtypes a torch trainer feeds its model and loss (`logprobs` float32,
`loss_mask` and `attention_mask` bool, which `scaled_dot_product_attention` and boolean
indexing take; the rest as above), and `TokenBatch.tensors()` gives those as CPU torch
tensors (torch is not a dependency: it is imported only there).

Data-parallel ranks must take the same number of steps, or the last collective waits
forever. `DataParallelFeed` (and `shard_batches`) plans the packing of a whole output
once, the same on every rank without coordination, deals the packed lines out round
robin and pads the lagging ranks with empty lines: every trainable row exactly once,
unchanged, and equal step counts. Splitting rows (`streaming_split`) does not give that.
Only numpy is used; the token copies are slices, never Python loops over tokens.

This module does not import Ray; `dataset` loads it. Only numpy and pyarrow are used by
the rest, so a trainer without Ray can feed itself from a committed output.
"""

from __future__ import annotations

import hashlib
import importlib.util
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa

from raycap.capture.untrusted import bounded_repr
from raycap.rows.arrow import fill_call_versions
from raycap.train.rewards import RECORD_FEED_COLUMNS, group_key, has_record_columns, own_group, reward_value

TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs")
# What per-token versions are built from, when the rows have them (see `raycap.rows.arrow`).
VERSION_FEED_COLUMNS = ("call_gen_start", "call_gen_end", "call_versions")
# What collate reads: the token columns, plus the verdict, the id, the weight, the
# version spans and the record columns when present.
FEED_COLUMNS = ("rollout_id", "mask_sample", "weight", *TOKEN_COLUMNS, *VERSION_FEED_COLUMNS, *RECORD_FEED_COLUMNS)
# The dtypes a torch trainer takes where they differ from the arrays' own: float32 log
# probs (the model's dtype), bool masks (scaled_dot_product_attention refuses int8 masks).
TORCH_DTYPES = {"logprobs": np.float32, "loss_mask": np.bool_, "attention_mask": np.bool_}
# The version of a token no versioned call generated (prompt, tool output, padding, a
# call or row without a version). Versions are policy steps, so never negative.
NO_VERSION = -1


def dataset(
    output: Any, columns: Iterable[str] | None = None, *, storage_options: Mapping[str, Any] | None = None,
    **read_args: Any,
) -> Any:
    """The committed rows of `output` as a Ray Dataset (`ray.data.read_parquet` of the
    shards its manifest lists). `columns` keeps only those columns (`select_columns`,
    which Ray Data pushes down into the read); `read_args` go to read_parquet. The shards
    are checked first (`raycap.output.manifest.shard_paths`: inside the output, regular files,
    no link; on an object store, every listed shard in place), since Ray Data opens them
    by path. `output` is a path, a URI (`s3://...`; `storage_options` go to its file
    system) or a `raycap.output.location.Location`."""
    from raycap.output.location import parse_location
    from raycap.output.protocol import backend_of

    location = parse_location(output, storage_options)
    backend = backend_of(location)
    shards = backend.shards(location)  # raises OutputError unless committed
    paths, filesystem = backend.for_workers(location, shards)
    if filesystem is not None:
        read_args.setdefault("filesystem", filesystem)
    import ray.data

    from raycap.cluster.connect import connect
    from raycap.cluster.console import quiet_ray_data

    # Connect as every raycap call does (RAY_ADDRESS's cluster, or a quiet embedded
    # instance) instead of letting Ray Data start one with its dashboard and notices.
    connect()
    quiet_ray_data()
    rows = ray.data.read_parquet(paths, **read_args)
    return rows if columns is None else rows.select_columns(list(columns))


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
    # Empty lines that only fill the fixed shape (the last batch of a stream, or a
    # data-parallel rank evened out with the others): attention and loss weight 0.
    padding_lines: int = 0
    # Per-token policy versions, when the rows carry version columns (else None).
    versions: np.ndarray | None = None
    # Per line, aligned with rollout_ids, when the rows carry a reward column (else None):
    # each packed row's reward (None: it has none) and its GRPO group key.
    rewards: list[list[float | None]] | None = None
    groups: list[list[str]] | None = None
    # Rollouts left out because their token list is empty though mask_sample is false.
    empty_rows: list[str] = field(default_factory=list)
    # The tokens of the whole step this batch belongs to (every rank's, for a
    # DataParallelFeed; this batch's own otherwise): a loss normaliser no rank must
    # all-reduce. Set by whatever made the batch.
    step_total_tokens: int | None = None
    step_trained_tokens: int | None = None

    ARRAYS = (
        "token_ids", "loss_mask", "logprobs", "attention_mask", "segment_ids", "position_ids", "loss_weights",
    )

    @property
    def shape(self) -> tuple[int, int]:
        return self.token_ids.shape

    @property
    def total_tokens(self) -> int:
        """The real (attended) tokens of this batch; 0 for a batch of padding lines."""
        return int(np.count_nonzero(self.attention_mask))

    @property
    def trained_tokens(self) -> int:
        """The tokens of this batch with loss mask 1; 0 for a batch of padding lines."""
        return int(np.count_nonzero(self.loss_mask))

    def arrays(self, *, torch_dtypes: bool = False) -> dict[str, np.ndarray]:
        """The arrays by name, as a trainer's batch dict (with `versions` when present).
        `torch_dtypes=True` casts them to what a torch trainer takes (`TORCH_DTYPES`:
        float32 log probs, bool loss and attention masks); the default keeps the dtypes
        of the module docstring."""
        out = {name: getattr(self, name) for name in self.ARRAYS}
        if self.versions is not None:
            out["versions"] = self.versions
        if torch_dtypes:
            out = {name: array.astype(TORCH_DTYPES.get(name, array.dtype), copy=False) for name, array in out.items()}
        return out

    def tensors(self) -> dict[str, Any]:
        """`arrays(torch_dtypes=True)` as CPU torch tensors (ImportError without torch)."""
        return torch_tensors(self.arrays(torch_dtypes=True), asked="TokenBatch.tensors()")


def torch_tensors(arrays: dict[str, np.ndarray], *, asked: str) -> dict[str, Any]:
    """numpy arrays as torch tensors sharing their memory; arrays of Python objects (a
    group id's strings) stay numpy, as non-tensor batch fields do. `asked` names the call
    in the error when torch is missing."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(f"{asked} needs torch, which raycap does not install; pip install torch, or take numpy arrays")
    import torch

    return {
        name: array if array.dtype == object else torch.from_numpy(np.ascontiguousarray(array))
        for name, array in arrays.items()
    }


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


# --------------------------------------------------------------------------- data parallel


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

    Batches carry per-token `versions` (see the module docstring) on every rank when any
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


def _count(name: str, value: Any) -> int:
    """`value` as an int of at least 1: TypeError for a float, bool, str or None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {bounded_repr(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return int(value)


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
        from raycap.output.manifest import read_manifest, shard_paths

        manifest = read_manifest(source)  # raises OutputError unless committed
        paths = shard_paths(source, manifest)  # ... or a shard is outside it, missing or not a file
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
        size = os.fstat(handle.fileno()).st_size if isinstance(part.path, Path) else handle.size()
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
