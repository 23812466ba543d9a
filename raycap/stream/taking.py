"""How a stream hands out built rows: `take`, `take_refs` and their async forms, mixed
into `raycap.runs.stream.Stream`, whose state (its condition, queues and ledger) they use.

- `take(n)` returns the next rows in ready order, blocking until `n` rollouts are built
  or the timeout passes; `n` counts rollouts (a rollout's chain rows come together), and
  masked rows are rows. Builds run ahead in the background, bounded by `max_ahead_rows`
  and `max_ahead_bytes`.
- Where rows live: a taker of tables gets rows built into this process. Once a take has
  asked for refs and builds run on Ray, rows stay in the object store and this process
  holds only their metadata (`META_COLUMNS`); `take_refs(n)` fetches nothing, and a Ray
  task cuts the taken rows out and applies the stale masks there.
- Staleness: with `version_key`, `current_version` and `max_staleness`, a row whose
  `version_min` is below `current_version - max_staleness` is delivered masked with the
  reason `stale` (`raycap.stream.steps.mask_stale`). Rows without versions are never
  stale (said once per stream). Stale rows are masked rows: committing them keeps their
  captures as evidence.

`take` checks all its arguments before it takes anything. The rules in full:
docs/internals.md ("How a stream hands out rows").
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import time
import warnings
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raycap.stream.records import row_values, with_records
from raycap.stream.steps import Built, PiecesLost, mask_stale

# The stream's own logger: what a take says is said by the stream.
logger = logging.getLogger("raycap.runs.stream")

_INT64 = (-(1 << 63), (1 << 63) - 1)
_REFS_DEPRECATED = "Stream.{}(..., refs=True) is deprecated: call Stream.{}(...), the one way to take refs"


class Taking:
    """The taking half of `raycap.runs.stream.Stream` (see this module's docstring)."""

    def take(
        self,
        n: int,
        timeout: float | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
        *,
        refs: bool = False,
    ) -> pa.Table | list[Any]:
        """The next `n` rollouts' rows in ready order (see the module docstring): waits
        until `n` are built or `timeout` seconds pass, then returns what is there (maybe
        none). The arguments are checked before anything is taken (TypeError or
        ValueError, one line). `refs=True` is deprecated: call `take_refs`."""
        if refs is True:
            warnings.warn(_REFS_DEPRECATED.format("take", "take_refs"), DeprecationWarning, stacklevel=2)
        return self._take(n, timeout, current_version, max_staleness, refs)

    def take_refs(self, n: int, timeout: float | None = None, current_version: int | None = None,
                  max_staleness: int | None = None) -> list[Any]:
        """`take`, returning a list holding the ObjectRef of the Arrow table (Ray) instead
        of the table, for trainer workers on other nodes; the rows are not fetched here."""
        return self._take(n, timeout, current_version, max_staleness, True)

    def _take(self, n: int, timeout: float | None, current_version: int | None, max_staleness: int | None,
              refs: bool) -> pa.Table | list[Any]:
        oldest = _checked_take(n, timeout, current_version, max_staleness, refs)
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        while True:
            pieces = self._next(n, deadline, refs)
            try:
                result, delivered, stale = self._deliver(pieces, oldest, refs)
            except PiecesLost as lost:
                # Rows lost with their node before they were handed out: not delivered
                # (a stream that sees the node again does); the others are taken again.
                gone = set(lost.rollout_ids)
                with self._cond:
                    self._unseal(pieces)
                    self._built.extendleft(reversed([p for p in pieces if p.rollout_id not in gone]))
                    for piece in pieces:
                        if piece.rollout_id not in gone:
                            self._ahead_rows += piece.rows
                            self._ahead_bytes += piece.nbytes
                    self._known.difference_update(gone)
                    for rid in gone:
                        self._records.pop(rid, None)
                    self.stats.lost += len(gone)
                self.dirs.settled(list(gone))
                continue
            except BaseException:
                # Nothing was handed out (a batch lost on Ray, say): build them again, first.
                with self._cond:
                    self._unseal(pieces)
                    self._ready.extendleft(reversed([p.rollout_id for p in pieces]))
                    self._cond.notify_all()
                raise
            break
        rows = delivered.num_rows
        if oldest is not None and rows:
            self._warn_unversioned(delivered)
        with self._cond:
            self.stats.delivered += len(pieces)
            self.stats.rows_delivered += rows
            self.stats.stale += stale
            waiting = self._waiting()
        self.figures.took([p.rollout_id for p in pieces], delivered, current_version, waiting)
        return result

    def _next(self, n: int, deadline: float | None, refs: bool) -> list[Built]:
        """Wait until `n` rollouts are built or the deadline passes; take them off the queue."""
        with self._cond:
            self._refs_wanted = refs
            self._wanted = max(self._wanted, n)
            self._cond.notify_all()
            try:
                while len(self._built) < n and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
            finally:
                self._wanted = 0
            pieces = [self._built.popleft() for _ in range(min(n, len(self._built)))]
            for piece in pieces:
                self._ahead_rows -= piece.rows
                self._ahead_bytes -= piece.nbytes
            self._cond.notify_all()
            # A submit keeping a record for one of them finishes first: the rollout is
            # taken with the record it kept, and no record is attached to it after.
            while self._attaching.intersection(p.rollout_id for p in pieces):
                self._cond.wait()
            for piece in pieces:
                self._sealed[piece.rollout_id] = self._records.pop(piece.rollout_id, None) or piece.record
        return pieces

    def _unseal(self, pieces: list[Built]) -> None:
        """These pieces were not handed out: their records may change again (under the lock)."""
        for piece in pieces:
            kept = self._sealed.pop(piece.rollout_id, None)
            if kept is not None:
                self._records[piece.rollout_id] = kept

    def _deliver(self, pieces: list[Built], oldest: int | None, refs: bool) -> tuple[Any, pa.Table, int]:
        """What take returns for `pieces` (stale masks applied), the rows (or metadata)
        recorded as delivered, and how many rollouts staleness masked."""
        remote = [p for p in pieces if p.ref is not None]
        counts = [(p.rollout_id, p.rows) for p in pieces]
        with self._cond:
            records = {p.rollout_id: self._sealed.get(p.rollout_id) for p in pieces}
        values = [None if records[p.rollout_id] is None else row_values(records[p.rollout_id]) for p in pieces]
        result: pa.Table | list[Any]
        if refs and pieces and len(remote) == len(pieces):
            # The rows are assembled (and masked) where they are; this process computes
            # the same masks on the metadata, which is what commit reads.
            meta, stale = mask_stale(pa.concat_tables([p.table for p in pieces]), oldest)
            ref = self.dirs.assemble(pieces, oldest, values)
            self._commit.ledger.record(meta, counts, whole=False, ref=ref, records=records)
            result, delivered = [ref], meta
        else:
            rows = with_records(self.dirs.fetch(pieces), [p.rows for p in pieces], values)
            table, stale = mask_stale(rows, oldest)
            result, delivered = table, table
            if refs:
                import ray

                result = [ray.put(table)]  # rows built here: they are in this process already
            self._commit.ledger.record(table, counts, whole=True, ref=result[0] if refs else None, records=records)
        return result, delivered, stale

    async def take_async(self, n: int, timeout: float | None = None, current_version: int | None = None,
                         max_staleness: int | None = None, *, refs: bool = False) -> pa.Table | list[Any]:
        """`take` without blocking the event loop (its arguments checked here, first).
        `refs=True` is deprecated: call `take_refs_async`."""
        if refs is True:
            warnings.warn(_REFS_DEPRECATED.format("take_async", "take_refs_async"), DeprecationWarning, stacklevel=2)
        _checked_take(n, timeout, current_version, max_staleness, refs)
        return await asyncio.to_thread(self._take, n, timeout, current_version, max_staleness, refs)

    async def take_refs_async(self, n: int, timeout: float | None = None, current_version: int | None = None,
                              max_staleness: int | None = None) -> list[Any]:
        """`take_refs` without blocking the event loop (its arguments checked here, first)."""
        _checked_take(n, timeout, current_version, max_staleness, True)
        return await asyncio.to_thread(self._take, n, timeout, current_version, max_staleness, True)

    def _warn_unversioned(self, rows: pa.Table) -> None:
        """Staleness was asked for: say once if a built row carries no version, since
        such a row is never stale (a missing or non-integer version, or no version_key)."""
        if self._warned_versions:
            return
        if self.version_key is None:
            self._warned_versions = True
            logger.warning("take() was given current_version and max_staleness, but this stream has no version_key: "
                           "no row is ever stale; give Stream(version_key=...) the record field holding the version")
            return
        unversioned = pc.and_(pc.is_null(rows.column("version_min")), pc.is_null(rows.column("error")))
        if not pc.any(unversioned).as_py():
            return
        self._warned_versions = True
        rid = rows.filter(unversioned).column("rollout_id")[0].as_py()
        logger.warning(
            "rollout %s has no integer %r in its records (missing, or not an integer such as \"5\" or 5.5): its rows "
            "are never stale, so staleness does not bound them; write integer versions under %r (said once per "
            "stream)", rid, self.version_key, self.version_key,
        )


def _is_int(value: Any) -> bool:
    # bool is an int, but take(True) or max_staleness=False is a slip, never a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_take(n: Any, timeout: Any, current_version: Any, max_staleness: Any, refs: Any) -> int | None:
    """take()'s arguments checked before anything is taken; the oldest version that is
    not stale (None: no staleness bound)."""
    if not _is_int(n):
        raise TypeError(f"take(n) counts rollouts: n must be an int, not {type(n).__name__} {n!r:.40}")
    if n < 1:
        raise ValueError(f"take(n) needs n >= 1, got {n}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__} {timeout!r:.40}")
        if not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds or None (wait forever), not {timeout}")
    if not isinstance(refs, bool):
        raise TypeError(f"refs must be True or False, not {type(refs).__name__}")
    if (current_version is None) != (max_staleness is None):
        raise ValueError("give both current_version and max_staleness to bound staleness, or neither")
    if current_version is None:
        return None
    for name, value in (("current_version", current_version), ("max_staleness", max_staleness)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r:.40}")
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"{name} {value} does not fit in 64 bits, as versions in rows do")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 (0: only the current version is fresh), not {max_staleness}")
    # Clamped: below the lowest 64-bit version nothing is stale, as the unclamped bound says.
    return max(int(current_version) - int(max_staleness), _INT64[0])
