"""Durable handoff: the output is a Parquet dataset directory, committed all at once.

- Builder tasks write shards (`raycap.output.shards`) into a staging area beside the
  output; the driver only commits (`StagedOutput.commit`): it checks every reported
  shard, writes the manifest durably, then makes the output visible in one step (a
  local rename; an object store's conditional write, `raycap.output.objectstore.writes`).
- Until then nothing is visible and nothing may be retired: only a committed output is.
  A dead run leaves at most its staging, which the next run removes.
- `output_lock` keeps two runs from writing one output; it is taken once (not
  re-entrant) and the `OutputLock` handed to the steps that need it.
- A committed output reads as one table with pyarrow, pandas, DuckDB, Ray Data and
  `datasets`: the shards are its only visible files.
- `check_placement` refuses an output named like a capture file, inside a capture
  directory, or inside another committed output, before anything is created.
- The manifest records the inputs (`Inputs`); a rerun with the same inputs reuses the
  output (retired rollouts cannot be rebuilt), other inputs are refused unless
  overwriting, and overwriting moves the old output aside, never deletes it.
- A file-system fault while writing raises `OutputWriteError` (`raycap.output.faults`).

The functions here are the protocol's public face (`raycap.output.protocol`): each
takes the output's backend, never branching on where the output is. The contract in
full: docs/internals.md ("Committing an output"). No Ray.
"""


from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from raycap.capture.directory import CaptureDir
from raycap.output.local.writes import lock_path as lock_path
from raycap.output.local.writes import rejected_path as rejected_path
from raycap.output.local.writes import staging_path as staging_path
from raycap.output.local.writes import summary_path as summary_path
from raycap.output.location import Location, as_location
from raycap.output.manifest import Manifest
from raycap.output.manifest import read_manifest as read_manifest  # public here too, as before
from raycap.output.manifest import shard_paths as shard_paths  # public here too, as the README imports it
from raycap.output.protocol import Committed as Committed
from raycap.output.protocol import Inputs as Inputs
from raycap.output.protocol import OutputCheck as OutputCheck
from raycap.output.protocol import OutputLock as OutputLock
from raycap.output.protocol import StagedOutput as StagedOutput
from raycap.output.protocol import backend_of
from raycap.output.protocol import checked_lock as checked_lock


def where(output: Any) -> Path | Location:
    """How an output is named to people and kept in results: its path when local, else
    its Location (whose text is its URI)."""
    location = as_location(output)
    return backend_of(location).where(location)


def write_summary(output: Any, summary: dict[str, Any]) -> None:
    """Write `<output>.summary.json` beside the output: durably (temp file, fsync,
    rename) when local, one PUT on an object store."""
    location = as_location(output)
    backend_of(location).write_summary(location, summary)


def finish_commit(output: Any, manifest: Manifest) -> None:
    """Make sure a committed output's objects are in place before anything reads or
    retires them: on an object store, finish its roll-forward (`raycap.output.objectstore.writes`);
    a local commit is whole at its rename."""
    location = as_location(output)
    backend_of(location).finish(location, manifest)


@contextmanager
def output_lock(output: str | os.PathLike | Location) -> Iterator[OutputLock]:
    """Hold the output's exclusive lock (non-blocking, not re-entrant: a second
    acquisition fails with OutputError, in this process as in another, so one run takes
    it once and passes the `OutputLock` it yields to whatever needs it held).

    Creates the output's parent directory if needed, so a path that cannot be written
    fails here, before any work. An output on an object store has no lock file: the
    yielded lock holds nothing, and the commit point decides between two writers."""
    location = as_location(output)
    with backend_of(location).lock(location) as held:
        yield held


def check_placement(output: str | os.PathLike | Location, capture_dirs: Sequence[str | CaptureDir] = (), *,
                    elsewhere: Sequence[tuple[str, str]] = ()) -> None:
    """Refuse (OutputError) an output placed where it would corrupt something else:
    named like a capture file (a store would list it as a rollout), inside or holding
    one of `capture_dirs` (paths or `CaptureDir`s, `NODE:/path` too) or `elsewhere`
    ((label, path) served on other nodes), compared as `capturedir.capture_dir_holding`
    does, or inside another committed output (whose readers would take it for shards of
    their own). Checked before anything is created. On an object store: its name, a
    writable store whose bucket is there, and no committed output at a prefix above it
    (`raycap.output.objectstore.reads.check_placement`)."""
    location = as_location(output)
    backend_of(location).check_placement(location, capture_dirs, elsewhere)


def check_output(output: str | os.PathLike | Location, inputs: Inputs, *, overwrite: bool = False) -> OutputCheck:
    """Decide before any work whether `output` is reused or written (`OutputCheck.reuse`).

    Reused when it is a committed output of the same inputs (also with overwrite: the
    same inputs are never rebuilt). Another committed output, one without a readable
    manifest or a file (the previous single-file format) is refused unless `overwrite`,
    and then moved aside at the commit. A non-empty directory that is no raycap output is
    always refused. Otherwise the parent directory is created and probed for
    writability, so a bad output fails the job before anything is built. On an object
    store see `raycap.output.objectstore.writes.check_output` (a reused output's roll-forward is
    finished there)."""
    location = as_location(output)
    return backend_of(location).check_output(location, inputs, overwrite)


def supersede(output: str | os.PathLike | Location) -> Path | Location:
    """Move an existing output out of the way of its replacement, durably, under a name
    that says why: `.retired-superseded-<time>` when captures were retired from it,
    else `.superseded-<time>`. Never deletes it (on an object store: copied, then
    deleted, see `raycap.output.objectstore.writes.supersede`)."""
    location = as_location(output)
    return backend_of(location).supersede(location)


def set_aside(output: str | os.PathLike | Location) -> Path | Location:
    """Move a committed output that failed the mask check (and its summary) to
    `<output>.rejected`, out of the consumers' way, durably.

    A `.rejected` left by an earlier run is removed when nothing was retired from it (its
    captures are all there to rebuild from) and otherwise moved aside like a superseded
    output (on an object store: `raycap.output.objectstore.writes.set_aside`)."""
    location = as_location(output)
    return backend_of(location).set_aside(location)
