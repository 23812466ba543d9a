"""What a stream delivered, and what its commits claim.

A commit is tied to what was delivered. `take` records each rollout it hands out
(`Delivered`): the rows themselves, the same Arrow buffers the caller got, or, for rows
left on Ray, their metadata (`raycap.stream.steps.META_COLUMNS`) and the ref they went out in.
`Ledger.claim` accepts only rows this stream delivered and no commit has claimed:

- a table: every rollout in it whole and equal, row for row and column for column, to
  what was delivered (a flipped verdict, one of a rollout's chain rows, a row given
  twice or a forged value makes it unequal);
- refs: each one a ref `take_refs()` returned, once.

Anything else (a foreign or forged table, rows committed already, rows another thread
is committing right now) is a one-line ValueError, raised before the commit writes
anything. The commit then judges and writes from the stream's own rows (`Claim`), never
from the caller's values: the verdicts that decide what is retired are the delivered ones.

A claim is made atomically, under the ledger's lock, so of two commits of the same rows
exactly one wins. A commit that fails returns its claim (`release`): the rows stay taken
and may be committed again. Should it fail after its step dataset was renamed into
place, the rows are durable there (`wrote`), and they may then be committed only to that
step again, which finishes the commit, never into a second dataset. A commit that
finished settles its claim (`settle`): those rows can never be committed again.

This module does not import Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from raycap.capture.files import is_valid_rollout_id
from raycap.stream.steps import STALE, SnapshotPart, key_parts

_ONE_LINE = "commit the rows take() returned, unchanged and whole, once"


@dataclass(frozen=True)
class Delivered:
    """One rollout as `take` handed it out: its rows (whole, or their metadata when
    `whole` is False and the rows stayed on Ray), and the ref they went out in. What a
    commit reads of them (`summarize`) is read once, when they are recorded: their
    snapshot parts, their verdict and their step keys (`raycap.stream.steps.row_keys`)."""

    rollout_id: str
    rows: pa.Table
    whole: bool
    ref: Any = None
    parts: tuple[SnapshotPart, ...] = ()
    verdict: tuple[bool, str] = (False, "committed")
    keys: frozenset = frozenset()
    # The record it was taken with (`raycap.capture.recordfile.KeptRecord`), or None.
    record: Any = None


def summarize(table: pa.Table, counts: Sequence[tuple[str, int]], *, real_dirs: bool) -> list[tuple]:
    """For each rollout of `table` (consecutive rows, `counts` saying how many): its
    snapshot parts (those of its first row), its verdict (whether it was delivered
    masked, any row masked or failed, and why: `stale` when staleness masked it, else its
    first reason) and its step keys. One pass over the table, not one per rollout."""
    rows = table.select(["rollout_id", "snapshots", "mask_sample", "error", "mask_reasons"]).to_pylist()
    real: dict[str, str] = {}
    out, at = [], 0
    for _, count in counts:
        mine = rows[at : at + count]
        at += count
        snapshots = (mine[0]["snapshots"] or []) if mine else []
        parts = tuple(SnapshotPart(s["capture_dir"], s["snapshot_id"], s["version"]) for s in snapshots)
        masked, reason = False, "committed"
        keys = set()
        for row in mine:
            if row["mask_sample"] is not False or row["error"] is not None:
                reasons = row["mask_reasons"] or []
                if STALE in reasons or not masked:
                    reason = STALE if STALE in reasons else (reasons[0] if reasons else "masked")
                masked = True
            keys.add((row["rollout_id"], key_parts(row["snapshots"], real, real_dirs)))
        out.append((parts, (masked, reason), frozenset(keys)))
    return out


@dataclass
class Claim:
    """The rollouts one commit holds, in the order given, as they were delivered."""

    rollouts: dict[str, Delivered]
    refs: tuple[Any, ...] = ()

    @property
    def verdicts(self) -> dict[str, tuple[bool, str]]:
        return {rid: d.verdict for rid, d in self.rollouts.items()}

    @property
    def ids(self) -> list[str]:
        return list(self.rollouts)

    @property
    def rows(self) -> int:
        return sum(d.rows.num_rows for d in self.rollouts.values())

    def masked(self, rid: str) -> bool:
        return self.rollouts[rid].verdict[0]

    def snapshots(self, ids: Sequence[str]) -> frozenset:
        """What a step dataset of `ids` holds (`raycap.stream.steps.row_keys`)."""
        keys: set = set()
        for rid in ids:
            keys |= self.rollouts[rid].keys
        return frozenset(keys)

    def sources(self, ids: Sequence[str]) -> tuple[pa.Table | None, list[Any]]:
        """The delivered rows of `ids`: the whole rows held here, as one table (None
        when there are none), and the refs holding the others (rows left on Ray)."""
        here = [self.rollouts[rid].rows for rid in ids if self.rollouts[rid].whole]
        refs = list(dict.fromkeys(self.rollouts[rid].ref for rid in ids if not self.rollouts[rid].whole))
        return (pa.concat_tables(here) if here else None), refs


class Ledger:
    """The rollouts a stream has delivered and not yet committed (see the module docstring)."""

    def __init__(self, *, real_dirs: bool = True) -> None:
        self.real_dirs = real_dirs
        self._lock = threading.Lock()
        self._taken: dict[str, Delivered] = {}
        self._claimed: set[str] = set()
        # take_refs(): the rollouts each returned ref holds.
        self._refs: dict[Any, tuple[str, ...]] = {}
        # Rollouts a failed commit already wrote into a committed step dataset.
        self._written: dict[str, Path] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._taken)

    def record(self, table: pa.Table, counts: Sequence[tuple[str, int]], *, whole: bool, ref: Any = None,
               records: Mapping[str, Any] | None = None) -> None:
        """`take` handed out `table`: consecutive rows per rollout, `counts` saying how
        many; `whole` False when `table` holds only the rows' metadata; `records` the
        records the rollouts were taken with."""
        delivered, offset = [], 0
        records = records or {}
        for (rid, count), (parts, verdict, keys) in zip(counts, summarize(table, counts, real_dirs=self.real_dirs)):
            delivered.append(
                Delivered(rid, table.slice(offset, count), whole, ref, parts, verdict, keys, records.get(rid))
            )
            offset += count
        with self._lock:
            for d in delivered:
                self._taken[d.rollout_id] = d
            if ref is not None:
                self._refs[ref] = tuple(rid for rid, _ in counts)

    def claim(self, rows: Any, output: Path | None, *, written: bool = True) -> Claim:
        """Claim the rollouts of `rows` (a table, or refs of take_refs()) for one
        commit to `output`; ValueError (one line) for anything but delivered, uncommitted,
        unchanged, whole rollouts, and TypeError for what is neither a table nor refs.
        `written` False claims them to read them only, wherever a failed commit wrote
        them."""
        if isinstance(rows, pa.RecordBatch):
            rows = pa.Table.from_batches([rows])
        if isinstance(rows, pa.Table):
            wanted, refs = self._delivered_in(rows), ()
        else:
            refs = _refs_of(rows)
            with self._lock:
                unknown = [r for r in refs if r not in self._refs]
                ids = list(dict.fromkeys(rid for r in refs if r in self._refs for rid in self._refs[r]))
                wanted = {rid: self._taken.get(rid) for rid in ids}
            if unknown:
                raise ValueError(
                    f"{len(unknown)} of the {len(refs)} items given to commit are not refs take_refs() of this "
                    f"stream returned, or were committed already (give commit the pyarrow.Table take() returned, or "
                    f"the list of refs take_refs() returned); {_ONE_LINE}"
                )
        with self._lock:
            for rid, d in wanted.items():
                if d is None or self._taken.get(rid) is not d:
                    missing = [r for r, e in wanted.items() if e is None or self._taken.get(r) is not e]
                    raise ValueError(
                        f"rollout {_name(rid)} was not taken from this stream, or was committed already "
                        f"({len(missing)} such rollouts); {_ONE_LINE}"
                    )
                if rid in self._claimed:
                    raise ValueError(
                        f"rollout {rid} is being committed by another call right now; nothing was committed by this "
                        "one: commit each taken rollout once"
                    )
                step = self._written.get(rid)
                if written and step is not None and step != output:
                    raise ValueError(
                        f"rollout {rid} is already in the committed step dataset {step} (an earlier commit failed "
                        f"after writing it); nothing was committed: commit it with output={str(step)!r} to finish"
                    )
            self._claimed.update(wanted)
        return Claim(dict(wanted), tuple(refs))

    def _delivered_in(self, rows: pa.Table) -> dict[str, Delivered | None]:
        """Each rollout of `rows` and what was delivered of it (None: nothing), after
        checking that the rows are exactly that, whole."""
        index = rows.schema.get_field_index("rollout_id")  # -1: none, or more than one
        if index < 0 or not pa.types.is_string(rows.schema.field(index).type) or rows.column(index).null_count:
            names = ", ".join(_name(n) for n in rows.column_names[:8])
            raise ValueError(
                f"the table given to commit is not rows of a raycap stream (it has no rollout_id column of strings; "
                f"columns: {names}{' ...' if rows.num_columns > 8 else ''}); {_ONE_LINE}"
            )
        at: dict[str, list[int]] = {}
        for i, rid in enumerate(rows.column("rollout_id").to_pylist()):
            at.setdefault(rid, []).append(i)
        with self._lock:
            delivered = {rid: self._taken.get(rid) for rid in at}
        for rid, d in delivered.items():
            if d is None:
                continue  # judged under the lock by `claim`, with the others not taken
            index = at[rid]
            given = (
                rows.slice(index[0], len(index)) if index[-1] - index[0] + 1 == len(index)
                else rows.take(pa.array(index, pa.int64()))
            )
            if not d.whole:
                # Rows left on Ray: what is here is their metadata, which the rows must match;
                # the step is written from the delivered ref, never from these values.
                names = d.rows.column_names
                given = given.select(names) if set(names) <= set(given.column_names) else None
            if given is None or not given.equals(d.rows):
                raise ValueError(
                    f"the rows of rollout {_name(rid)} are not the rows this stream delivered (given {len(index)} rows, "
                    f"delivered {d.rows.num_rows}; a changed verdict or value, a missing chain row or a row given "
                    f"twice); nothing was committed: {_ONE_LINE}"
                )
        return delivered

    def release(self, claim: Claim) -> None:
        """A commit failed: its rollouts stay taken and may be committed again."""
        with self._lock:
            self._claimed.difference_update(claim.rollouts)

    def wrote(self, ids: Sequence[str], output: Path) -> None:
        """The step dataset at `output` holding `ids` is committed (renamed into place)."""
        with self._lock:
            for rid in ids:
                self._written[rid] = output

    def settle(self, claim: Claim) -> None:
        """A commit finished: its rollouts are no longer taken, and the refs that hold
        only committed rollouts are forgotten."""
        with self._lock:
            for rid in claim.rollouts:
                self._claimed.discard(rid)
                self._written.pop(rid, None)
                self._taken.pop(rid, None)
            for ref in [*claim.refs, *(d.ref for d in claim.rollouts.values() if d.ref is not None)]:
                if ref in self._refs and not any(rid in self._taken for rid in self._refs[ref]):
                    del self._refs[ref]


def _name(text: str) -> str:
    """`text` for a one-line message: as it is when it is a valid rollout id, else quoted
    and cut (a caller's table may hold anything, line breaks included)."""
    return text if is_valid_rollout_id(text) else f"{text!r:.60}"


def _refs_of(rows: Any) -> list[Any]:
    """The refs given to commit, checked: distinct refs, given as a list."""
    if isinstance(rows, (str, bytes, bytearray, Mapping)) or not isinstance(rows, Iterable):
        raise TypeError(
            f"commit takes the table take() returned or the list of refs take_refs() returned, not "
            f"{type(rows).__name__}"
        )
    refs = list(rows)
    try:
        distinct = len(set(refs))
    except TypeError:
        raise ValueError(f"the refs given to commit are not refs take_refs() returned; {_ONE_LINE}") from None
    if distinct != len(refs):
        raise ValueError(f"a ref is given to commit more than once; {_ONE_LINE}")
    return refs
