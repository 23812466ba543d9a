"""Untrusted input: small files read by path, and text quoting what they hold.

A manifest, a retire marker, a job config or a rollout id file may be anything a user or
an attacker left at its path. `read_small_file` opens it as capture files are opened
(`raycap.capturefiles.open_regular`): never through a symbolic link, never waiting on a
FIFO, and only a regular file (no socket, device or directory); a file over its size
limit is refused by fstat before a byte is read. Each refusal is an `UnsafeFileError`
whose message is one line naming the file, what it is, and the way out.

An error message that quotes such input quotes it bounded (`bounded`, `bounded_repr`):
a value of any size or depth (a YAML alias bomb expands to gigabytes) becomes a short
line, and nothing large is formatted on the way.

This module does not import Ray.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path
from typing import Any

from raycap.capturefiles import open_regular, read_at

# How much of a quoted value an error message shows.
QUOTE_CHARS = 200


class UnsafeFileError(ValueError):
    """A file raycap was asked to read is not a regular file (a symbolic link, FIFO,
    socket, device or directory) or is larger than such a file may be; nothing of it was
    read. The message is one line naming the file and the way out."""


def read_small_file(path: Path | str, *, limit: int, what: str, head: bool = False) -> bytes:
    """The bytes of a small file raycap reads by path (a manifest, a marker, a config),
    opened as capture files are: UnsafeFileError, one line naming `what` and the path,
    for anything but a regular file, or for one over `limit` bytes (judged before a byte
    is read, and again by what was read, should it grow meanwhile). With `head`, only
    its first `limit` bytes are read, whatever its size. FileNotFoundError and other
    OSErrors pass through."""

    def refuse(kind: str) -> UnsafeFileError:
        return UnsafeFileError(
            f"{what} {path} is not a regular file but {kind}; raycap reads only regular files, never through a "
            "link: replace it with the file itself"
        )

    fd = open_regular(path, os.O_RDONLY, refuse)
    try:
        if head:
            return read_at(fd, limit)
        size = os.fstat(fd).st_size
        data = b"" if size > limit else read_at(fd, limit + 1)
    finally:
        os.close(fd)
    if size > limit or len(data) > limit:
        raise UnsafeFileError(
            f"{what} {path} is {max(size, len(data))} bytes, more than the {limit} bytes raycap reads of a {what}; "
            "check what it holds, or replace it"
        )
    return data


def bounded(text: Any, limit: int = QUOTE_CHARS) -> str:
    """`text` on one line, cut to `limit` characters (saying how many were left out)."""
    text = str(text)
    head = " ".join(text[: limit + 1].split())
    if len(text) <= limit:
        return head
    return f"{head[:limit]}... ({len(text) - limit} more characters)"


_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxstring = _SHORT.maxother = QUOTE_CHARS
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 6


def bounded_repr(value: Any, limit: int = QUOTE_CHARS) -> str:
    """The repr of `value`, cut at every level (a few items, a few levels deep) and to
    `limit` characters in all, without ever formatting the whole of it."""
    return bounded(_SHORT.repr(value), limit)
