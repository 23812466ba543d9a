"""A run's records file (`records_file=`), written while the run goes on.

The records file is the records parts one after the other. Written after the commit, it
reads them all back and writes them again: for long agentic rollouts (240 MB of
records), half a second in which nothing else runs. `RecordsFileDraft` writes it while
the batches are still being finalized: each part, once its batch is reported (in batch
order, durable in the staging), is streamed on a thread of its own into a hidden temp
file beside the target (read and written around the page cache from a local staging
directory, `raycap.output.unbuffered`), its digest checked against its report. A part
this process wrote itself comes with the lines it was written from (the bytes its
digest was taken of), and a part a worker process wrote with the same lines handed back
in shared memory (`raycap.finalize.shelf`): those are written into the draft as they
are, and the part is not read back. The thread mostly waits on the disk while the cores
finalize.

A draft is named `.<records file>.draft-<hex>` and locked (flock) while its run lives; a
new draft removes those of the same target no run holds, left by runs that were killed.

The file appears at its target only through `place`, after the commit, exactly when
the file written after the commit would have (before any retirement), and only when the
draft holds the parts the committed manifest lists, in order; `discard` removes the temp
file of a run that stops or is not accepted. A draft that met any fault (a part gone or
changed, a full disk) is never placed: the caller writes the file from the committed
output instead, as without a draft, and meets the fault there if it persists.

This module does not import Ray.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from raycap.capture.files import fsync_dir, open_regular
from raycap.finalize.shelf import Handed
from raycap.output.faults import write_fault
from raycap.output.unbuffered import UnbufferedFile

logger = logging.getLogger(__name__)


# stream(part, write): a staged records part passed to `write` and checked
# (`raycap.output.backend.Backend.stream_staged_part`).
Stream = Callable[[Any, Callable[[Any], Any]], None]


class RecordsFileDraft:
    """The records file of a run, its parts read with `stream` as their batches are
    reported, to be placed at `target` (see the module docstring)."""

    def __init__(self, target: Path, stream: Stream) -> None:
        self.target, self.stream = target, stream
        target.parent.mkdir(parents=True, exist_ok=True)
        self.temp = target.with_name(f"{_draft_prefix(target)}{uuid.uuid4().hex}")
        self.file = UnbufferedFile(self.temp)
        fcntl.flock(self.file.fd, fcntl.LOCK_EX)  # held while it lives: a draft left unlocked is a dead run's
        _remove_dead_drafts(target, self.temp)
        self.parts: list[Any] = []
        self.fault: BaseException | None = None
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-records-file")
        self.open = True

    @classmethod
    def begin(cls, target: Path, stream: Stream) -> RecordsFileDraft | None:
        """A draft for `target`, or None when its temp file cannot be made there (the
        file is then written after the commit, which reports the fault)."""
        try:
            return cls(target, stream)
        except OSError as exc:
            logger.warning("cannot draft the records file %s during the run (%s); writing it after the commit", target, exc)
            return None

    def add(self, part: Any, lines: Sequence[bytes] | Handed | None = None) -> None:
        """The next records part (a `RecordsPart`, durable in the staging directory),
        with the lines it was written from when this process wrote it (each without its
        newline), or its bytes a worker handed back: those are drafted instead of the
        part's bytes read back (and a handed slot is released once copied)."""
        self.parts.append(part)
        self.copier.submit(self._copy, part, lines)

    def _copy(self, part: Any, lines: Sequence[bytes] | Handed | None) -> None:
        try:
            if self.fault is None:
                if lines is None:
                    self.stream(part, self.file.write)
                elif isinstance(lines, Handed):
                    self._write_handed(part, lines)
                else:
                    self._write_lines(part, lines)
        except BaseException as exc:  # noqa: BLE001 - the draft is not placed; the caller writes the file afresh
            self.fault = exc
        finally:
            if isinstance(lines, Handed):
                lines.release()

    def _write_handed(self, part: Any, handed: Handed) -> None:
        if handed.size != part.file_bytes:
            raise ValueError(f"the bytes handed for {part.name} are {handed.size}, the part {part.file_bytes}")
        with handed.view() as view:
            self.file.write(view)

    def _write_lines(self, part: Any, lines: Sequence[bytes]) -> None:
        size = 0
        for line in lines:  # as `write_records_part` wrote them: a line, then its newline
            self.file.write(line)
            self.file.write(b"\n")
            size += len(line) + 1
        if size != part.file_bytes:
            raise ValueError(f"the lines handed for {part.name} are {size} bytes, the part {part.file_bytes}")

    def settle(self) -> None:
        """Wait until every part added was copied (or a fault stopped the copying): the
        staging directory may go then."""
        self.copier.shutdown(wait=True)

    def place(self, parts: Sequence[Any]) -> bool:
        """Rename the draft to the target, durably, when it holds exactly `parts` (the
        committed manifest's records parts) and met no fault; False (nothing placed)
        otherwise."""
        self.settle()
        if self.fault is None:
            if [(p.name, p.sha256) for p in self.parts] != [(p.name, p.sha256) for p in parts]:
                return False  # other parts than the commit's
            try:
                self.file.finish()
            except OSError as exc:
                self.fault = exc
        if self.fault is not None:
            logger.warning("the records file drafted during the run met %s; writing it from the output", self.fault)
            return False
        self._close()
        try:
            os.replace(self.temp, self.target)
            fsync_dir(self.target.parent)
        except OSError as exc:
            self.temp.unlink(missing_ok=True)
            raise write_fault(self.target, exc) from None
        return True

    def discard(self) -> None:
        """Remove the temp file, unless it was placed (whatever happened: idempotent)."""
        self.copier.shutdown(wait=True, cancel_futures=True)
        if self.open:
            self._close()
            try:
                self.temp.unlink(missing_ok=True)
            except OSError:
                pass  # the file system is failing already; the temp name is hidden

    def _close(self) -> None:
        if self.open:
            self.open = False
            self.file.__exit__(None, None, None)


def _draft_prefix(target: Path) -> str:
    return f".{target.name}.draft-"


def _remove_dead_drafts(target: Path, own: Path) -> None:
    """Remove the drafts of `target` that runs killed before they could remove them left
    beside it: those no live run holds locked. Anything else of the name (a link, a
    FIFO) is left as it is."""
    prefix = _draft_prefix(target)
    try:
        names = [name for name in os.listdir(target.parent) if name.startswith(prefix) and name != own.name]
    except OSError:
        return
    for name in names:
        path = target.parent / name
        try:
            fd = open_regular(path, os.O_RDONLY, lambda kind: OSError(errno.EINVAL, f"a draft is {kind}"))
        except OSError:
            continue  # gone, or not a file this module made: left as it is
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            opened, current = os.fstat(fd), os.lstat(path)
            if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                os.unlink(path)
                logger.info("removed %s, the records file draft of a run that was killed", path)
        except OSError:
            continue  # locked by a live run (BlockingIOError), or gone meanwhile
        finally:
            os.close(fd)
