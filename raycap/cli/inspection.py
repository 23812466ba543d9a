"""What an output holds, for a person choosing training settings (`raycap inspect OUTPUT`).

`inspect_output` reads a raycap output (a Parquet dataset directory, committed or not,
one Parquet file, or a URI) and reports, from the rows themselves: rows and distinct
rollouts; unmasked, masked and failed rows, masked rows by reason; and the token
lengths of the trainable rows (p50, p90, p99, the longest, a histogram), so a user can
pick `seq_len`.

- Only the columns it needs are read; lengths come from Arrow's list offsets.
- A committed output is read as its manifest lists it; any other directory as its
  visible Parquet files. Files are opened as shards are: never through a link, never
  waiting on a FIFO.
- The PNG histogram (`write_png`) needs matplotlib, and says so as a typed result when
  it is missing. It is never written inside an output (`enclosing_output`) nor to a
  store, and is renamed into place from a new hidden temporary file.

The long form: docs/internals.md ("Inspecting an output"). This module does not import Ray.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raycap.capture.directory import refuse_capture_place
from raycap.errors import InspectError  # noqa: F401 - raised here, declared with the others
from raycap.output.backend import Backend
from raycap.output.faults import OutputError
from raycap.output.location import Location, is_uri, parse_location
from raycap.output.manifest import has_manifest, looks_committed
from raycap.output.protocol import backend_of
from raycap.output.shards import DATA_DIR
from raycap.output.stats import LengthStats

logger = logging.getLogger(__name__)

_COLUMNS = ("rollout_id", "mask_sample", "error", "mask_reasons", "token_ids")
HISTOGRAM_BINS = 10
_BAR_WIDTH = 40


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

    def to_json(self, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
        """The report as `raycap inspect --json` prints it (keys: docs/jobs-and-cli.md)."""
        stats = self.length_stats
        counts, edges = self.histogram(bins) if stats is not None else (np.zeros(0), np.zeros(0))
        return {
            "output": self.output,
            "rows": self.rows,
            "rollouts": self.rollouts,
            "unmasked": self.unmasked,
            "masked": self.masked,
            "failed": self.failed,
            "mask_reasons": dict(self.mask_reasons),
            "token_lengths": None if stats is None else {
                "p50": float(stats.p50), "p90": float(stats.p90), "p99": float(stats.p99), "max": int(stats.max),
                "longest_rollout": stats.longest_rollout,
            },
            "histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
        }

    def render(self, bins: int = HISTOGRAM_BINS) -> str:
        def share(n: int) -> str:
            return f"  ({100.0 * n / self.rows:.1f}%)" if self.rows else ""

        lines = [
            f"output      {self.output}",
            f"rows        {self.rows:,}" + (f"  ({self.rollouts:,} rollouts)" if self.rollouts != self.rows else ""),
            f"unmasked    {self.unmasked:,}{share(self.unmasked)}",
            f"masked      {self.masked:,}{share(self.masked)}" + (f", {self.failed:,} of them failed builds" if self.failed else ""),
        ]
        if len(self.mask_reasons) > 1:
            # The reasons of one row are counted once each, so they may add up to more rows.
            lines.append("  by reason (a row may have several):")
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


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


def _parsed(output: str | os.PathLike | Location) -> Location:
    """The output to inspect, parsed once; InspectError (one line) for a malformed URI."""
    try:
        return parse_location(output, what="the output to inspect")
    except OutputError as exc:
        raise InspectError(str(exc)) from None


def _files(location: Location, backend: Backend) -> list[Any]:
    """What the output holds to read: a committed output's shards as its manifest lists
    them, any other folder's visible Parquet files (one file: itself)."""
    try:
        files = backend.visible_parquet(location)
        if files is not None:
            return files
    except OutputError as exc:
        raise InspectError(str(exc)) from None
    try:
        # A committed output is exactly its manifest's shards (`data/` now, the top
        # level in an output written before it).
        return backend.shards(location)
    except OutputError as exc:
        folder = backend.part(backend.where(location), DATA_DIR)
        raise InspectError(f"{exc} (to look at its Parquet files without the manifest: raycap inspect {folder})") from None


def _read(files: list[Any], output: Any, backend: Backend) -> pa.Table:
    tables = []
    for path in files:
        try:
            with backend.open_part(path) as handle:
                tables.append(pq.read_table(handle, columns=list(_COLUMNS)))
        except OutputError as exc:
            raise InspectError(str(exc)) from None
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise InspectError(f"{path} is not readable as raycap rows ({type(exc).__name__}: {exc})") from None
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowInvalid as exc:
        raise InspectError(f"the Parquet files of {output} do not hold one kind of raycap rows ({exc})") from None


