"""What a rebuild produced, for people: a progress line while it runs, a summary after.

The summary is never computed by reading rows back: each builder task measures the rows
it wrote (`ShardStats`), the driver merges the shards' stats into the totals the
manifest records, so a reused output is summarised like a fresh one. It reports:

- rollouts, and the masked share by reason (a row counts once per distinct reason), with
  a few example errors;
- delivered-fraction percentiles over unmasked rollouts (merged from the shards' values,
  since percentiles do not add up);
- generated tokens captured and delivered; throughput, when built in this run;
- which executor built the rows, and why.

`mask_gate` applies `max_mask_fraction` once at least `mask_fraction_min_samples` rows
exist (below that it is reported as not applied). `timings_s` holds the run's seconds per
stage (`raycap.observe.timing.STAGES`); `ProgressLine` is `raycap.observe.progress`'s.

The summary in full: docs/internals.md ("The summary"). No Ray.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from raycap.observe.progress import ProgressLine as ProgressLine
from raycap.observe.timing import render as render_timings
from raycap.output.recordparts import RecordCounts

# Shard statistics live with the data they describe; the names stay importable from here.
from raycap.output.stats import MAX_ERROR_EXAMPLES as MAX_ERROR_EXAMPLES
from raycap.output.stats import SHARD_ERROR_EXAMPLES as SHARD_ERROR_EXAMPLES
from raycap.output.stats import LengthStats as LengthStats
from raycap.output.stats import Percentiles, _most_frequent_first
from raycap.output.stats import ShardStats as ShardStats
from raycap.output.stats import percentiles as percentiles

if TYPE_CHECKING:
    from raycap.output.manifest import Manifest

_MAX_LISTED_ERRORS = 20
_RENDERED_ERRORS = 3
_RENDERED_ERROR_CHARS = 140


@dataclass(frozen=True)
class Throughput:
    """How fast this run built the rows; mb_per_s counts the Arrow bytes built."""

    seconds: float
    rollouts_per_s: float
    mb_per_s: float | None = None


@dataclass(frozen=True)
class Executor:
    """Where this run built the rows ("ray", or "local": in the driver's process) and why."""

    name: str
    reason: str


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
    error_examples: list[str] = field(default_factory=list)  # a few failed rows, "<rollout_id>: <error>"
    superseded: str | None = None  # where an output this run replaced was moved (never deleted)
    executor: Executor | None = None  # None when nothing was built (the output was reused)
    token_lengths: LengthStats | None = None  # None when no row is unmasked
    # A finalized results file (`raycap.finalize_rollouts`): its records by outcome, and
    # where they were also written as one results file.
    records: RecordCounts | None = None
    records_file: str | None = None
    # Seconds per stage of this run (`raycap.observe.timing.STAGES`; only stages it ran),
    # and the capture bytes its batches read (0 when nothing was built).
    timings_s: dict[str, float] = field(default_factory=dict)
    capture_bytes_read: int = 0

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
        if self.superseded:
            rows.append(("replaced", f"the previous output was moved to {self.superseded}"))
        if self.records is not None:
            rows.extend(_record_rows(self.records, self.records_file))
        rows.append(("rollouts", f"{self.rollouts:,}"))
        if self.rows is not None:
            rows.append(("chains (rows)", f"{self.rows:,}"))
        rows.append(("unmasked", count(self.row_count - self.masked)))
        several = len(self.masked_by_reason) > 1 and self.records is None
        rows.append(("masked", count(self.masked) + ("  (a row may have several reasons)" if several else "")))
        # A finalized results file lists its masked records by reason above, once.
        for reason, n in self.masked_by_reason.items() if self.records is None else ():
            rows.append((f"  {reason}", count(n)))
        for example in self.error_examples[:_RENDERED_ERRORS]:
            rows.append(("  e.g.", shortened(example, _RENDERED_ERROR_CHARS)))
        if self.delivered_fraction is None:
            rows.append(("delivered fraction", "no unmasked rows"))
        else:
            d = self.delivered_fraction
            rows.append(("delivered fraction", f"p10 {d.p10:.3f}  p50 {d.p50:.3f}  p90 {d.p90:.3f}  (unmasked rows)"))
        if self.token_lengths is not None:
            t = self.token_lengths
            spread = "" if t.p50 is None else f"p50 {t.p50:,}  p90 {t.p90:,}  p99 {t.p99:,}  "
            rows.append(("token length", f"{spread}max {t.max:,} (rollout {t.longest_rollout})  (unmasked rows; seq_len must be >= max)"))
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
        if self.timings_s:
            rows.append(("timings", render_timings(self.timings_s)))
        if self.executor is not None:
            rows.append(("executor", f"{self.executor.name} ({self.executor.reason})"))
        if self.throughput is None and self.reused:
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


def _record_rows(counts: RecordCounts, records_file: str | None) -> list[tuple[str, str]]:
    """The records of a finalized results file by outcome, as the summary shows them."""
    n = counts.finalized
    rows = [
        ("records", f"{counts.records:,}"),
        (
            "  finalized",
            f"{n:,}  ({counts.rebuilt:,} rebuilt, one row each; {counts.redundant:,} with their own token ids; "
            f"{counts.unusable:,} unusable)",
        ),
        ("  left unchanged", f"{counts.unchanged:,}"),
        ("  masked", f"{counts.masked:,} of {n:,} finalized  {_share(counts.masked, n)}".rstrip()),
    ]
    for reason, count in sorted(counts.masked_by_reason.items(), key=lambda item: (-item[1], item[0])):
        rows.append((f"    {count:,}", shortened(reason, _RENDERED_ERROR_CHARS)))
    if records_file:
        rows.append(("records file", records_file))
    return rows


def shortened(text: str, limit: int) -> str:
    """`text` on one line, at most about `limit` characters: whole when it fits, else
    without pydantic's input trailer, cut at a word boundary, keeping the way out after
    its last "; " when there is one."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    # pydantic's trailer (" [type=..., input_value=...]") repeats the input: the message
    # and its way out come before it.
    text = text.split(" [type=", 1)[0]
    if len(text) <= limit:
        return text
    head, _, way_out = text.rpartition("; ")
    if not head or len(way_out) > limit // 2:
        head, way_out = text, ""
    room = max(limit - len(way_out) - 6, 20)
    cut = head[:room].rsplit(" ", 1)[0] if " " in head[:room] else head[:room]
    return f"{cut} ...; {way_out}" if way_out else f"{cut} ..."


def _share(count: int, total: int) -> str:
    return f"({100.0 * count / total:.1f}%)" if total else ""


def summarize(
    manifest: "Manifest",
    *,
    reused: bool = False,
    throughput: Throughput | None = None,
    superseded: str | None = None,
    executor: Executor | None = None,
) -> RebuildSummary:
    """Summarise a committed output from its manifest (`raycap.output.manifest.read_manifest`)."""
    totals = manifest.totals
    chains = totals.delivery == "chains"
    return RebuildSummary(
        output=str(manifest.path),
        rollouts=totals.rollouts,
        masked=totals.masked,
        failed=totals.failed,
        masked_by_reason=_most_frequent_first(Counter(totals.masked_by_reason)),
        delivered_fraction=manifest.delivered_fraction,
        generated_tokens_captured=totals.tokens_captured,
        generated_tokens_delivered=totals.tokens_delivered,
        output_bytes=manifest.file_bytes,
        reused=reused,
        throughput=throughput,
        delivery=totals.delivery,
        rows=totals.rows if chains else None,
        rollout_delivery_tokens=totals.rollout_delivery_tokens if chains else None,
        error_examples=list(totals.error_examples),
        superseded=superseded,
        executor=executor,
        token_lengths=totals.token_lengths,
        records=None if manifest.records is None else manifest.records.counts,
    )


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


def records_gate(counts: RecordCounts, max_mask_fraction: float | None, min_samples: int) -> MaskCheck | None:
    """Judge the masked share of finalized records against max_mask_fraction, as a
    rollout collection does (SPEC 10.6), over all of a results file's records: applied
    once at least `min_samples` records were finalized, failed when more than the limit
    of them are masked; the message of a failure is the collection's. None when no
    maximum is set."""
    if max_mask_fraction is None:
        return None
    n, m = counts.finalized, counts.masked
    if n < min_samples or not n:
        return MaskCheck(
            max_mask_fraction, min_samples, False, True,
            f"not applied: {n} finalized rollouts, fewer than mask_fraction_min_samples {min_samples}",
        )
    if m / n <= max_mask_fraction:
        return MaskCheck(
            max_mask_fraction, min_samples, True, True,
            f"passed: {m}/{n} finalized rollouts ({m / n:.1%}) are masked, within max_mask_fraction={max_mask_fraction}",
        )
    return MaskCheck(
        max_mask_fraction, min_samples, True, False,
        f"{m}/{n} finalized rollouts ({m / n:.1%}) are masked, exceeding token_id_capture.max_mask_fraction="
        f"{max_mask_fraction}. Mask reasons: {dict(counts.masked_by_reason)!r}.",
    )
