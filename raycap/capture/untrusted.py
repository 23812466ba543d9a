"""Untrusted input: small files read by path, and text quoting what they hold.

A manifest, a retire marker, a job config or a rollout id file may be anything a user or
an attacker left at its path. `read_small_file` opens it as capture files are opened
(`raycap.capture.files.open_regular`): never through a symbolic link, never waiting on a
FIFO, and only a regular file (no socket, device or directory); a file over its size
limit is refused by fstat before a byte is read. Each refusal is an `UnsafeFileError`
whose message is one line naming the file, what it is, and the way out.

JSON that raycap did not write (a results line, a capture line read on the slow path, a
manifest, a marker, a state file) is parsed by `loads_untrusted`: nesting deeper than
`MAX_JSON_DEPTH` (orjson's own bound, which the fast paths keep) is refused before the
parser recurses, and every way the text can fail (not JSON, not UTF-8, NaN or Infinity
where the file holds none, an integer literal of more digits than Python converts, a
parser out of stack) is one `UntrustedJSONError`, a `json.JSONDecodeError`, never a
RecursionError or OverflowError that names neither the file nor the line.

An error message that quotes such input quotes it bounded (`bounded`, `bounded_repr`):
a value of any size or depth (a YAML alias bomb expands to gigabytes) becomes a short
line, and nothing large is formatted on the way.

This module does not import Ray.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from pathlib import Path
from typing import Any

import orjson

from raycap.capture.files import open_regular, read_at

# How much of a quoted value an error message shows.
QUOTE_CHARS = 200


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


# How deep JSON from a file raycap did not write may nest: orjson's own limit, so the fast
# path and the slow path refuse the same lines.
MAX_JSON_DEPTH = 1024


# A JSON string (what it holds may look like brackets), and the brackets outside them.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_NESTING = re.compile(rb"[\[\]{}]")


def nests_deeper(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `data` opens more than `limit` arrays or objects inside one
    another, judged without parsing it (a text with few brackets at memory speed)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth = 0
    for match in _NESTING.finditer(_JSON_STRING.sub(b"", data)):
        if match.group() in b"[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


# An integer literal of 19 or more digits: orjson reads one beyond 64 bits as a float,
# Python's json exactly, and the exact value is the record's (an id in an output item,
# say), so such lines take Python's json. Found at memory speed, byte by byte: digits and
# the minus sign become "0", what a JSON value can follow ("[", ",", ":" and JSON
# whitespace) " ", all else "x". A number starts a value, so an integer literal of 19
# digits or more is " " and 19 "0"s (or the text's first 19 bytes); a fraction's or an
# exponent's digits follow "." or "e" and never are. Digits inside a string match only
# after such a character ("a, 1234..."): that line takes the exact path, which is only
# slower. An id like "run-1733059200123456789" (a letter or digit before the hyphen)
# does not: a capture whose ids hold nanosecond timestamps or 64-bit ids stays fast.
_NUMBER_MASK = bytes(
    0x30 if 0x30 <= b <= 0x39 or b == 0x2D else 0x20 if b in b"[,: \t\r\n" else 0x78 for b in range(256)
)
from raycap.errors import (
    UnsafeFileError,  # noqa: F401 - raised here, declared with the others
    UntrustedJSONError,  # noqa: F401 - raised here, declared with the others
)

_BIG_INT_DIGITS = b"0" * 19
_BIG_INT_START = b" " + _BIG_INT_DIGITS


def has_big_int(text: bytes) -> bool:
    masked = text.translate(_NUMBER_MASK)
    # A run of 19 digits first: searching for it is a third of the cost of searching for
    # one that starts a value, and most lines have none.
    return _BIG_INT_DIGITS in masked and (_BIG_INT_START in masked or masked.startswith(_BIG_INT_DIGITS))


class _Constant(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


def loads_untrusted(data: bytes | bytearray | memoryview | str, what: str = "JSON", *, allow_nan: bool = False) -> Any:
    """`data` parsed as Python's json parses it (exact integers, lone surrogates kept),
    from a file raycap did not write: UntrustedJSONError, one line starting with `what`,
    when it nests deeper than MAX_JSON_DEPTH, is not JSON or not UTF-8, or (unless
    `allow_nan`: a results or capture line, where a log prob may be NaN) holds NaN or
    Infinity. Nothing else escapes (no RecursionError, no OverflowError)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    # orjson first: it bounds the depth itself, at C speed. What it reads inexactly (a
    # big integer) or refuses (NaN, a lone surrogate, a bad byte) takes Python's json.
    try:
        if not has_big_int(raw):
            return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg.startswith("depth limit"):
            raise UntrustedJSONError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels") from None
    if nests_deeper(raw):
        raise UntrustedJSONError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw, parse_constant=None if allow_nan else _refuse_constant)
    except _Constant as exc:
        raise UntrustedJSONError(f"{what} holds {exc}, which is not a JSON number") from None
    except RecursionError:
        raise UntrustedJSONError(f"{what} nests arrays or objects too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise UntrustedJSONError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise UntrustedJSONError(f"{what} is not JSON ({exc})") from None
    except ValueError as exc:  # an integer literal beyond Python's conversion limit
        raise UntrustedJSONError(f"{what} is not JSON raycap can read ({bounded(exc)})") from None


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
