"""A local output: the commit protocol's primitives (`raycap.output.protocol.Backend`) on a file system.

Builder tasks write their shards (`raycap.output.shards`) into a staging directory next to the
output (`.NAME.staging`, on the same file system so the final rename cannot cross one).
The commit checks every reported part is in the staging directory with its reported
size, writes the manifest (`raycap.output.manifest`) durably (`raycap.output.durable`) into it,
renames the staging directory to the output path and fsyncs the parent: that rename is
the commit point, and the commit is whole at it. A run that dies leaves at most its
staging directory, which the next run removes and never commits. An exclusive lock on
`.NAME.lock` (opened as capture files are: a link or FIFO there is refused) keeps two
runs from writing one output. Moving an output aside is a durable rename. `run_file`
names these files beside an output, so that no other file raycap writes (a records file)
is placed on one of them.

This module does not import Ray.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raycap.capture.directory import CaptureDir, capture_dir_holding, placed_path
from raycap.capture.files import lock_or_raise, open_regular
from raycap.output.backend import Backend, Inputs, OutputCheck, OutputLock
from raycap.output.durable import fsync_dir, rename_durably, write_json_durably
from raycap.output.faults import OutputError, write_fault
from raycap.output.local.reads import (
    committed_as,
    has_manifest,
    is_committed,
    local_committed_manifest,
    local_retired_outputs,
    local_shards,
    looks_committed,
    open_local_shard,
    read_local_manifest,
    read_local_part,
    read_marker,
    stream_local_part,
    visible_parquet,
    was_retired_from,
    write_marker,
)
from raycap.output.location import Location
from raycap.output.manifestformat import MANIFEST_NAME, Manifest
from raycap.output.recordparts import RECORDS_DIR
from raycap.output.shards import DATA_DIR

# --- paths --------------------------------------------------------------------------------


def staging_path(output: str | os.PathLike) -> Path:
    """Where a run writes before its commit: a hidden sibling of the output."""
    output = Path(output)
    return output.with_name(f".{output.name}.staging")


def lock_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


def summary_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(f"{output.name}.summary.json")


def rejected_path(output: str | os.PathLike) -> Path:
    """Where an output that failed the mask check is kept for inspection."""
    output = Path(output)
    return output.with_name(output.name + ".rejected")


# The files a run writes beside an output NAME, by the rest of their names after NAME
# (see the paths above, `write_json_durably`'s temp names and `_stamped`): what each is.
_STAMP = r"(?:retired-)?superseded-[0-9]{8}T[0-9]{6}Z(?:-[0-9]+)?"
_RUN_FILES = (
    (re.compile(r"\.summary\.json"), "the output's summary"),
    (re.compile(r"\.rejected\.summary\.json"), "the summary of the output's rejected copy"),
    (re.compile(rf"\.(?:rejected|{_STAMP})(?:\.summary\.json)?"), "a place the output is moved aside to"),
)
_HIDDEN_RUN_FILES = (
    (re.compile(r"\.lock"), "the output's lock"),
    (re.compile(r"\.results\.jsonl"), "the results spool of a run on the output"),
    (re.compile(r"(?:\.rejected)?\.summary\.json\.tmp-.*", re.DOTALL), "a temp file of the output's summary"),
)
# Folders a run fills beside the output: a file inside one is overwritten or moved with it.
_RUN_FOLDERS = ((".{}.staging", "the output's staging"), ("{}.rejected", "the output's rejected copy"))


def run_file(output: str | os.PathLike, path: str | os.PathLike) -> str | None:
    """Which file a run on the local `output` writes beside it the kernel would take
    `path` for (both placed as the kernel places them, `placed_path`), as a phrase, or
    None. The output itself and what is inside it are `LocalBackend.holds`'."""
    placed, home = placed_path(path), placed_path(output)
    folder, name = os.path.split(home)
    for form in {placed, os.path.realpath(placed)}:
        for pattern, what in _RUN_FOLDERS:
            written = os.path.join(folder, pattern.format(name))
            for base in {written, os.path.realpath(written)}:
                if form == base:
                    return what
                if form.startswith(base.rstrip(os.sep) + os.sep):
                    return f"inside {what}"
        there, file = os.path.split(form)
        if there not in (folder, os.path.realpath(folder)):
            continue
        if file.startswith(name):
            rest = file[len(name):]
            if (what := next((w for p, w in _RUN_FILES if p.fullmatch(rest)), None)) is not None:
                return what
        if file.startswith(f".{name}"):
            rest = file[len(name) + 1:]
            if (what := next((w for p, w in _HIDDEN_RUN_FILES if p.fullmatch(rest)), None)) is not None:
                return what
    return None


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _stamped(path: Path, suffix: str) -> Path:
    """`path` + suffix + a UTC time, made unique."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.{suffix}-{stamp}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.{suffix}-{stamp}-{n}")
    return target


def _move_aside(output: Path, target: Path) -> Path:
    """Rename an output and its summary durably."""
    rename_durably(output, target)
    summary = summary_path(output)
    if summary.exists():
        rename_durably(summary, summary_path(target))
    return target


def supersede_path(output: Path) -> Path:
    """Move an output aside durably, as `.retired-superseded-<time>` when captures were
    retired from it, else `.superseded-<time>`; never deleted."""
    why = "retired-superseded" if output.is_dir() and was_retired_from(output) else "superseded"
    return _move_aside(output, _stamped(output, why))


@contextmanager
def lock_output(location: Location) -> Iterator[OutputLock]:
    """The exclusive, non-blocking, non-re-entrant lock of a local output (see
    `raycap.output.commit.output_lock`).

    A run that ends with no raycap output at its path (refused, interrupted, or its
    rows set aside) leaves no trace it made: the lock file it created is removed while still
    held, and so are the parent folders it created, when empty. A run holds the lock
    only while the path still names the file it locked, so removing it races no one."""
    output = location.path
    path = lock_path(output)
    made = _missing_folders(output.parent)
    existed = path.exists() or path.is_symlink()

    def refuse(kind: str) -> OutputError:
        return OutputError(
            f"the lock file {path} of output {output} is {kind}; raycap never opens it through a link or waits on "
            "it: remove it, and rerun"
        )

    def busy() -> OutputError:
        return OutputError(f"another run is writing {output} (it holds {path}); wait for it or choose another output")

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock_named(path, refuse, busy)
    except OSError as exc:
        _remove_made(made)
        raise OutputError(
            f"cannot write output {output}: {exc.strerror or exc} ({exc.filename or output.parent}); "
            "choose a writable output directory"
        ) from None
    except BaseException:
        _remove_made(made)
        raise
    held = OutputLock(location)
    try:
        yield held
    finally:
        held.held = False
        try:
            if not existed and not _holds_manifest(output):
                path.unlink(missing_ok=True)  # still held: a run that opened it will find it gone
                _remove_made(made)
        except OSError:
            pass  # a trace left is harmless: the next run takes the lock file as it is
        finally:
            os.close(fd)


def _lock_named(path: Path, refuse: Callable[[str], Exception], busy: Callable[[], Exception]) -> int:
    """`lock_or_raise` of the lock file, held only once `path` still names the file
    locked: a run that removed it (see `lock_output`) may have done so after this open."""
    for _ in range(8):
        fd = lock_or_raise(path, os.O_WRONLY | os.O_CREAT, refuse, busy)
        locked = os.fstat(fd)
        try:
            named = os.lstat(path)
        except FileNotFoundError:
            named = None
        if named is not None and (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino):
            return fd
        os.close(fd)
    raise busy()


def _holds_manifest(output: Path) -> bool:
    """`has_manifest`, False where `output` is no folder to hold one (a file, nothing)."""
    try:
        return has_manifest(output)
    except OSError:
        return False


def _is_raycap_file(path: Path) -> bool:
    """Whether `path` is a regular file holding raycap rows (a single-file output of an
    earlier raycap): Parquet, with the rollout_id and mask_sample columns."""
    import pyarrow.parquet as pq

    try:
        fd = open_regular(path, os.O_RDONLY, lambda kind: OSError(f"{path} is {kind}"))
    except OSError:  # a link, a FIFO, a folder, or gone: not raycap's rows
        return False
    with os.fdopen(fd, "rb") as handle:
        try:
            if handle.read(4) != b"PAR1":
                return False
            handle.seek(0)
            names = pq.read_schema(handle).names
        except Exception:  # noqa: BLE001 - whatever it is, it is not raycap's rows
            return False
    return "rollout_id" in names and "mask_sample" in names


def _missing_folders(folder: Path) -> list[Path]:
    """The folders `folder.mkdir(parents=True)` would create, deepest first."""
    missing = []
    while not (folder.exists() or folder.is_symlink()) and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_made(folders: list[Path]) -> None:
    """Remove the folders a run created (deepest first) as long as they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


