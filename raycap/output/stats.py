"""What the rows of one shard, or merged of a whole output, say: counts, tokens, percentiles.

Each builder task measures the rows it wrote (`ShardStats.from_table`, on the table
still in its memory) and reports that with its shard; the driver merges the shards'
stats into the output's totals, which the manifest records. Nothing is read back.

Counts add up across shards exactly; percentiles do not. So a shard's stats carry the
delivered fractions themselves (one float64 per unmasked rollout: a shard holds at most
a few dozen rollouts, so a few hundred bytes cross Ray), the driver concatenates them
when it merges, and the manifest keeps only the percentiles of the whole output. Token
lengths of the rows training receives travel the same way (one int64 per unmasked row),
so a trainer can pick its `seq_len` from p50/p90/p99 and the longest row. A shard
holds every row of each rollout it has (a batch never splits a rollout), so per-rollout
counts of chain delivery add up too. `raycap.output.summary` renders them for people.

This module does not import Ray.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from raycap.rows.columns import list_lengths, list_rows, to_numpy, valid

# Example errors: a few per shard, a few more in the totals. Enough to name the failure
# modes; the rows themselves hold every error.
SHARD_ERROR_EXAMPLES = 5
MAX_ERROR_EXAMPLES = 20
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class LengthStats:
    """Token lengths of the rows training receives: percentiles (nearest rank, so each is
    a length some row has), the longest row and its rollout id, and how many rows. The
    percentiles are None only when merged from stats that no longer hold every length."""

    rows: int
    p50: int | None
    p90: int | None
    p99: int | None
    max: int
    longest_rollout: str

    @classmethod
    def of(cls, lengths: np.ndarray, ids: list[str]) -> "LengthStats | None":
        if not len(lengths):
            return None
        p50, p90, p99 = (int(v) for v in np.percentile(lengths, [50, 90, 99], method="inverted_cdf"))
        longest = int(np.argmax(lengths))  # the first of equally long rows, in row order
        return cls(len(lengths), p50, p90, p99, int(lengths[longest]), ids[longest])


@dataclass(frozen=True, eq=False)
class ShardStats:
    """What the rows of one shard (or, merged, of a whole output) say, for the summary.

    `rows` are rows (chains in chain delivery), `rollouts` distinct rollouts. `masked`,
    `failed` and `masked_by_reason` count rows. Tokens count each rollout once:
    `tokens_captured` over every built rollout, `tokens_delivered` over unmasked ones.
    `delivered_fractions` holds one value per rollout with an unmasked row; it is not
    written to JSON (see the module docstring). `rollout_delivery_tokens` (chain delivery
    only) is what single-response delivery would have trained on: the loss-mask tokens of
    the main chains of rollouts it leaves unmasked.

    Picklable and small, so a builder task returns it through Ray; `a + b` and
    `ShardStats.merge` add shards up."""

    delivery: str = "rollout"
    rows: int = 0
    rollouts: int = 0
    masked: int = 0
    failed: int = 0
    masked_by_reason: dict[str, int] = field(default_factory=dict)
    error_examples: tuple[str, ...] = ()  # "<rollout_id>: <error>" of failed rows, the first few
    tokens_captured: int = 0
    tokens_delivered: int = 0
    rollout_delivery_tokens: int | None = None
    delivered_fractions: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float64))
    token_lengths: LengthStats | None = None
    # One length per row in `token_lengths`, in row order; like the delivered fractions it
    # is not written to JSON, and a merge recomputes the percentiles from it.
    row_lengths: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @classmethod
    def from_table(cls, table: pa.Table) -> "ShardStats":
        """Measure rows of ROLLOUT_SCHEMA or CHAIN_SCHEMA (chains: a `chain_id` column)."""
        chains = "chain_id" in table.column_names
        n = table.num_rows
        masked = to_numpy(table.column("mask_sample"), bool, True)  # fail closed: no verdict is masked
        errors = table.column("error")
        failed = masked & valid(errors)
        reasons: Counter[str] = Counter()
        for row_reasons, is_masked in zip(table.column("mask_reasons").to_pylist(), masked):
            if is_masked:
                reasons.update(set(row_reasons or ["unknown"]))
        examples = []
        if failed.any():
            ids = table.column("rollout_id")
            for i in np.flatnonzero(failed)[:SHARD_ERROR_EXAMPLES].tolist():
                # One line each: validation errors span several lines.
                examples.append(" ".join(f"{ids[i].as_py()}: {errors[i].as_py()}".split())[:_MAX_ERROR_CHARS])
        captured = to_numpy(table.column("generated_tokens_captured"), np.int64, 0)
        delivered = to_numpy(table.column("generated_tokens_delivered"), np.int64, 0)
        fractions = to_numpy(table.column("delivered_fraction"), np.float64, np.nan)
        if chains:
            # The rollout's metrics repeat on each of its chain rows: count each rollout once.
            ids = np.array(table.column("rollout_id").to_pylist(), dtype=object)
            _, first = np.unique(ids, return_index=True)
            rollouts = len(first)
            tokens_captured, tokens_delivered = int(captured[first].sum()), int(delivered[first].sum())
            _, first_live = np.unique(ids[~masked], return_index=True)
            kept = fractions[~masked][first_live]
            main = to_numpy(table.column("is_main"), bool, False) & ~to_numpy(table.column("rollout_mask_sample"), bool, True)
            trained = _row_sums(table.column("loss_mask"), n)
            by_main: int | None = int(trained[main].sum())
        else:
            rollouts = n
            tokens_captured, tokens_delivered = int(captured.sum()), int(delivered[~masked].sum())
            kept = fractions[~masked]
            by_main = None
        tokens = table.column("token_ids")
        fed = ~masked & valid(tokens)
        lengths = list_lengths(tokens)[fed]
        fed_ids = [str(v) for v, keep in zip(table.column("rollout_id").to_pylist(), fed) if keep]
        return cls(
            delivery="chains" if chains else "rollout",
            rows=n,
            rollouts=rollouts,
            masked=int(masked.sum()),
            failed=int(failed.sum()),
            masked_by_reason=dict(reasons),
            error_examples=tuple(examples),
            tokens_captured=tokens_captured,
            tokens_delivered=tokens_delivered,
            rollout_delivery_tokens=by_main,
            delivered_fractions=np.ascontiguousarray(kept[~np.isnan(kept)], dtype=np.float64),
            token_lengths=LengthStats.of(lengths, fed_ids),
            row_lengths=np.ascontiguousarray(lengths, dtype=np.int64),
        )

    @classmethod
    def merge(cls, stats: Iterable["ShardStats"], delivery: str = "rollout") -> "ShardStats":
        """The stats of all these shards together (`delivery` names an empty merge's kind)."""
        stats = list(stats)
        if not stats:
            return cls(delivery=delivery, rollout_delivery_tokens=0 if delivery == "chains" else None)
        kinds = {s.delivery for s in stats}
        if len(kinds) > 1:
            raise ValueError(f"cannot merge stats of different deliveries: {sorted(kinds)}")
        reasons: Counter[str] = Counter()
        examples: list[str] = []
        for s in stats:
            reasons.update(s.masked_by_reason)
            examples.extend(s.error_examples[: MAX_ERROR_EXAMPLES - len(examples)])
        by_main = [s.rollout_delivery_tokens for s in stats]
        return cls(
            delivery=stats[0].delivery,
            rows=sum(s.rows for s in stats),
            rollouts=sum(s.rollouts for s in stats),
            masked=sum(s.masked for s in stats),
            failed=sum(s.failed for s in stats),
            masked_by_reason=dict(reasons),
            error_examples=tuple(examples),
            tokens_captured=sum(s.tokens_captured for s in stats),
            tokens_delivered=sum(s.tokens_delivered for s in stats),
            rollout_delivery_tokens=None if None in by_main else sum(by_main),
            delivered_fractions=np.concatenate([s.delivered_fractions for s in stats]),
            token_lengths=_merge_lengths(stats),
            row_lengths=np.concatenate([s.row_lengths for s in stats]),
        )

    def __add__(self, other: "ShardStats") -> "ShardStats":
        return ShardStats.merge([self, other])

    def delivered_fraction_percentiles(self) -> "Percentiles | None":
        return percentiles(self.delivered_fractions)

    def to_json(self) -> dict[str, Any]:
        """The counts as JSON (the delivered fractions stay out: see the module docstring)."""
        out = {name: getattr(self, name) for name in _STATS_JSON_FIELDS}
        out["masked_by_reason"] = _most_frequent_first(Counter(self.masked_by_reason))
        out["error_examples"] = list(self.error_examples)
        out["token_lengths"] = None if self.token_lengths is None else asdict(self.token_lengths)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ShardStats":
        unknown = set(raw) - set(_STATS_JSON_FIELDS)
        if unknown:
            raise ValueError(f"unknown shard stats fields: {sorted(unknown)}")
        values = dict(raw)
        values["masked_by_reason"] = dict(values.get("masked_by_reason") or {})
        values["error_examples"] = tuple(values.get("error_examples") or ())
        lengths = values.get("token_lengths")
        values["token_lengths"] = None if lengths is None else LengthStats(**lengths)
        return cls(**values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardStats):
            return NotImplemented
        return self.to_json() == other.to_json() and np.array_equal(
            np.sort(self.delivered_fractions), np.sort(other.delivered_fractions)
        )


_STATS_JSON_FIELDS = (
    "delivery",
    "rows",
    "rollouts",
    "masked",
    "failed",
    "masked_by_reason",
    "error_examples",
    "tokens_captured",
    "tokens_delivered",
    "rollout_delivery_tokens",
    "token_lengths",
)


def _merge_lengths(stats: list["ShardStats"]) -> LengthStats | None:
    """The token lengths of merged shards. Percentiles need every row's length: stats read
    back from JSON carry none, so then only the longest row and the count are exact."""
    parts = [s.token_lengths for s in stats if s.token_lengths is not None]
    if not parts:
        return None
    rows = sum(p.rows for p in parts)
    longest = max(parts, key=lambda p: p.max)  # max() keeps the first of equal ones
    lengths = np.concatenate([s.row_lengths for s in stats])
    if len(lengths) == rows:
        p50, p90, p99 = (int(v) for v in np.percentile(lengths, [50, 90, 99], method="inverted_cdf"))
        return LengthStats(rows, p50, p90, p99, longest.max, longest.longest_rollout)
    return LengthStats(rows, None, None, None, longest.max, longest.longest_rollout)


def _row_sums(column: pa.ChunkedArray, n: int) -> np.ndarray:
    """Per-row sums of an int list column (null rows sum to 0), without per-item Python."""
    sums = [0 if row is None else int(row.sum(dtype=np.int64)) for row in list_rows(column)]
    return np.array(sums, dtype=np.int64) if sums else np.zeros(n, dtype=np.int64)


@dataclass(frozen=True)
class Percentiles:
    p10: float
    p50: float
    p90: float


def percentiles(values: np.ndarray) -> Percentiles | None:
    """p10/p50/p90 of the values (rounded to 4 decimals), None when there are none."""
    if not len(values):
        return None
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    p10, p50, p90 = (round(linear_percentile(ordered, q), 4) for q in (10, 50, 90))
    return Percentiles(p10, p50, p90)


def linear_percentile(ordered: np.ndarray, q: float) -> float:
    """`np.percentile(values, q)`, 0 <= q <= 100 (its default, linear method) of sorted float values
    without NaN, computed as numpy computes it, to the bit. numpy's own call sorts
    through `np.unique`, whose first use imports numpy.ma: 20 ms of every process that
    commits an output."""
    n = len(ordered)
    position = (n - 1) * (q / 100)  # numpy's virtual index for the linear method
    if position >= n - 1:  # q = 100, or a single value
        return float(ordered[-1])
    below = math.floor(position)
    a, b = float(ordered[below]), float(ordered[below + 1])
    t = position - below
    # numpy's lerp: from the nearer end, so that t = 1 gives b exactly.
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def _most_frequent_first(reasons: Counter[str]) -> dict[str, int]:
    return dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0])))
