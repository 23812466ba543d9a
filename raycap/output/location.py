"""Where an output lives: one value, parsed once at the front door, that every layer takes.

- `parse_location` reads a path or a URI once into a `Location`; the builder tasks, the
  commit, the readers and retirement take that value, and none parses the text again.
- A plain path (or `file:///abs/path`) is a local output: `Location.local` is true and
  `Location.path` its absolute `Path`.
- Text that begins like a URI (a scheme, then ":/") is a URI, never a relative path:
  `s3:/bucket/x` is refused, not written to a directory named `s3:`. `s3://BUCKET/KEY`
  is an object-store output, with its `storage_options`; any other URI pyarrow opens
  (`gs://`, `hdfs://`, ...) can be read but not written (`writable`, `check_writable`):
  raycap commits only where it knows a conditional write (COMMITS_TO).
- Malformed text (an unknown scheme, `s3:///x`, a bucket name S3 would refuse, a key
  with empty or dot segments) raises OutputError naming it, without the network.

A Location only says where an output is. Talking to its store (the file system, the S3
client, the conditional PUT, asking whether a bucket exists) is the object-store
backend's (`raycap.output.objectstore.client`), which keeps the file system on the
Location so that builder tasks get it as it is. This module does not import Ray.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from raycap.capture.untrusted import bounded_repr
from raycap.output.faults import OutputError

# A scheme, then ":/": the beginning of a URI. Such text is never taken for a relative
# local path (`s3:/x` would otherwise become a directory named `s3:`).
_URI_START = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/")
# The schemes pyarrow's `FileSystem.from_uri` knows; raycap commits only to those in
# COMMITS_TO (a conditional write it can make: S3's If-None-Match).
KNOWN_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")
COMMITS_TO = ("s3",)
# S3's bucket naming rules (what a bucket name can be at all).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def is_uri(text: Any) -> bool:
    """Whether `text` is written as a URI (a scheme, then ":/"), whatever the scheme."""
    return isinstance(text, str) and _URI_START.match(text) is not None


@dataclass(frozen=True)
class Location:
    """Where an output (or one file of it) lives. `uri` is its text: the path as given
    for a local output, `scheme://bucket/key` otherwise; `fs_path` is its path inside
    `filesystem` (absolute). Pickles whole, file system included (builder tasks get it
    as it is)."""

    uri: str
    scheme: str  # "" for a local output
    fs_path: str
    storage_options: tuple[tuple[str, Any], ...] = ()
    _fs: Any = field(default=None, compare=False, repr=False)

    @staticmethod
    def parse(output: Any, storage_options: Mapping[str, Any] | None = None) -> "Location":
        """`parse_location`: the front door, under the value's own name."""
        return parse_location(output, storage_options)

    def __str__(self) -> str:
        return self.uri

    def __fspath__(self) -> str:
        """A local location is a path (`Path(location)` works); a store's is not: a
        TypeError, so that no code takes a URI for a local path by mistake."""
        if not self.local:
            raise TypeError(f"{self.uri} is on an object store, not a local path")
        return self.uri

    @property
    def local(self) -> bool:
        return self.scheme == ""

    @property
    def writable(self) -> bool:
        """Whether raycap can commit here: locally, or on a store in COMMITS_TO."""
        return self.local or self.scheme in COMMITS_TO

    @property
    def path(self) -> Path:
        """The local path; a ValueError for an object-store location, which has none."""
        if not self.local:
            raise ValueError(f"{self.uri} is not a local path")
        return Path(self.uri)

    @property
    def name(self) -> str:
        return self.fs_path.rstrip("/").rpartition("/")[2]

    @property
    def bucket(self) -> str:
        return self.fs_path.partition("/")[0]

    @property
    def key(self) -> str:
        return self.fs_path.partition("/")[2]

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.storage_options)

    def _moved(self, fs_path: str) -> "Location":
        if self.local:
            uri = fs_path
        else:
            uri = f"{self.scheme}://{fs_path}"
        moved = Location(uri, self.scheme, fs_path, self.storage_options)
        object.__setattr__(moved, "_fs", self._fs)
        return moved

    def child(self, relative: str) -> "Location":
        """The file or folder `relative` (a name checked by its caller) inside this one."""
        return self._moved(self.fs_path.rstrip("/") + "/" + relative)

    def sibling(self, name: str) -> "Location":
        """`name` beside this one, in the same folder."""
        return self._moved(self.fs_path.rstrip("/").rpartition("/")[0] + "/" + name)

    @property
    def parent(self) -> "Location":
        return self._moved(self.fs_path.rstrip("/").rpartition("/")[0] or "/")


