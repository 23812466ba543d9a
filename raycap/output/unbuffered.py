"""An output's bulk bytes moved around the page cache (O_DIRECT): shards, records parts, records files.

A shard or records part is written once and read back, if at all, by a check or a copy
that streams it once. Passing those bytes through the page cache costs a core more than
the disk does: every page the cache takes is memory the process has not touched yet,
and on a virtual machine whose memory the host hands out page by page, writing 240 MB
of finalized records that way took 0.6 to 0.9 s of a core where O_DIRECT took 0.03 s
(docs/performance.md). So `UnbufferedFile` writes a new file and `read_chunks` reads
one through an aligned buffer of this process's own, reused from file to file.

O_DIRECT moves whole blocks between the disk and an aligned buffer: the writer gathers
bytes in its buffer and writes whole blocks, the last one padded and the file truncated
back to its bytes. A file that fits one buffer (4 MiB) is written through the page
cache: small files are read back soonest (a training step's rows) and cost little
there. A file system that refuses O_DIRECT (EINVAL at the open, or at a read or write:
tmpfs of older kernels, some network file systems) gets the same bytes through the page
cache, as any other file.

The buffers are never shared with a fork (MADV_DONTFORK, and a fork forgets them):
O_DIRECT from pages a fork shares copy-on-write wrote other bytes than the buffer held,
and open(2) warns against mixing the two. This module does not import Ray.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Iterator

BLOCK = 4096  # the alignment O_DIRECT asks of offsets, lengths and memory on common disks
CHUNK = 4 << 20  # one buffer: the bytes moved by one read or write
_DIRECT = getattr(os, "O_DIRECT", 0)

_buffers: list[mmap.mmap] = []  # kept for the next file: their pages stay this process's
_buffers_lock = threading.Lock()


def _new_buffer() -> mmap.mmap:
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned
    if hasattr(mmap, "MADV_DONTFORK"):
        buffer.madvise(mmap.MADV_DONTFORK)
    return buffer


def _forget_buffers() -> None:
    """In a fork: the buffers are not mapped there (MADV_DONTFORK); it makes its own."""
    global _buffers_lock
    _buffers.clear()
    _buffers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_buffers)


def _take() -> mmap.mmap:
    with _buffers_lock:
        return _buffers.pop() if _buffers else _new_buffer()


def _give_back(buffer: mmap.mmap) -> None:
    with _buffers_lock:
        _buffers.append(buffer)


def _set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for the open file `fd` (EINVAL: the file system refuses it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | _DIRECT if on else flags & ~_DIRECT)


def _without_direct(fd: int, exc: OSError) -> None:
    """After `exc` from an O_DIRECT read or write: go on through the page cache when the
    file system refused the alignment (EINVAL); raise anything else."""
    if exc.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & _DIRECT:
        raise exc
    _set_direct(fd, False)


class UnbufferedFile:
    """A new file (created, never an existing one) written around the page cache, as a
    binary file object that can only write: `write`, `tell` (the bytes written so far),
    `flush` (nothing: whole blocks go out as they fill), and `finish`, which writes the
    rest, makes the file its bytes long and fsyncs it. Use it as a context manager."""

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags | _DIRECT, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fd = os.open(path, flags, 0o666)
        self.buffer = _take()
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        source = memoryview(data).cast("B")
        total = len(source)
        while source:
            take = min(len(source), CHUNK - self.filled)
            self.view[self.filled : self.filled + take] = source[:take]
            self.filled += take
            source = source[take:]
            if self.filled == CHUNK:
                self._out(CHUNK)
                self.filled = 0
        self.size += total
        return total

    def _out(self, length: int) -> None:
        view = self.view[:length]
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as exc:
                _without_direct(self.fd, exc)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing: whole blocks go out as they fill, and the rest with `finish`."""

    def finish(self) -> int:
        """Write what is left, make the file its bytes long and durable: its size. A file
        that fits one buffer goes through the page cache: it is small, and a reader soon
        after (a training step reading its rows) finds it there."""
        if self.size == self.filled:
            _set_direct(self.fd, False)
            self._out(self.filled)
        elif self.filled:
            padded = -(-self.filled // BLOCK) * BLOCK
            self.view[self.filled : padded] = bytes(padded - self.filled)
            self._out(padded)
            os.ftruncate(self.fd, self.size)
        self.filled = 0
        os.fsync(self.fd)
        return self.size

    def __enter__(self) -> UnbufferedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            self.view = memoryview(b"")  # no view of the buffer is left here when it goes back
            _give_back(self.buffer)


def read_chunks(fd: int, limit: int) -> Iterator[memoryview]:
    """The bytes of the open file `fd` from where it stands (its start, as opened) up to
    `limit` bytes, a chunk at a time, read around the page cache where the file system
    allows. A chunk is good until the next one is asked for: copy what must be kept."""
    try:
        _set_direct(fd, True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise  # else: read through the page cache
    buffer = _take()
    try:
        view = memoryview(buffer)
        done = 0
        while done < limit:
            try:
                got = os.readv(fd, [buffer])
            except OSError as exc:
                _without_direct(fd, exc)
                continue
            if not got:
                return
            if got % BLOCK:
                # The end of the file, or a short read that would leave the next one
                # unaligned: whatever follows comes through the page cache.
                _set_direct(fd, False)
            yield view[: min(got, limit - done)]
            done += got
    finally:
        _give_back(buffer)