def inspect_output(output: str | os.PathLike | Location) -> OutputReport:
    """Read the columns of a raycap output that the report needs and summarise them."""
    location = _parsed(output)
    backend = backend_of(location)
    location = backend.real(location)  # so that "." names the directory itself
    output = backend.where(location)
    table = _read(_files(location, backend), output, backend)
    masked = np.asarray(pc.fill_null(table["mask_sample"], True).to_numpy(zero_copy_only=False), dtype=bool)
    failed = int(pc.sum(pc.and_(pc.is_valid(table["error"]), pa.array(masked))).as_py() or 0)
    reasons: Counter[str] = Counter()
    for row in pc.filter(table["mask_reasons"], pa.array(masked)).to_pylist():
        reasons.update(set(row or ()))
    lengths_all = np.asarray(pc.fill_null(pc.list_value_length(table["token_ids"]), 0).to_numpy(zero_copy_only=False))
    trainable = ~masked & np.asarray(pc.is_valid(table["token_ids"]).to_numpy(zero_copy_only=False), dtype=bool)
    lengths = lengths_all[trainable].astype(np.int64)
    # The summary's statistics (nearest rank): the same output reads the same either way.
    stats = LengthStats.of(lengths, [str(rid) for rid in table["rollout_id"].filter(pa.array(trainable)).to_pylist()])
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


def _is_output(directory: Path) -> bool:
    """Whether a PNG there would be inside an output: a manifest that begins as raycap's
    do, or (a damaged output) any manifest entry beside a `data` directory."""
    try:
        return looks_committed(directory) or (has_manifest(directory) and (directory / DATA_DIR).is_dir())
    except OSError:
        return False  # a directory this process cannot look into holds nothing it wrote


def enclosing_output(path: str | os.PathLike) -> Path | None:
    """The outermost output that `path` is or lies in, after resolving it; None when
    there is none."""
    resolved = _resolved(path)
    found = [directory for directory in (resolved, *resolved.parents) if _is_output(directory)]
    return found[-1] if found else None


def default_png_path(output: str | os.PathLike | Location) -> Path:
    """Next to the output, like its summary: `<output>.lengths.png`; for a path inside
    an output (a shard, its `data` directory), next to that output; for an output on an
    object store, in the working directory (never on the store). Checked as --png is."""
    location = _parsed(output)
    backend = backend_of(location)
    home = backend.local_home(backend.real(location))
    beside = enclosing_output(home) or home
    if not beside.name:
        raise InspectError(f"{beside} has no directory above it to write the PNG beside; give --png PATH")
    return checked_png_path(beside.with_name(beside.name + ".lengths.png"))


def checked_png_path(path: str | os.PathLike) -> Path:
    """`path` (made absolute) for the PNG, unless it lies inside an output, is named
    like a capture file or lies in a directory of capture files: InspectError (one
    line)."""
    if is_uri(os.fspath(path)):
        raise InspectError(f"--png {path} is a URI; the PNG is written to a local file: give a local path")
    path = Path(os.path.abspath(os.fspath(path)))
    if not path.name:
        raise InspectError(f"--png {path} names no file; give a file path")
    try:
        refuse_capture_place(path, (), "--png")  # no capture file is ever overwritten by a picture
    except ValueError as exc:
        raise InspectError(str(exc)) from None
    inside = enclosing_output(path.parent)
    if inside is not None:
        raise InspectError(
            f"--png {path} is inside the output {inside}, whose readers would take it for rows; write it "
            f"outside, e.g. --png {inside.with_name(inside.name + '.lengths.png')}"
        )
    return path


def write_png(report: OutputReport, path: str | os.PathLike, bins: int = HISTOGRAM_BINS) -> PngResult:
    """The length histogram as a PNG, where matplotlib is installed; InspectError for a
    path inside an output (see the module docstring for where it goes and how it is
    written)."""
    path = checked_png_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is touched
        import matplotlib.pyplot as plt
    except ImportError:
        return PngResult(None, "matplotlib is not installed (pip install matplotlib to get the PNG)")
    if report.length_stats is None:
        return PngResult(None, "no trainable rows to plot")
    figure, axes = plt.subplots(figsize=(8, 4.5))
    try:
        axes.hist(report.lengths, bins=bins)
        axes.set_xlabel("tokens per trainable row")
        axes.set_ylabel("rows")
        axes.set_title(f"{Path(report.output).name}: p99 {report.length_stats.p99:,.0f}, max {report.length_stats.max:,}")
        _write_new(path, lambda handle: figure.savefig(handle, format="png"))
    except OSError as exc:
        return PngResult(None, f"cannot write {path}: {exc.strerror or exc}")
    finally:
        plt.close(figure)
    return PngResult(path)


def _write_new(path: Path, write) -> None:
    """Write a new file under a temporary name beside `path` (created, never opened
    through a link), then rename it over whatever entry `path` is."""
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
