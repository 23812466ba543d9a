"""What a rebuild produced, for people: a progress line while it runs, a summary after.

The summary is computed from the durable output itself, reading only its small scalar
columns batch by batch, so a reused output is summarised exactly like a fresh one and
memory stays flat. It reports:

- rollouts, and the masked share broken down by reason (the `mask_reasons` column). A
  row counts once per distinct reason, so the reasons can add up to more than the
  masked total;
- delivered-fraction percentiles (p10/p50/p90) over unmasked rows;
- generated tokens captured (every built row) and delivered (unmasked rows only: what
  training receives);
- throughput (rollouts/s and Arrow MB/s), known only when the rows were built in this run.

`mask_gate` applies `max_mask_fraction`: the masked share may not exceed it once at least
`mask_fraction_min_samples` rows exist. Below that count a handful of bad rollouts would
decide too much, so the check is reported as not applied.

`ProgressLine` redraws `done/total` and rollouts/s on one terminal line. When its stream
is not a terminal (a job log, a pipe) it prints only the final line, so logs do not fill
up with redraws.

This module does not import Ray.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_SUMMARY_COLUMNS = (
    "mask_sample",
    "error",
    "mask_reasons",
    "delivered_fraction",
    "generated_tokens_captured",
    "generated_tokens_delivered",
)
_MAX_LISTED_ERRORS = 20


@dataclass(frozen=True)
class Percentiles:
    p10: float
    p50: float
    p90: float


@dataclass(frozen=True)
class Throughput:
    """How fast this run built the rows; mb_per_s counts the Arrow bytes built."""

    seconds: float
    rollouts_per_s: float
    mb_per_s: float | None = None


@dataclass
class RetireCounts:
    """What retirement did: snapshots dropped, kept because they changed, or failed."""

    dropped: int = 0
    changed: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MaskCheck:
    """The max_mask_fraction verdict; `applied` is False below the minimum sample count."""

    max_mask_fraction: float
    min_samples: int
    applied: bool
    passed: bool
    message: str


@dataclass
class RebuildSummary:
    output: str
    rollouts: int
    masked: int  # masked rows (rollouts, or chains in chain delivery)
    failed: int  # masked rows whose build failed outright (error set)
    masked_by_reason: dict[str, int]  # most frequent first
    delivered_fraction: Percentiles | None  # None when no row is unmasked
    generated_tokens_captured: int
    generated_tokens_delivered: int
    output_bytes: int
    reused: bool = False
    throughput: Throughput | None = None
    retired: RetireCounts | None = None
    retire_skipped: str | None = None  # why retirement was asked for but not done
    mask_check: MaskCheck | None = None
    delivery: str = "rollout"
    rows: int | None = None  # chain delivery: one row per chain
    # Chain delivery: the generated tokens single-response delivery would have delivered
    # (main chains of rollouts it leaves unmasked), to show what chain delivery recovers.
    rollout_delivery_tokens: int | None = None

    @property
    def row_count(self) -> int:
        return self.rollouts if self.rows is None else self.rows

    @property
    def masked_fraction(self) -> float:
        return self.masked / self.row_count if self.row_count else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["masked_fraction"] = round(self.masked_fraction, 4)
        out["masked_share_by_reason"] = {
            reason: round(count / self.row_count, 4) for reason, count in self.masked_by_reason.items()
        }
        if self.retired is not None:
            out["retired"]["errors"] = self.retired.errors[:_MAX_LISTED_ERRORS]
            out["retired"]["error_count"] = len(self.retired.errors)
        return out

    def render(self) -> str:
        """The summary as an aligned, readable table."""
        size = f"{self.output_bytes / 1e6:.1f} MB"
        digits = len(f"{self.row_count:,}")

        def count(n: int) -> str:
            return f"{n:>{digits},}  {_share(n, self.row_count)}".rstrip()

        rows: list[tuple[str, str]] = [("output", f"{self.output} ({size}{', reused' if self.reused else ''})")]
        rows.append(("rollouts", f"{self.rollouts:,}"))
        if self.rows is not None:
            rows.append(("chains (rows)", f"{self.rows:,}"))
        rows.append(("unmasked", count(self.row_count - self.masked)))
        rows.append(("masked", count(self.masked) + ("  (a row may have several reasons)" if len(self.masked_by_reason) > 1 else "")))
        for reason, n in self.masked_by_reason.items():
            rows.append((f"  {reason}", count(n)))
        if self.delivered_fraction is None:
            rows.append(("delivered fraction", "no unmasked rows"))
        else:
            d = self.delivered_fraction
            rows.append(("delivered fraction", f"p10 {d.p10:.3f}  p50 {d.p50:.3f}  p90 {d.p90:.3f}  (unmasked rows)"))
        rows.append(
            (
                "generated tokens",
                f"captured {self.generated_tokens_captured:,} (rows that built)  "
                f"delivered {self.generated_tokens_delivered:,} (unmasked rows)",
            )
        )
        if self.rollout_delivery_tokens is not None:
            gained = self.generated_tokens_delivered - self.rollout_delivery_tokens
            rows.append(
                (
                    "vs rollout delivery",
                    f"{self.rollout_delivery_tokens:,} delivered by main chains alone; chain delivery recovers "
                    f"{gained:+,} ({_share(gained, self.generated_tokens_captured).strip('()')} of captured)",
                )
            )
        if self.throughput is not None:
            t = self.throughput
            rate = f"{t.rollouts_per_s:.1f} rollouts/s"
            if t.mb_per_s is not None:
                rate += f", {t.mb_per_s:.1f} MB/s (Arrow)"
            rows.append(("throughput", f"{t.seconds:.1f} s, {rate}"))
        elif self.reused:
            rows.append(("throughput", "not measured: rows were reused, not rebuilt"))
        if self.mask_check is not None:
            rows.append(("mask check", self.mask_check.message))
        if self.retired is not None:
            r = self.retired
            rows.append(("retired", f"{r.dropped:,} snapshots dropped, {r.changed:,} changed (kept), {len(r.errors):,} errors"))
        elif self.retire_skipped:
            rows.append(("retired", f"nothing: {self.retire_skipped}"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _share(count: int, total: int) -> str:
    return f"({100.0 * count / total:.1f}%)" if total else ""


def summarize(
    path: str | Path,
    *,
    reused: bool = False,
    throughput: Throughput | None = None,
    batch_rows: int = 65536,
) -> RebuildSummary:
    """Summarise a rebuild output file (ROLLOUT_SCHEMA rows, or CHAIN_SCHEMA rows)."""
    parquet = pq.ParquetFile(path)
    if "chain_id" in parquet.schema_arrow.names:
        return _summarize_chains(parquet, path, reused=reused, throughput=throughput, batch_rows=batch_rows)
    rollouts = masked = failed = captured = delivered = 0
    reasons: Counter[str] = Counter()
    fractions: list[np.ndarray] = []
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=list(_SUMMARY_COLUMNS)):
        table = pa.Table.from_batches([batch])
        mask = pc.fill_null(table.column("mask_sample"), True)
        unmasked = pc.invert(mask)
        rollouts += table.num_rows
        masked += pc.sum(pc.cast(mask, pa.int64())).as_py() or 0
        failed += pc.sum(pc.cast(pc.and_(mask, pc.is_valid(table.column("error"))), pa.int64())).as_py() or 0
        captured += pc.sum(table.column("generated_tokens_captured")).as_py() or 0
        delivered += pc.sum(pc.filter(table.column("generated_tokens_delivered"), unmasked)).as_py() or 0
        kept = pc.filter(table.column("delivered_fraction"), unmasked).drop_null()
        fractions.append(kept.to_numpy())
        for row_reasons in pc.filter(table.column("mask_reasons"), mask).to_pylist():
            reasons.update(set(row_reasons or ["unknown"]))
    values = np.concatenate(fractions) if fractions else np.empty(0)
    return _summary(path, reused, throughput, rollouts, masked, failed, reasons, values, captured, delivered)


def _summary(
    path: str | Path,
    reused: bool,
    throughput: Throughput | None,
    rollouts: int,
    masked: int,
    failed: int,
    reasons: Counter[str],
    fractions: np.ndarray,
    captured: int,
    delivered: int,
) -> RebuildSummary:
    return RebuildSummary(
        output=str(path),
        rollouts=rollouts,
        masked=masked,
        failed=failed,
        masked_by_reason=_most_frequent_first(reasons),
        delivered_fraction=_percentiles(fractions),
        generated_tokens_captured=captured,
        generated_tokens_delivered=delivered,
        output_bytes=Path(path).stat().st_size,
        reused=reused,
        throughput=throughput,
    )


def _percentiles(values: np.ndarray) -> Percentiles | None:
    if not len(values):
        return None
    p10, p50, p90 = (round(float(v), 4) for v in np.percentile(values, [10, 50, 90]))
    return Percentiles(p10, p50, p90)


def _most_frequent_first(reasons: Counter[str]) -> dict[str, int]:
    return dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0])))


def _row_sums(column: pa.ChunkedArray) -> list[int]:
    """Per-row sums of an int list column (nulls count 0), without touching items in Python."""
    out: list[int] = []
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values = np.concatenate([[0], np.cumsum(chunk.values.to_numpy(zero_copy_only=False), dtype=np.int64)])
        sums = values[offsets[1:]] - values[offsets[:-1]]
        sums[~chunk.is_valid().to_numpy(zero_copy_only=False)] = 0
        out.extend(sums.tolist())
    return out


def _summarize_chains(
    parquet: pq.ParquetFile, path: str | Path, *, reused: bool, throughput: Throughput | None, batch_rows: int
) -> RebuildSummary:
    """Chain delivery: rows are chains; token counts and fractions are per rollout (the
    rollout columns repeat on each of its rows, so each rollout is counted once)."""
    columns = [*_SUMMARY_COLUMNS, "rollout_id", "is_main", "rollout_mask_sample", "loss_mask"]
    rows = masked = failed = captured = delivered = by_main = 0
    rollouts: set[str] = set()
    reasons: Counter[str] = Counter()
    fractions: list[float] = []
    live_rollouts: set[str] = set()
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
        table = pa.Table.from_batches([batch])
        trained = _row_sums(table.column("loss_mask"))
        for row, row_trained in zip(table.drop_columns(["loss_mask"]).to_pylist(), trained):
            rows += 1
            rid = row["rollout_id"]
            is_masked = row["mask_sample"] is not False
            if is_masked:
                masked += 1
                failed += row["error"] is not None
                reasons.update(set(row["mask_reasons"] or ["unknown"]))
            elif rid not in live_rollouts:
                live_rollouts.add(rid)
                if row["delivered_fraction"] is not None:
                    fractions.append(row["delivered_fraction"])
            if rid not in rollouts:
                rollouts.add(rid)
                captured += row["generated_tokens_captured"] or 0
                delivered += row["generated_tokens_delivered"] or 0
            if row["is_main"] and row["rollout_mask_sample"] is False:
                by_main += row_trained
    values = np.asarray(fractions, dtype=np.float64)
    summary = _summary(path, reused, throughput, len(rollouts), masked, failed, reasons, values, captured, delivered)
    summary.delivery, summary.rows, summary.rollout_delivery_tokens = "chains", rows, by_main
    return summary


def mask_gate(summary: RebuildSummary, max_mask_fraction: float | None, min_samples: int) -> MaskCheck | None:
    """Judge the masked share against max_mask_fraction; None when no maximum is set."""
    if max_mask_fraction is None:
        return None
    share = summary.masked_fraction
    limit = f"max_mask_fraction {100 * max_mask_fraction:.1f}%"
    if summary.row_count < min_samples:
        return MaskCheck(
            max_mask_fraction, min_samples, False, True,
            f"not applied: {summary.row_count} rows, fewer than mask_fraction_min_samples {min_samples}",
        )
    if share <= max_mask_fraction:
        return MaskCheck(max_mask_fraction, min_samples, True, True, f"passed: {100 * share:.1f}% masked <= {limit}")
    reasons = ", ".join(f"{reason} {count}" for reason, count in summary.masked_by_reason.items())
    return MaskCheck(
        max_mask_fraction, min_samples, True, False,
        f"failed: {summary.masked} of {summary.rollouts} rollouts masked ({100 * share:.1f}%) > {limit}; "
        f"reasons: {reasons}",
    )


class _ProgressState(Protocol):
    total: int
    done: int
    started: float  # time.monotonic() at the start


class ProgressLine:
    """A one-line progress display: call it with progress updates, then `finish()`."""

    BAR_WIDTH = 24

    def __init__(self, label: str = "rebuild", stream: TextIO | None = None, *, interval: float = 0.2) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.interval = interval
        self._state: _ProgressState | None = None
        self._drawn_at = 0.0
        self._width = 0

    def __call__(self, state: _ProgressState) -> None:
        self._state = state
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._drawn_at < self.interval and state.done < state.total:
            return
        self._drawn_at = now
        self._draw(self._line(state, now), end="")

    def _draw(self, text: str, end: str) -> None:
        # Pad over the previous line's tail: plain text, no terminal escape codes.
        padded = text.ljust(self._width)
        self._width = len(text)
        self.stream.write(("\r" if self.tty else "") + padded + end)
        self.stream.flush()

    def _line(self, state: _ProgressState, now: float) -> str:
        elapsed = max(now - state.started, 1e-9)
        rate = state.done / elapsed
        filled = int(self.BAR_WIDTH * state.done / state.total) if state.total else self.BAR_WIDTH
        bar = "#" * filled + "." * (self.BAR_WIDTH - filled)
        line = f"{self.label} [{bar}] {state.done:,}/{state.total:,} rollouts  {rate:.1f} rollouts/s"
        if 0 < state.done < state.total and rate > 0:
            line += f"  ETA {(state.total - state.done) / rate:.0f} s"
        return line

    def finish(self) -> None:
        """Print the final line (also when the stream is not a terminal)."""
        if self._state is None:
            return
        state = self._state
        elapsed = max(time.monotonic() - state.started, 1e-9)
        self._draw(
            f"{self.label}: {state.done:,}/{state.total:,} rollouts in {elapsed:.1f} s "
            f"({state.done / elapsed:.1f} rollouts/s)",
            end="\n",
        )