class LocalBackend(Backend):
    """The primitives on a local (or shared) file system."""

    staging_needs_shared_fs = True
    staging_written_by_forks = True

    def where(self, location: Location) -> Path:
        return location.path

    def resolved(self, location: Location) -> Location:
        return Location(location.fs_path, "", location.fs_path)

    def empty(self, location: Location) -> bool:
        path = location.path
        return not (path.exists() or path.is_symlink()) or _is_empty_dir(path)

    def has_manifest(self, location: Location) -> bool:
        return is_committed(location.path)

    def lock(self, location: Location) -> Any:
        return lock_output(location)

    def check_placement(self, location: Location, dirs: Sequence[Any], elsewhere: Sequence[tuple[str, str]]) -> None:
        output = location.path
        if ".tokens." in output.name:
            raise OutputError(
                f"output {output} is named like a capture file (*.tokens.*), which a capture store would take for a "
                "rollout; choose another output name"
            )
        listed = [*((d.label, d.path) if isinstance(d, CaptureDir) else (os.fspath(d),) * 2 for d in dirs), *elsewhere]
        # None inside the output either: replacing or setting it aside would take it along.
        inside = capture_dir_holding(output, listed)
        holds = next((label for label, path in listed if capture_dir_holding(path, [("", str(output))]) is not None), None)
        if inside or holds:
            where = f"is inside capture directory {inside}" if inside else f"holds capture directory {holds}"
            raise OutputError(f"output {output} {where}; choose an output outside every capture directory")
        for ancestor in Path(os.path.realpath(output)).parents:
            # One small read per ancestor, never a parse: any directory above (/tmp) may hold
            # a `.manifest.json` that is not raycap's, or is a FIFO, or huge.
            if looks_committed(ancestor):
                raise OutputError(
                    f"output {output} is inside the committed output {ancestor}, whose readers would take it for their "
                    "own rows; choose an output outside it"
                )

    def check_output(self, location: Location, inputs: Inputs, overwrite: bool) -> OutputCheck:
        output = location.path
        if _is_empty_dir(output):
            pass  # as good as absent: the commit replaces it
        elif output.is_dir():
            if not has_manifest(output):
                raise OutputError(
                    f"output {output} is a directory that is not a raycap output (it has no {MANIFEST_NAME}); "
                    "choose another output path"
                )
            try:
                manifest: Manifest | None = read_local_manifest(output)
            except OutputError:
                manifest = None
            recorded = None if manifest is None else manifest.fingerprint
            if recorded == inputs.fingerprint():
                return OutputCheck(True, manifest)
            if not overwrite:
                what = "different inputs" if recorded else "an unreadable manifest"
                raise OutputError(
                    f"output {output} already exists and was written from {what} (capture dirs, rollout ids or results, "
                    "builder, model, delivery or record fields differ); choose another output or set overwrite: true to replace it "
                    "(the old one is moved aside, not deleted)"
                )
        elif output.exists() or output.is_symlink():
            if not overwrite:
                kind = "a file (a single-file output of an earlier raycap, or not raycap's)" if output.is_file() else "not a directory"
                raise OutputError(
                    f"output {output} already exists and is {kind}; choose another output or set overwrite: true "
                    "to replace it (the old one is moved aside, not deleted)"
                )
            if not _is_raycap_file(output):
                # overwrite replaces raycap's own rows, never a file of the user's.
                raise OutputError(
                    f"output {output} already exists and is not a raycap output; overwrite replaces only a raycap "
                    "output or an empty folder: move it away or choose another output"
                )
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise OutputError(
                f"cannot write output {output}: {exc.strerror or exc} ({exc.filename or output.parent}); "
                "choose a writable output directory"
            ) from None
        return OutputCheck(False)

    # --- staging and the commit point ---

    def new_staging(self, location: Location) -> Path:
        return staging_path(location.path)

    def for_tasks(self, staging: Path) -> str:
        return str(staging)

    def open_staging(self, staging: Path) -> None:
        try:
            if staging.exists() or staging.is_symlink():
                self.abort_staging(staging)
            staging.mkdir()
            (staging / DATA_DIR).mkdir()
            fsync_dir(staging)
            fsync_dir(staging.parent)
        except OSError as exc:
            raise write_fault(staging, exc) from None

    def abort_staging(self, staging: Path) -> None:
        if staging.is_dir() and not staging.is_symlink() and was_retired_from(staging):
            # Not a dead run's staging (nothing is retired before the commit) but rows
            # captures were retired from, put here by hand: they may be the only copy.
            supersede_path(staging)
            return
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging)
        else:
            staging.unlink()
        fsync_dir(staging.parent)

    def check_staged(self, staging: Path, reported: dict[str, tuple[str, int]], keep_records: bool) -> None:
        for name, (what, file_bytes) in reported.items():
            try:
                size = (staging / name).stat().st_size
            except FileNotFoundError:
                raise OutputError(
                    f"{what} {name} is missing from {staging}: the node that wrote it does not share "
                    "this file system; put the output on storage every node can see"
                ) from None
            if size != file_bytes:
                raise OutputError(
                    f"{what} {name} in {staging} has {size} bytes, its task reported {file_bytes}: "
                    "another writer replaced it; rerun the job"
                )
        # Anything else (temp files of killed attempts, a stray shard or records part) goes.
        listed = {staging / name for name in reported}
        kept = [staging / DATA_DIR] + ([staging / RECORDS_DIR] if keep_records else [])
        try:
            for entry in [*staging.iterdir(), *(e for folder in kept if folder.is_dir() for e in folder.iterdir())]:
                if entry not in listed and entry not in kept:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as exc:
            raise write_fault(staging, exc) from None

    def stage_manifest(self, staging: Path, manifest: Manifest) -> None:
        write_json_durably(staging / MANIFEST_NAME, manifest.to_json())

    def occupied(self, location: Location) -> bool:
        output = location.path
        if _is_empty_dir(output):
            output.rmdir()
            return False
        return output.exists() or output.is_symlink()

    def commit_point(self, staging: Path, location: Location, manifest: Manifest) -> None:
        rename_durably(staging, location.path)

    def finish(self, location: Location, manifest: Manifest, during: Callable[[], None] | None = None) -> None:
        """Nothing to put in place: a local commit is one rename, whole when it is seen."""

    # --- what is at an output, and moving it aside ---

    def named(self, location: Location) -> Path:
        return Path(location.uri)

    def real(self, location: Location) -> Location:
        real = os.path.realpath(location.fs_path)
        return Location(real, "", real)

    # --- reading what was committed (`raycap.output.local.reads`) ---

    def manifest(self, location: Location) -> Manifest:
        return read_local_manifest(location.path)

    def committed_as(self, location: Location) -> str:
        return committed_as(location.path)

    def committed_manifest(self, location: Location, manifest: Manifest | None) -> Manifest:
        return local_committed_manifest(location.path, manifest)

    def shards(self, location: Location, manifest: Manifest | None = None) -> list[Path]:
        return local_shards(location.path, manifest)

    def open_part(self, part: Path) -> Any:
        return open_local_shard(Path(part))

    def visible_parquet(self, location: Location) -> list[Path] | None:
        return visible_parquet(location.path)

    def read_part(self, location: Location, part: Any) -> bytes:
        return read_local_part(location.path, part)

    def stream_part(self, location: Location, part: Any, write: Callable[[Any], Any]) -> None:
        stream_local_part(location.path, part, write)

    def stream_staged_part(self, staging: Any, part: Any, write: Callable[[Any], Any]) -> None:
        stream_local_part(staging, part, write)

    def for_workers(self, location: Location, shards: Sequence[Any]) -> tuple[list[str], None]:
        # Absolute: workers run in a working directory that is not this process's.
        return [os.path.abspath(p) for p in shards], None

    def from_tasks(self, part: str, here: Any) -> Path:
        return Path(here(part))

    def was_retired_from(self, location: Location) -> bool:
        return was_retired_from(location.path)

    def read_marker(self, location: Location) -> bytes:
        return read_marker(location.path)

    def write_marker(self, location: Location, record: dict[str, Any]) -> None:
        write_marker(location.path, record)

    def retired_outputs(self, location: Location) -> list[Path]:
        return local_retired_outputs(location.path)

    def supersede(self, location: Location) -> Path:
        return supersede_path(location.path)

    def set_aside(self, location: Location) -> Path:
        output = location.path
        target = rejected_path(output)
        if target.exists() or target.is_symlink():
            if target.is_dir() and not target.is_symlink() and not was_retired_from(target):
                shutil.rmtree(target)
                summary_path(target).unlink(missing_ok=True)
                fsync_dir(target.parent)
            else:
                supersede_path(target)
        return _move_aside(output, target)

    def write_summary(self, location: Location, summary: dict[str, Any]) -> None:
        write_json_durably(summary_path(location.path), summary)

    def part(self, output: Path | Location, name: str) -> Path:
        return Path(output) / name  # type: ignore[arg-type]

    def present(self, part: Path | Location) -> bool:
        try:
            return os.path.lexists(part)  # type: ignore[arg-type]
        except OSError:
            return True  # unknown: not said to be missing

    def local_home(self, location: Location) -> Path:
        return location.path

    def spool_path(self, location: Location) -> Path:
        output = location.path
        return output.with_name(f".{output.name}.results.jsonl")

    def holds(self, location: Location, path: Path) -> bool:
        real, base = os.path.realpath(path), os.path.realpath(location.path)
        return real == base or real.startswith(base.rstrip(os.sep) + os.sep)

    def run_file(self, location: Location, path: Path) -> str | None:
        return run_file(location.path, path)


LOCAL = LocalBackend()