def _no_conditional_write(location: Location) -> str:
    return (
        f"output {location.uri}: raycap commits an output only with a conditional write (If-None-Match), which it "
        f"makes on {', '.join(s + '://' for s in COMMITS_TO)} but not on {location.scheme}://; write the output to "
        "s3:// or a local (shared) path, then copy it there"
    )


def _refused(text: str, problem: str) -> OutputError:
    return OutputError(f"output {bounded_repr(text)} {problem}")


def _checked_key(text: str, key: str) -> str:
    key = key.rstrip("/")
    if not key:
        raise _refused(text, "names a bucket but no key inside it; give s3://BUCKET/NAME")
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise _refused(text, "has an empty, '.' or '..' part in its key; write the key without them")
    if any(ord(c) < 32 or ord(c) == 127 or c == "\\" for c in key):
        raise _refused(text, "holds a control character or a backslash in its key; choose a plain key")
    return key


def _options(storage_options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    if storage_options is None:
        return ()
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise TypeError(f"storage_options must be a mapping of option names to values, not {type(storage_options).__name__}")
    return tuple(sorted(storage_options.items()))


def parse_location(
    output: Any, storage_options: Mapping[str, Any] | None = None, *, what: str = "output"
) -> Location:
    """`output` (a path, a URI or a Location) as a Location, checked as text only (see the
    module docstring); OutputError (one line) for a malformed or unknown URI, TypeError
    for something that is no path at all. A Location passes through (`storage_options`,
    when given, then replace its own)."""
    if isinstance(output, Location):
        if storage_options is None or output.local:
            return output
        return Location(output.uri, output.scheme, output.fs_path, _options(storage_options))
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or a URI (str or os.PathLike), not {type(output).__name__}")
    text = os.fspath(output)
    if isinstance(text, bytes):
        raise TypeError(f"{what} must be a str path or URI, not bytes")
    options = _options(storage_options)
    match = _URI_START.match(text)
    if match is None:
        if not text:
            raise OutputError(f"{what} is empty; give a path or a URI")
        # As given (a local output reads as it always did), its file-system path absolute.
        return Location(text, "", os.path.abspath(text))
    scheme = match.group(1).lower()
    if scheme not in KNOWN_SCHEMES:
        raise _refused(
            text,
            f"has the unknown scheme {scheme}://; give a local path or a URI pyarrow opens ("
            + ", ".join(s + "://" for s in KNOWN_SCHEMES if s != "mock") + ")",
        )
    rest = text[match.end():]
    if not rest.startswith("/"):
        raise _refused(text, f"is not a URI: {scheme}: must be followed by two slashes ({scheme}://...)")
    rest = rest[1:]
    if "?" in rest or "#" in rest:
        raise _refused(text, "carries a query or fragment; give the store's options as storage_options")
    if scheme == "file":
        if rest and not rest.startswith("/"):
            raise _refused(text, "names a host; a file:// URI is file:///ABSOLUTE/PATH")
        path = os.path.normpath(rest or "/")
        return Location(path, "", path)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise _refused(text, f"has no bucket (nothing between {scheme}:// and the next /); give {scheme}://BUCKET/NAME")
    if scheme == "s3" and not _BUCKET.match(bucket):
        raise _refused(
            text,
            f"names the bucket {bounded_repr(bucket)}, which is no S3 bucket name (3 to 63 lowercase letters, "
            "digits, dots or hyphens); check the URI",
        )
    key = _checked_key(text, key)
    return Location(f"{scheme}://{bucket}/{key}", scheme, f"{bucket}/{key}", options)


def check_writable(location: Location) -> None:
    """OutputError (one line) unless raycap can commit at `location` (see COMMITS_TO)."""
    if not location.writable:
        raise OutputError(_no_conditional_write(location))


def as_location(output: Any) -> Location:
    """A Location for `output` (a Location as it is, else parsed as text)."""
    return output if isinstance(output, Location) else parse_location(output)
