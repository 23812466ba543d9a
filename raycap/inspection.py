"""What an output holds, for a person choosing training settings (`raycap inspect OUTPUT`).

`inspect_output` reads a raycap output (a Parquet dataset directory, committed or not,
or one Parquet file) and reports, from the rows themselves:

- rows and distinct rollouts (they differ in chain delivery, one row per chain);
- unmasked, masked and failed rows (failed: the build raised, `error` is set), and the
  masked rows by reason (the `mask_reasons` column; a row may have several);
- the token lengths of the trainable rows (unmasked, with token ids): p50, p90, p99,
  the longest and its rollout, and a histogram, so a user can pick `seq_len` knowing
  which rows it would refuse. Masked rows are never fed, so their lengths do not count.

Only the few columns this needs are read, and lengths come from Arrow's list offsets,
never from the token arrays. The PNG histogram needs matplotlib, which raycap does not
depend on: `write_png` says so, as a typed result, when it is missing.

This module does not import Ray.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

logger = logging.getLogger(__name__)

_COLUMNS = ("rollout_id", "mask_sample", "error", "mask_reasons", "token_ids")
HISTOGRAM_BINS = 10
_BAR_WIDTH = 40


class InspectError(ValueError):
    """The path is not a readable raycap output; the message names it and the way out."""


@dataclass(frozen=True)
class LengthStats:
    """Token lengths of the trainable rows."""

    p50: float
    p90: float
    p99: float
    max: int
    longest_rollout: str


@dataclass(frozen=True)
class OutputReport:
    output: str
    rows: int
    rollouts: int
    unmasked: int
    masked: int
    failed: int
    mask_reasons: dict[str, int]  # most frequent first
    lengths: np.ndarray  # token length of each trainable row, in row order
    length_stats: LengthStats | None  # None when no row is trainable

    def histogram(self, bins: int = HISTOGRAM_BINS) -> tuple[np.ndarray, np.ndarray]:
        """(counts, edges) of the trainable rows' lengths."""
        return np.histogram(self.lengths, bins=bins)

    def render(self, bins: int = HISTOGRAM_BINS) -> str:
        def share(n: int) -> str:
            return f"  ({100.0 * n / self.rows:.1f}%)" if self.rows else ""

        lines = [
            f"output      {self.output}",
            f"rows        {self.rows:,}" + (f"  ({self.rollouts:,} rollouts)" if self.rollouts != self.rows else ""),
            f"unmasked    {self.unmasked:,}{share(self.unmasked)}",
            f"masked      {self.masked:,}{share(self.masked)}" + (f", {self.failed:,} of them failed builds" if self.failed else ""),
        ]
        for reason, count in self.mask_reasons.items():
            lines.append(f"  {reason:<24}{count:,}")
        stats = self.length_stats
        if stats is None:
            lines.append("token lengths: no trainable rows")
            return "\n".join(lines)
        lines.append(
            f"token lengths (trainable rows)  p50 {stats.p50:,.0f}  p90 {stats.p90:,.0f}  p99 {stats.p99:,.0f}  "
            f"max {stats.max:,} ({stats.longest_rollout})"
        )
        counts, edges = self.histogram(bins)
        peak = max(int(counts.max()), 1)
        width = len(f"{int(edges[-1]):,}")
        for count, low, high in zip(counts, edges[:-1], edges[1:]):
            bar = "#" * int(round(_BAR_WIDTH * int(count) / peak))
            lines.append(f"  {int(low):>{width},} - {int(high):>{width},}  {bar:<{_BAR_WIDTH}}  {int(count):,}")
        return "\n".join(lines)


def _parquet_files(output: Path) -> list[str]:
    if output.is_file():
        return [str(output)]
    if not output.is_dir():
        raise InspectError(f"{output} does not exist; give the output directory a rebuild wrote")
    from raycap.manifest import has_manifest, shard_paths
    from raycap.outputerrors import OutputError

    if has_manifest(output):
        try:
            # A committed output is exactly its manifest's shards (`data/` now, the top
            # level in an output written before it).
            return [str(path) for path in shard_paths(output)]
        except OutputError as exc:  # an unreadable manifest: the files may still say something
            logger.warning("%s; reading its Parquet files instead", exc)
    # Metadata and staging files start with "_" or "."; every reader skips them too.
    files = sorted(
        str(path)
        for path in output.rglob("*.parquet")
        if not any(part.startswith(("_", ".")) for part in path.relative_to(output).parts)
    )
    if not files:
        raise InspectError(f"{output} holds no Parquet shards; is it a raycap output (or still being written)?")
    return files


def inspect_output(output: str | os.PathLike) -> OutputReport:
    """Read the columns of a raycap output that the report needs and summarise them."""
    output = Path(output)
    files = _parquet_files(output)
    try:
        table = pads.dataset(files, format="parquet").to_table(columns=list(_COLUMNS))
    except (pa.ArrowInvalid, OSError, KeyError) as exc:
        raise InspectError(f"{output} is not readable as raycap rows ({type(exc).__name__}: {exc})") from None
    masked = np.asarray(pc.fill_null(table["mask_sample"], True).to_numpy(zero_copy_only=False), dtype=bool)
    failed = int(pc.sum(pc.and_(pc.is_valid(table["error"]), pa.array(masked))).as_py() or 0)
    reasons: Counter[str] = Counter()
    for row in pc.filter(table["mask_reasons"], pa.array(masked)).to_pylist():
        reasons.update(set(row or ()))
    lengths_all = np.asarray(pc.fill_null(pc.list_value_length(table["token_ids"]), 0).to_numpy(zero_copy_only=False))
    trainable = ~masked & np.asarray(pc.is_valid(table["token_ids"]).to_numpy(zero_copy_only=False), dtype=bool)
    lengths = lengths_all[trainable].astype(np.int64)
    stats = None
    if len(lengths):
        p50, p90, p99 = (float(v) for v in np.percentile(lengths, [50, 90, 99]))
        at = int(np.flatnonzero(trainable)[int(np.argmax(lengths))])
        stats = LengthStats(p50, p90, p99, int(lengths.max()), str(table["rollout_id"][at].as_py()))
    return OutputReport(
        output=str(output),
        rows=table.num_rows,
        rollouts=len(pc.unique(table["rollout_id"])),
        unmasked=int((~masked).sum()),
        masked=int(masked.sum()),
        failed=failed,
        mask_reasons=dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0]))),
        lengths=lengths,
        length_stats=stats,
    )


@dataclass(frozen=True)
class PngResult:
    path: Path | None  # None when nothing was written
    reason: str = ""  # why not


def default_png_path(output: str | os.PathLike) -> Path:
    """Next to the output, like its summary: `<output>.lengths.png`."""
    output = Path(output)
    return output.with_name(output.name + ".lengths.png")


def write_png(report: OutputReport, path: str | os.PathLike, bins: int = HISTOGRAM_BINS) -> PngResult:
    """The length histogram as a PNG, where matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is touched
        import matplotlib.pyplot as plt
    except ImportError:
        return PngResult(None, "matplotlib is not installed (pip install matplotlib to get the PNG)")
    if report.length_stats is None:
        return PngResult(None, "no trainable rows to plot")
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.hist(report.lengths, bins=bins)
    axes.set_xlabel("tokens per trainable row")
    axes.set_ylabel("rows")
    axes.set_title(f"{Path(report.output).name}: p99 {report.length_stats.p99:,.0f}, max {report.length_stats.max:,}")
    path = Path(path)
    figure.savefig(path, format="png")
    plt.close(figure)
    return PngResult(path)
