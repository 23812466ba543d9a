"""Durable handoff: the output is a Parquet dataset directory, committed all at once.

Builder tasks write their shards (`raycap.output.shards`) into a staging directory next to the
output (`.NAME.staging`, on the same file system so the final rename cannot cross one).
The driver only commits (`StagedOutput.commit`): it checks every reported shard is in
the staging directory with its reported size, writes the manifest (`raycap.output.manifest`)
durably (`raycap.output.durable`), renames the staging directory to the output path and fsyncs
the parent. Until that rename nothing is visible at the output path, and nothing may be
retired: only a committed output is. A run that dies leaves at most its staging
directory, which the next run removes and never commits. An exclusive lock on
`.NAME.lock` (opened as capture files are: a link or FIFO there is refused) keeps two
runs from writing one output: a run takes it once (`output_lock`,
not re-entrant) and hands the `OutputLock` it holds to the steps that need it
(`StagedOutput`, retirement).

A committed output reads as one table, given as the directory, with pyarrow, pandas,
DuckDB, Ray Data and Hugging Face `datasets`: the shards are the only visible files
(`data/part-*.parquet`) and the metadata files are hidden, which those readers skip.
polars refuses a directory holding anything but Parquet, so it reads `out/data` or
`out/**/*.parquet`. `read_manifest` and `shard_paths` (from `raycap.output.manifest`, also
importable from here) give the shards in manifest order.

An output is refused before anything is created (`check_placement`) when it is named
like a capture file (`*.tokens.*`), lies inside a capture directory, or lies inside
another committed output. An ancestor counts as a committed output when its manifest is a
regular file that begins as raycap's do (`raycap.output.localread.looks_committed`: one small
read, opened as every manifest is); a link, FIFO, device or any other file there means
no committed output, never a wait or a large read. A fault of the output's file system while writing (disk full,
I/O error, read-only) raises `OutputWriteError` naming the path (`raycap.output.faults`):
a fault of the machine, never a rollout's masked row, so the run fails and nothing is
committed or retired.

The manifest records the inputs that produced the rows (`Inputs`: capture directories,
rollout ids, builder, model, delivery) and their fingerprint. A rerun with the same
inputs reuses the output instead of rebuilding, because rollouts retired by the first run
can no longer be rebuilt, and then finishes the retirement, which is safe to repeat. An
existing output with other inputs, none, or of the previous single-file format is refused
unless overwriting was asked for. Overwriting never deletes it: it is moved aside,
durably, to `NAME.superseded-<UTC time>`, or `NAME.retired-superseded-<UTC time>` when
captures were already retired from it (its `.retire.json` marker says so), because its
rows may be the only copy of those trajectories.

An output is parsed once (`raycap.output.location.parse_location`) and every function here
takes that `Location` (or a plain path, which is a local one). On an object store
(`s3://`) the same steps hold without a rename: builder tasks write into a staging
attempt outside the output's visible paths, the commit point is a conditional write of
the manifest, and the listed objects are then rolled forward into place
(`raycap.output.objectstore`, whose docstring states the protocol and its guarantees). There is
no lock file there (`output_lock` holds nothing): the commit point decides between two
writers. Reuse, overwrite (moving aside by copy, then delete), set-aside and the retire
marker keep their meaning.

The protocol's steps are `raycap.output.protocol` (`StagedOutput`, `verify`); a local output's
primitives are `raycap.output.localstore`, an object store's `raycap.output.objectstore`. The functions
here are the protocol's public face: each takes the output's backend, never branching
on where the output is.

This module does not import Ray.
"""


from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from raycap.capture.directory import CaptureDir
from raycap.output.localstore import lock_path as lock_path
from raycap.output.localstore import rejected_path as rejected_path
from raycap.output.localstore import staging_path as staging_path
from raycap.output.localstore import summary_path as summary_path
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
    retires them: on an object store, finish its roll-forward (`raycap.output.objectstore`);
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
    (`raycap.output.storeread.check_placement`)."""
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
    store see `raycap.output.objectstore.check_output` (a reused output's roll-forward is
    finished there)."""
    location = as_location(output)
    return backend_of(location).check_output(location, inputs, overwrite)


def supersede(output: str | os.PathLike | Location) -> Path | Location:
    """Move an existing output out of the way of its replacement, durably, under a name
    that says why: `.retired-superseded-<time>` when captures were retired from it,
    else `.superseded-<time>`. Never deletes it (on an object store: copied, then
    deleted, see `raycap.output.objectstore.supersede`)."""
    location = as_location(output)
    return backend_of(location).supersede(location)


def set_aside(output: str | os.PathLike | Location) -> Path | Location:
    """Move a committed output that failed the mask check (and its summary) to
    `<output>.rejected`, out of the consumers' way, durably.

    A `.rejected` left by an earlier run is removed when nothing was retired from it (its
    captures are all there to rebuild from) and otherwise moved aside like a superseded
    output (on an object store: `raycap.output.objectstore.set_aside`)."""
    location = as_location(output)
    return backend_of(location).set_aside(location)
