"""Where an output lives: one value, parsed once, that knows its file system and how it commits.

An output is a local path or a URI. `parse_location` reads it once, at the front door,
into a `Location`, and every layer after it (the builder tasks that write shards, the
commit, the readers, retirement) takes that value; none parses the string again.

- A plain path (relative or absolute) is a local output: `Location.local` is true,
  `Location.path` is its absolute `Path`, and everything about it is as it always was
  (a rename commits it, a lock file guards it, files are fsynced and opened by the safe
  rules of `raycap.capture.files`). `file:///abs/path` is the same local output.
- Text that begins like a URI (a scheme, then ":/") is a URI, never a relative path:
  `s3:/bucket/x` is refused as a malformed URI, not written to a directory named `s3:`.
  `s3://BUCKET/KEY` is an object-store output; its pyarrow file system
  (`Location.filesystem`, an `S3FileSystem`) is built from the environment as pyarrow and
  boto3 take it (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`) and
  `storage_options` (keywords of `pyarrow.fs.S3FileSystem`: `access_key`,
  `secret_key`, `session_token`, `region`, `endpoint_override`, `scheme`, ...), which
  win over the environment. The same settings make the boto3 client of the commit point.
- Any other URI that `pyarrow.fs.FileSystem.from_uri` resolves (`gs://`, `hdfs://`,
  ...) can be read (`writable` false). raycap writes only where it knows a conditional
  write, the commit point of an object store: writing there is refused before anything
  is written (`check_writable`), naming what is missing.

How it commits (`raycap.output.commit`, `raycap.output.objectstore.writes`): locally by a rename of the
staging directory; on an object store by a conditional write (If-None-Match: *) of the
output's manifest (`put_if_absent`), which exactly one of two writers wins.

Malformed text (an unknown scheme, `s3:/x`, `s3:///x`, a bucket name S3 would refuse, a
key with empty or dot segments) raises OutputError with one line naming it, without
touching the network; `check_reachable` then asks the store whether the bucket exists
and answers (a missing bucket, a bad endpoint). This module does not import Ray.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from raycap.capture.untrusted import bounded, bounded_repr
from raycap.output.faults import OutputError

# A scheme, then ":/": the beginning of a URI. Such text is never taken for a relative
# local path (`s3:/x` would otherwise become a directory named `s3:`).
_URI_START = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/")
# The schemes pyarrow's `FileSystem.from_uri` knows; raycap commits only to those in
# COMMITS_TO (a conditional write it can make: S3's If-None-Match).
KNOWN_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")
COMMITS_TO = ("s3",)
# How often a conditional write is retried while S3 reports a conflicting one in flight.
_CONFLICT_RETRIES = 5
# S3's bucket naming rules (what a bucket name can be at all).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# The keywords of pyarrow's S3FileSystem that also configure the boto3 client of the
# commit point, by boto3's name.
_BOTO_NAMES = {
    "access_key": "aws_access_key_id",
    "secret_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "region": "region_name",
}


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

    @property
    def filesystem(self) -> Any:
        """The pyarrow file system, built on first use and kept (also across a pickle)."""
        if self._fs is None:
            object.__setattr__(self, "_fs", _filesystem(self.scheme, self.uri, self.options))
        return self._fs

    # --- objects (a store's; a local output uses its own files, `raycap.output.durable`) ------------

    def info(self) -> Any:
        """pyarrow's FileInfo of this location (FileType.NotFound when nothing is there)."""
        return self.filesystem.get_file_info(self.fs_path)

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return self.info().type != pafs.FileType.NotFound

    def files(self) -> dict[str, int]:
        """Every object under this location, by its path relative to it, with its size
        (one listing)."""
        import pyarrow.fs as pafs

        base = self.fs_path.rstrip("/") + "/"
        found = self.filesystem.get_file_info(pafs.FileSelector(self.fs_path, recursive=True, allow_not_found=True))
        return {f.path[len(base):]: f.size for f in found if f.type == pafs.FileType.File and f.path.startswith(base)}

    def entries(self) -> list[str]:
        """The names directly under this location (objects and folders), one listing."""
        import pyarrow.fs as pafs

        found = self.filesystem.get_file_info(pafs.FileSelector(self.fs_path, recursive=False, allow_not_found=True))
        return sorted(f.base_name for f in found)

    def read_bytes(self, limit: int | None = None, *, what: str = "file") -> bytes:
        """The object's bytes; FileNotFoundError when it is missing, OutputError when it
        is over `limit` bytes (judged by its size before it is read)."""
        import pyarrow.fs as pafs

        info = self.info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.uri)
        if info.type != pafs.FileType.File:
            raise OutputError(f"{what} {self.uri} is not an object but a folder; replace it with the {what} itself")
        if limit is not None and info.size > limit:
            raise OutputError(
                f"{what} {self.uri} is {info.size} bytes, more than the {limit} bytes raycap reads of a {what}; "
                "check what it holds, or replace it"
            )
        with self.filesystem.open_input_stream(self.fs_path) as stream:
            return stream.read()

    def put_bytes(self, data: bytes) -> None:
        """Write the object whole (one PUT: a reader sees the old object or the new one)."""
        with self.filesystem.open_output_stream(self.fs_path) as stream:
            stream.write(data)

    def put_if_absent(self, data: bytes) -> bool:
        """The commit point: write the object only if no object is at its key
        (If-None-Match: *); False when one is (another writer won). Exactly one of two
        concurrent writers gets True."""
        if self.scheme not in COMMITS_TO:
            raise OutputError(_no_conditional_write(self))
        from botocore.exceptions import ClientError

        client = _s3_client(self.options)
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                client.put_object(Bucket=self.bucket, Key=self.key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code"))
                if code in ("PreconditionFailed", "412"):
                    return False
                if code in ("ConditionalRequestConflict", "409") and attempt < _CONFLICT_RETRIES:
                    # Another conditional write of the key is in flight: S3 asks for a retry,
                    # which then fails (412) if that one succeeded, or succeeds if it did not.
                    time.sleep(0.2 * (attempt + 1))
                    continue
                raise OSError(f"the store refused the write of {self.uri}: {code}: {error.get('Message')}") from None
        raise AssertionError("unreachable")

    def copy_to(self, target: "Location") -> None:
        """A copy made by the store itself (server-side): the target appears whole."""
        self.filesystem.copy_file(self.fs_path, target.fs_path)

    def delete(self) -> None:
        """Remove this object (nothing when it is missing)."""
        try:
            self.filesystem.delete_file(self.fs_path)
        except FileNotFoundError:
            pass

    def delete_all(self, names: Iterable[str] | None = None) -> None:
        """Remove the objects `names` under this location, or with None the whole
        prefix (and the folder markers a store keeps for it)."""
        if names is None:
            if self.exists():
                self.filesystem.delete_dir(self.fs_path)
            return
        for name in names:
            self.child(name).delete()


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


def check_reachable(location: Location) -> None:
    """Ask the store of a URI output whether its bucket is there: OutputError (one line)
    for a missing bucket or a store that does not answer (a bad endpoint, bad
    credentials). A local location passes: its parent is made and probed by its writer."""
    if location.local:
        return
    import pyarrow.fs as pafs

    try:
        found = location.filesystem.get_file_info(location.bucket).type
    except (OSError, ValueError) as exc:
        where = location.options.get("endpoint_override") or _env_endpoint() or "the default endpoint"
        raise OutputError(
            f"output {location.uri}: the store at {where} cannot be reached ({bounded(exc, 240)}); check the endpoint "
            "(AWS_ENDPOINT_URL or storage_options) and the credentials (AWS_*), then rerun"
        ) from None
    if found == pafs.FileType.NotFound:
        raise OutputError(
            f"output {location.uri}: the bucket {location.bucket} does not exist; create it (raycap never creates "
            "buckets) or choose another bucket"
        )


def as_location(output: Any) -> Location:
    """A Location for `output` (a Location as it is, else parsed as text)."""
    return output if isinstance(output, Location) else parse_location(output)


# --- the stores' clients ---------------------------------------------------------------------------


def _env_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _env_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def _filesystem(scheme: str, uri: str, options: dict[str, Any]) -> Any:
    import pyarrow.fs as pafs

    if scheme == "":
        return pafs.LocalFileSystem()
    if scheme == "s3":
        # pyarrow's S3FileSystem does not read AWS_ENDPOINT_URL itself (from_uri does, and
        # asks the network for the bucket's region): both are given here, explicitly, so
        # the file system a task receives carries them.
        settings: dict[str, Any] = {}
        if _env_endpoint():
            settings["endpoint_override"] = _env_endpoint()
        if _env_region():
            settings["region"] = _env_region()
        settings.update(options)
        try:
            return pafs.S3FileSystem(**settings)
        except TypeError as exc:
            raise OutputError(f"output {uri}: storage_options {bounded(exc)}; give keywords of pyarrow.fs.S3FileSystem") from None
    try:
        filesystem, _ = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as exc:
        raise OutputError(f"output {uri} cannot be opened ({bounded(exc, 240)}); check the URI and the store's settings") from None
    return filesystem


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _s3_client(options: dict[str, Any]) -> Any:
    """The boto3 S3 client configured as the location's file system is (one per setting)."""
    settings: dict[str, Any] = {"region_name": _env_region(), "endpoint_url": _env_endpoint()}
    for name, boto_name in _BOTO_NAMES.items():
        if options.get(name):
            settings[boto_name] = options[name]
    endpoint = options.get("endpoint_override")
    if endpoint:
        settings["endpoint_url"] = endpoint if "://" in endpoint else f"{options.get('scheme') or 'https'}://{endpoint}"
    key = tuple(sorted((k, str(v)) for k, v in settings.items()))
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            import boto3

            _CLIENTS[key] = boto3.session.Session().client("s3", **{k: v for k, v in settings.items() if v is not None})
        return _CLIENTS[key]
