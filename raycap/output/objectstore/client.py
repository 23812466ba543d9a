"""The object store's client: the pyarrow file system of a location, the boto3 S3 client
and its conditional PUT (the commit point), and the object primitives the object-store
backend is made of.

- The file system is built from the environment as pyarrow and boto3 take it
  (`AWS_*`, `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`) and the location's
  `storage_options` (keywords of `pyarrow.fs.S3FileSystem`), which win; it is kept on
  the location, so builder tasks get it as it is.
- The same settings make the boto3 client of the commit point (`put_if_absent`:
  If-None-Match: *, which exactly one of two writers wins).
- `check_reachable` asks the store whether a bucket is there.

This module does not import Ray.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable

from raycap.capture.untrusted import bounded
from raycap.output.faults import OutputError
from raycap.output.location import COMMITS_TO, Location, _no_conditional_write

# How often a conditional write is retried while S3 reports a conflicting one in flight.
_CONFLICT_RETRIES = 5
# The keywords of pyarrow's S3FileSystem that also configure the boto3 client of the
# commit point, by boto3's name.
_BOTO_NAMES = {
    "access_key": "aws_access_key_id",
    "secret_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "region": "region_name",
}


def filesystem(location: Location) -> Any:
    """The location's pyarrow file system, built on first use and kept on the location,
    which carries it along (also across a pickle: builder tasks get it as it is)."""
    if location._fs is None:
        object.__setattr__(location, "_fs", _filesystem(location.scheme, location.uri, location.options))
    return location._fs


def info(location: Location) -> Any:
    """pyarrow's FileInfo of this location (FileType.NotFound when nothing is there)."""
    return filesystem(location).get_file_info(location.fs_path)


def exists(location: Location) -> bool:
    import pyarrow.fs as pafs

    return info(location).type != pafs.FileType.NotFound


def files(location: Location) -> dict[str, int]:
    """Every object under this location, by its path relative to it, with its size
    (one listing)."""
    import pyarrow.fs as pafs

    base = location.fs_path.rstrip("/") + "/"
    found = filesystem(location).get_file_info(pafs.FileSelector(location.fs_path, recursive=True, allow_not_found=True))
    return {f.path[len(base):]: f.size for f in found if f.type == pafs.FileType.File and f.path.startswith(base)}


def entries(location: Location) -> list[str]:
    """The names directly under this location (objects and folders), one listing."""
    import pyarrow.fs as pafs

    found = filesystem(location).get_file_info(pafs.FileSelector(location.fs_path, recursive=False, allow_not_found=True))
    return sorted(f.base_name for f in found)


def read_bytes(location: Location, limit: int | None = None, *, what: str = "file") -> bytes:
    """The object's bytes; FileNotFoundError when it is missing, OutputError when it
    is over `limit` bytes (judged by its size before it is read)."""
    import pyarrow.fs as pafs

    found = info(location)
    if found.type == pafs.FileType.NotFound:
        raise FileNotFoundError(location.uri)
    if found.type != pafs.FileType.File:
        raise OutputError(f"{what} {location.uri} is not an object but a folder; replace it with the {what} itself")
    if limit is not None and found.size > limit:
        raise OutputError(
            f"{what} {location.uri} is {found.size} bytes, more than the {limit} bytes raycap reads of a {what}; "
            "check what it holds, or replace it"
        )
    with filesystem(location).open_input_stream(location.fs_path) as stream:
        return stream.read()


def put_bytes(location: Location, data: bytes) -> None:
    """Write the object whole (one PUT: a reader sees the old object or the new one)."""
    with filesystem(location).open_output_stream(location.fs_path) as stream:
        stream.write(data)


def put_if_absent(location: Location, data: bytes) -> bool:
    """The commit point: write the object only if no object is at its key
    (If-None-Match: *); False when one is (another writer won). Exactly one of two
    concurrent writers gets True."""
    if location.scheme not in COMMITS_TO:
        raise OutputError(_no_conditional_write(location))
    from botocore.exceptions import ClientError

    client = _s3_client(location.options)
    for attempt in range(_CONFLICT_RETRIES + 1):
        try:
            client.put_object(Bucket=location.bucket, Key=location.key, Body=data, IfNoneMatch="*")
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
            raise OSError(f"the store refused the write of {location.uri}: {code}: {error.get('Message')}") from None
    raise AssertionError("unreachable")


def copy_to(location: Location, target: Location) -> None:
    """A copy made by the store itself (server-side): the target appears whole."""
    filesystem(location).copy_file(location.fs_path, target.fs_path)


def delete(location: Location) -> None:
    """Remove this object (nothing when it is missing)."""
    try:
        filesystem(location).delete_file(location.fs_path)
    except FileNotFoundError:
        pass


def delete_all(location: Location, names: Iterable[str] | None = None) -> None:
    """Remove the objects `names` under this location, or with None the whole
    prefix (and the folder markers a store keeps for it)."""
    if names is None:
        if exists(location):
            filesystem(location).delete_dir(location.fs_path)
        return
    for name in names:
        delete(location.child(name))


def check_reachable(location: Location) -> None:
    """Ask the store of a URI output whether its bucket is there: OutputError (one line)
    for a missing bucket or a store that does not answer (a bad endpoint, bad
    credentials). A local location passes: its parent is made and probed by its writer."""
    if location.local:
        return
    import pyarrow.fs as pafs

    try:
        found = filesystem(location).get_file_info(location.bucket).type
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
